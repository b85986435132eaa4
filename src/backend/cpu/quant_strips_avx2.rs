//! Q4_0, Q8_0, Q4_K, Q5_K and Q6_K products on AVX2 reading the weight in strips of 16 interleaved rows (`quant::strips`), as
//! `quant_strips` does on AVX-512 VNNI: each 32-bit lane of a `ymm` is one weight row, so a 32-byte
//! load is 4 levels of 8 rows, and one conversion, multiply and FMA per block scale 8 rows at once.
//! Semantics as `quant_product`'s (the same rounded activations, exact integer sums per block of
//! 32, one `f32` scale per block); only the instruction sequence differs.
//!
//! Why strips on AVX2 too: the row kernels (`quant_product::avx2::row`) spend about eight
//! instructions per token, row and block (the token's levels signed by the weight's, two multiply
//! steps, a conversion, a scale multiplied and broadcast, the FMA), and on a CPU without AVX-512
//! that is the bound, not the memory: on a 2-core Zen 1, one token of a streamed Q4_0 weight ran at
//! 6.2 GB/s where Q8_0 (twice the bytes, the same instructions) reached 11.8, and eight tokens cost
//! 4.7x one. Here a token costs per block of 16 rows its 8 broadcast 4-byte groups, 16 `vpmaddubsw`
//! and their 16-bit sums, and per 8 rows one widening, one bias, one conversion and one FMA.
//!
//! The stored levels are unsigned (Q4_0's nibble `q`, value `d · (q − 8)`; Q4_K's and Q5_K's,
//! `(d · sc) · q − dmin · m`; Q6_K's 6 bits, value `(d · sc) · (q − 32)`) and the tokens' levels
//! signed (`|x| <= 127`), so `vpmaddubsw` multiplies them exactly: a pair of Q4_0 products is at
//! most 2 · 15 · 127 = 3,810 in magnitude and a block's 8 pairs per lane at most 30,480, inside an
//! `i16` without saturation (Q5_K's pairs, up to 7,874, are widened four at a time, Q6_K's, up to
//! 16,002, two at a time). Each lane then subtracts `8 · Σ x` of the token's block (`32 · Σ x` of
//! Q6_K's 16 values; Q4_K's and Q5_K's minimums go in through the token's `d · Σ x`, as the other
//! kernels add them). Q8_0's stored byte (its level plus 128) is too large for that: its kernel
//! multiplies the level's magnitude by the token's level given the level's sign.

use std::arch::x86_64::*;

use super::few_rows::Columns;
use super::quant_product::{Activations, BLOCK};
use super::quant_strips::{BlockSums, operands_fit};
use super::quant_vnni::by_token_chunks;
use crate::quant::strips::{STRIP_ROWS, k4_sub_block, strip_block_bytes};
use crate::quant::{QK_K, QuantType};

/// How far ahead of the bytes they read the AVX2 kernels ask for the strip's lines. Batched
/// decoding streams weights too large for any cache while its tokens' arithmetic slows the walk:
/// the hardware prefetcher alone then kept too few lines in flight, and the kernel stalled on the
/// first loads of every block. (The AVX-512 kernels ask 8 KiB ahead for several tokens since a
/// Zen 5 measured it; no AVX2-only machine has measured a change from 2 KiB.)
const PREFETCH: usize = 2048;

/// Asks for the cache lines of the `len` bytes [`PREFETCH`] after `at` on the `first` pass over a
/// strip (tokens from 0), for any number of tokens: on the AVX2-only Zen 1 even one token's walk
/// ran ahead of the hardware prefetcher (a streamed one-token product 20-45 % faster with these
/// requests; the AVX-512 kernels, measured on a Zen 4 where one token was paced by the memory, ask
/// only for batches). Later passes (a prompt's tokens past the first chunk) find the strip in cache.
/// The K formats' blocks (2-3 KiB) are asked for a sixteenth at a time, before each 32 values of
/// each half: asking for a whole block at once made the one-token walk 20 % slower than asking for
/// nothing. A prefetch never faults ([`super::prefetch_lines`]).
#[inline(always)]
fn prefetch(first: bool, at: *const u8, len: usize) {
    if first {
        super::prefetch_lines(at.wrapping_add(PREFETCH), len);
    }
}

/// Tokens per pass over a strip: the weight's levels are split from their nibbles once for all of
/// them.
const TOKENS: usize = 4;
/// A pass's sums, token by token, of a strip's 16 rows: kept by the caller for all the strips of a
/// task, as the AVX-512 kernels' are.
pub(super) type StripSums = [[f32; STRIP_ROWS]; TOKENS];

/// Whether this module multiplies `ty`'s strips.
pub(super) fn reads(ty: QuantType) -> bool {
    matches!(
        ty,
        QuantType::Q4_0 | QuantType::Q8_0 | QuantType::Q4_K | QuantType::Q5_K | QuantType::Q6_K
    )
}

/// Column `first + r` of `columns`, row `t` `= x̂_t · ŵ_r` for the 16 rows of `strip` (a strip of
/// `ty`, `k` values per row) and every token `t` of `a` (`sums`: its [`BlockSums`] for `ty`).
///
/// # Panics
/// When [`reads`] refuses `ty`, the CPU lacks AVX2, FMA or F16C, or the operands do not fit (`k`
/// whole blocks, `m` tokens of `k` in `a`, the columns `first..first + 16` in `columns`).
#[allow(clippy::too_many_arguments)]
pub(super) fn strip_product(
    ty: QuantType,
    strip: &[u8],
    a: &Activations,
    sums: &BlockSums,
    (m, k): (usize, usize),
    columns: &mut Columns<'_>,
    first: usize,
    out: &mut StripSums,
) {
    assert!(reads(ty), "{ty} has no AVX2 strip kernel");
    assert!(
        operands_fit(ty, strip, a, sums, (m, k), columns, first),
        "quantized strip product: operands do not fit their shape"
    );
    assert!(
        std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c"),
        "the AVX2 strip kernel needs AVX2, FMA and F16C"
    );
    by_token_chunks(m, TOKENS, |t0, run| {
        // SAFETY: the CPU has AVX2, FMA and F16C (asserted); the assertions above keep every read
        // inside the strip and the tokens t0..t0 + run <= m, with their block sums.
        unsafe {
            let (starts, values) = (sums.starts(), sums.values());
            match (ty, run) {
                (QuantType::Q4_K, 4) => q4_k::<4, false>(strip, a, values, k, t0, out),
                (QuantType::Q4_K, 2) => q4_k::<2, false>(strip, a, values, k, t0, out),
                (QuantType::Q4_K, _) => q4_k::<1, false>(strip, a, values, k, t0, out),
                (QuantType::Q5_K, 4) => q4_k::<4, true>(strip, a, values, k, t0, out),
                (QuantType::Q5_K, 2) => q4_k::<2, true>(strip, a, values, k, t0, out),
                (QuantType::Q5_K, _) => q4_k::<1, true>(strip, a, values, k, t0, out),
                (QuantType::Q8_0, 4) => small::<Q8_0, 4>(strip, a, starts, k, t0, out),
                (QuantType::Q8_0, 2) => small::<Q8_0, 2>(strip, a, starts, k, t0, out),
                (QuantType::Q8_0, _) => small::<Q8_0, 1>(strip, a, starts, k, t0, out),
                (QuantType::Q6_K, 4) => q6_k::<4>(strip, a, starts, k, t0, out),
                (QuantType::Q6_K, 2) => q6_k::<2>(strip, a, starts, k, t0, out),
                (QuantType::Q6_K, _) => q6_k::<1>(strip, a, starts, k, t0, out),
                (_, 4) => small::<Q4_0, 4>(strip, a, starts, k, t0, out),
                (_, 2) => small::<Q4_0, 2>(strip, a, starts, k, t0, out),
                _ => small::<Q4_0, 1>(strip, a, starts, k, t0, out),
            }
        }
        for (t, s) in out.iter().enumerate().take(run) {
            columns.set_run(t0 + t, first, s);
        }
    });
}

/// A 32-value format whose strip block is the 16 rows' `f16` scales (32 bytes) and then their
/// levels (Q4_0's nibble groups, Q8_0's byte groups): what [`small`] needs to know of it.
trait SmallFormat {
    /// The format.
    const TYPE: QuantType;
    /// Whether each row's dot product starts from the token's `−bias · Σ x` (`BlockSums::starts`:
    /// Q4_0's stored nibbles are its levels plus 8); not where [`SmallFormat::dot`] is signed
    /// already (Q8_0).
    const BIASED: bool;
    /// The levels of 8 rows, prepared once for all tokens.
    type Rows;

    /// The levels of the rows `rows..rows + 8` (`rows` 0 or 8) of the strip block's levels at
    /// `at`.
    ///
    /// # Safety
    /// The CPU must have AVX2; `at..at + 512` (Q4_0: 256) must be readable.
    unsafe fn rows(at: *const u8, rows: usize) -> Self::Rows;

    /// Per row (32-bit lane), `Σ` over the block's 32 values of the stored level times the token's
    /// level at `x`.
    ///
    /// # Safety
    /// The CPU must have AVX2; `x..x + 32` must be readable.
    unsafe fn dot(w: &Self::Rows, x: *const i8) -> __m256i;
}

/// Q4_0: nibble levels (0..=15), 8 below their values.
struct Q4_0;

impl SmallFormat for Q4_0 {
    const TYPE: QuantType = QuantType::Q4_0;
    const BIASED: bool = true;
    type Rows = [__m256i; 8];

    #[target_feature(enable = "avx2")]
    unsafe fn rows(at: *const u8, rows: usize) -> [__m256i; 8] {
        // SAFETY: the caller's contract.
        unsafe { nibble_levels(at, rows) }
    }

    #[target_feature(enable = "avx2")]
    unsafe fn dot(w: &[__m256i; 8], x: *const i8) -> __m256i {
        // SAFETY: the caller's contract; 8 · 2 · 15 · 127 = 30,480 fits an `i16`.
        unsafe { level_dot::<8>(w, x) }
    }
}

/// Q8_0: a stored byte is the level plus 128 (0..=255), too large for `vpmaddubsw`'s 16-bit pair
/// sums against a token's level, so the rows keep their signed levels and their magnitudes, and a
/// token's level is given the weight's sign, as llama.cpp's AVX2 Q8_0 product does: a pair of
/// products is then at most 2 · 128 · 127 = 32,512, widened per vector.
struct Q8_0;

impl SmallFormat for Q8_0 {
    const TYPE: QuantType = QuantType::Q8_0;
    const BIASED: bool = false;
    /// Vector g: values 4g..4g + 4 of the 8 rows, signed, and their magnitudes.
    type Rows = ([__m256i; 8], [__m256i; 8]);

    #[target_feature(enable = "avx2")]
    unsafe fn rows(at: *const u8, rows: usize) -> Self::Rows {
        let offset = _mm256_set1_epi8(i8::MIN);
        let signed: [__m256i; 8] = std::array::from_fn(|g| {
            // SAFETY: the caller's contract (the last load ends at 64 · 7 + 4 · 8 + 32 = 512);
            // `loadu` takes any alignment.
            let u = unsafe { _mm256_loadu_si256(at.add(64 * g + 4 * rows).cast()) };
            _mm256_xor_si256(u, offset)
        });
        // A loop, not `signed.map(..)`: see `q6_k` on closures given to `array::map`.
        let mut magnitude = signed;
        for q in &mut magnitude {
            *q = _mm256_abs_epi8(*q);
        }
        (signed, magnitude)
    }

    #[target_feature(enable = "avx2")]
    unsafe fn dot((signed, magnitude): &Self::Rows, x: *const i8) -> __m256i {
        let ones = _mm256_set1_epi16(1);
        let mut dot = _mm256_setzero_si256();
        for g in 0..8 {
            // SAFETY: the caller's contract; `read_unaligned` takes any alignment.
            let four = unsafe { std::ptr::read_unaligned(x.add(4 * g).cast::<i32>()) };
            let signed_x = _mm256_sign_epi8(_mm256_set1_epi32(four), signed[g]);
            let pairs = _mm256_maddubs_epi16(magnitude[g], signed_x);
            dot = _mm256_add_epi32(dot, _mm256_madd_epi16(pairs, ones));
        }
        dot
    }
}

/// The strip of the 32-value format `F` times tokens `t0..t0 + N` into `out[..N]`: per block and 8
/// rows, the levels prepared once, then per token their exact dot product, less `bias · Σ x`,
/// times the rows' scales and the token's.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; the strip holds `k / 32` strip blocks of `F`; the tokens
/// `t0..t0 + N` lie in `a` (levels and scales) and, when `F::BIASED`, `starts`
/// (`−bias · Σ q` per block of 32).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn small<F: SmallFormat, const N: usize>(
    strip: &[u8],
    a: &Activations,
    starts: &[i32],
    k: usize,
    t0: usize,
    out: &mut [[f32; STRIP_ROWS]; TOKENS],
) {
    let bytes = strip_block_bytes(F::TYPE);
    // Rows 0..8 and 8..16 of each token.
    let mut acc = [[_mm256_setzero_ps(); 2]; N];
    for b in 0..k / BLOCK {
        // SAFETY: the caller's contract: strip block `b` is `bytes` bytes at `b · bytes` (the 16
        // rows' `f16` scales, then their levels), and values `32 · b..32 · (b + 1)` of each token,
        // its scale and its sum, lie in `a` and `starts`; `loadu` takes any alignment.
        unsafe {
            let block = strip.as_ptr().add(b * bytes);
            prefetch(t0 == 0, block, bytes);
            for (half, rows) in [0, 8].into_iter().enumerate() {
                let scales = _mm256_cvtph_ps(_mm_loadu_si128(block.add(2 * rows).cast()));
                let w = F::rows(block.add(32), rows);
                for (t, acc) in acc.iter_mut().enumerate() {
                    let first = (t0 + t) * k + b * BLOCK;
                    let mut dot = F::dot(&w, a.q.as_ptr().add(first));
                    if F::BIASED {
                        let start = *starts.get_unchecked(first / BLOCK);
                        dot = _mm256_add_epi32(dot, _mm256_set1_epi32(start));
                    }
                    let scale =
                        _mm256_mul_ps(scales, _mm256_set1_ps(*a.d.get_unchecked(first / BLOCK)));
                    acc[half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[half]);
                }
            }
        }
    }
    store(acc, out);
}

/// The Q4_K strip (Q5_K's with `FIVE`) times tokens `t0..t0 + N` into `out[..N]`: per sub-block of
/// 32 values, the levels of 8 rows split from their nibbles (and fifth bits) once for all tokens,
/// their `vpmaddubsw` pair sums within an `i16` as Q4_0's (Q5_K's widened four vectors at a time),
/// scaled by the rows' `d · sc` times the token's `d`, less the rows' `dmin · m` times the token's
/// `d · Σ x`.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; the strip holds `k / 256` Q4_K (Q5_K) strip blocks; tokens
/// `t0..t0 + N` lie in `a` (levels and scales) and `values` (`d · Σ q` per block of 32).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_k<const N: usize, const FIVE: bool>(
    strip: &[u8],
    a: &Activations,
    values: &[f32],
    k: usize,
    t0: usize,
    out: &mut [[f32; STRIP_ROWS]; TOKENS],
) {
    let ty = if FIVE {
        QuantType::Q5_K
    } else {
        QuantType::Q4_K
    };
    let (bytes, stride) = (strip_block_bytes(ty), k4_sub_block(FIVE));
    let mut acc = [[_mm256_setzero_ps(); 2]; N];
    for i in 0..k / QK_K {
        // SAFETY: the caller's contract: strip block `i` is `bytes` bytes at `i · bytes` (`d`,
        // `dmin`, 8 × 16 scales, 8 × 16 minimums, 8 sub-blocks of 256 bytes of nibble groups and,
        // with `FIVE`, 64 of fifth bits), and values
        // `256 · i..256 · (i + 1)` of each token, their scales and sums, lie in `a` and `values`;
        // `loadu` takes any alignment.
        unsafe {
            let block = strip.as_ptr().add(i * bytes);
            for (half, rows) in [0, 8].into_iter().enumerate() {
                let d = _mm256_cvtph_ps(_mm_loadu_si128(block.add(2 * rows).cast()));
                let dmin = _mm256_cvtph_ps(_mm_loadu_si128(block.add(32 + 2 * rows).cast()));
                for s in 0..QK_K / BLOCK {
                    prefetch(
                        t0 == 0,
                        block.add((8 * half + s) * bytes / 16),
                        bytes / 16 + 1,
                    );
                    let bytes8 = |at: usize| {
                        let b = _mm_loadl_epi64(block.add(at + 16 * s + rows).cast());
                        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b))
                    };
                    // `(d · sc)` and `dmin · m` of the 8 rows, formed as the dequantizer forms them.
                    let scale = _mm256_mul_ps(d, bytes8(64));
                    let min = _mm256_mul_ps(dmin, bytes8(192));
                    let levels = block.add(320 + stride * s);
                    let mut w = nibble_levels(levels, rows);
                    if FIVE {
                        add_fifth_bits(&mut w, levels.add(256), rows);
                    }
                    for (t, acc) in acc.iter_mut().enumerate() {
                        let first = (t0 + t) * k + i * QK_K + s * BLOCK;
                        let x = a.q.as_ptr().add(first);
                        let dot = if FIVE {
                            level_dot::<4>(&w, x)
                        } else {
                            level_dot::<8>(&w, x)
                        };
                        let dot = _mm256_cvtepi32_ps(dot);
                        let xd = _mm256_set1_ps(*a.d.get_unchecked(first / BLOCK));
                        let xsum = _mm256_set1_ps(*values.get_unchecked(first / BLOCK));
                        acc[half] = _mm256_fmadd_ps(dot, _mm256_mul_ps(scale, xd), acc[half]);
                        acc[half] = _mm256_fnmadd_ps(min, xsum, acc[half]);
                    }
                }
            }
        }
    }
    store(acc, out);
}

/// The 8 level vectors of 32 values of the 8 rows `rows..rows + 8` (`rows` 0 or 8) from the four
/// 64-byte nibble groups at `at`: group c's low nibbles are values 8c..8c + 4 of each row, its high
/// ones 8c + 4..8c + 8, so vector g holds values 4g..4g + 4.
///
/// # Safety
/// The CPU must have AVX2; `at..at + 256` must be readable.
#[target_feature(enable = "avx2")]
unsafe fn nibble_levels(at: *const u8, rows: usize) -> [__m256i; 8] {
    let low = _mm256_set1_epi8(0x0f);
    std::array::from_fn(|g| {
        // SAFETY: the caller's contract (the last load ends at 64 · 3 + 4 · 8 + 32 = 256);
        // `loadu` takes any alignment.
        let v = unsafe { _mm256_loadu_si256(at.add(64 * (g / 2) + 4 * rows).cast()) };
        if g % 2 == 0 {
            _mm256_and_si256(v, low)
        } else {
            _mm256_and_si256(_mm256_srli_epi16::<4>(v), low)
        }
    })
}

/// Per row (32-bit lane), `Σ` over `4 · w.len()` values of the unsigned levels `w` (vector g:
/// values 4g..4g + 4) times the token's levels at `x`, the 16-bit pair sums of `WIDEN` vectors
/// added before each widening: the caller keeps `WIDEN · 2 · max level · 127` within an `i16`
/// (nibbles: 8 vectors, 30,480; Q5_K's 5 bits: 4, 31,496; Q6_K's 6 bits: 2, 32,004).
///
/// # Safety
/// The CPU must have AVX2; `x..x + 4 · w.len()` must be readable.
#[target_feature(enable = "avx2")]
unsafe fn level_dot<const WIDEN: usize>(w: &[__m256i], x: *const i8) -> __m256i {
    let ones = _mm256_set1_epi16(1);
    let mut sum = _mm256_setzero_si256();
    for (c, group) in w.chunks(WIDEN).enumerate() {
        let mut pairs = _mm256_setzero_si256();
        for (g, w) in group.iter().enumerate() {
            // SAFETY: the caller's contract; `read_unaligned` takes any alignment.
            let four =
                unsafe { std::ptr::read_unaligned(x.add(4 * (WIDEN * c + g)).cast::<i32>()) };
            pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(*w, _mm256_set1_epi32(four)));
        }
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(pairs, ones));
    }
    sum
}

/// Bit 4 of the 8 level vectors `w` of rows `rows..rows + 8` (`rows` 0 or 8) from the 64 bytes of
/// fifth bits at `at`: row `r`'s byte `4r + j` holds at bit `g` the fifth bit of value `4g + j`,
/// the byte vector `g` keeps for that row and value, so vector `g` takes bit `g` of each byte moved
/// to bit 4 (a 16-bit shift by at most 4 moves no bit across a byte's boundary into bit 4).
///
/// # Safety
/// The CPU must have AVX2; `at..at + 64` must be readable.
#[target_feature(enable = "avx2")]
unsafe fn add_fifth_bits(w: &mut [__m256i; 8], at: *const u8, rows: usize) {
    let fifth = _mm256_set1_epi8(0x10);
    // SAFETY: the caller's contract (4 · 8 + 32 = 64); `loadu` takes any alignment.
    let h = unsafe { _mm256_loadu_si256(at.add(4 * rows).cast()) };
    for (g, w) in w.iter_mut().enumerate() {
        let moved = match g {
            0 => _mm256_slli_epi16::<4>(h),
            1 => _mm256_slli_epi16::<3>(h),
            2 => _mm256_slli_epi16::<2>(h),
            3 => _mm256_slli_epi16::<1>(h),
            4 => h,
            5 => _mm256_srli_epi16::<1>(h),
            6 => _mm256_srli_epi16::<2>(h),
            _ => _mm256_srli_epi16::<3>(h),
        };
        *w = _mm256_or_si256(*w, _mm256_and_si256(moved, fifth));
    }
}

/// Per row (32-bit lane), a Q6_K scale block's 16 values: [`level_dot`] of the 4 level vectors `w`
/// and the token's levels at `x`, plus the block's `start` (`−32 · Σ x`), as `f32`.
///
/// # Safety
/// The CPU must have AVX2; `w` holds 4 vectors and `x..x + 16` must be readable.
#[target_feature(enable = "avx2")]
unsafe fn scale_block_sum(w: &[__m256i], x: *const i8, start: i32) -> __m256 {
    // SAFETY: the caller's contract.
    let sum = unsafe { level_dot::<2>(w, x) };
    _mm256_cvtepi32_ps(_mm256_add_epi32(sum, _mm256_set1_epi32(start)))
}

/// Each token's two halves of 8 row sums into its row of `out`.
#[target_feature(enable = "avx")]
fn store<const N: usize>(acc: [[__m256; 2]; N], out: &mut [[f32; STRIP_ROWS]; TOKENS]) {
    for (o, acc) in out.iter_mut().zip(acc) {
        // SAFETY: a row of `out` holds 16 floats.
        unsafe {
            _mm256_storeu_ps(o.as_mut_ptr(), acc[0]);
            _mm256_storeu_ps(o.as_mut_ptr().add(8), acc[1]);
        }
    }
}

/// The Q6_K strip times tokens `t0..t0 + N` into `out[..N]`: per 32 values, the 6-bit levels of 8
/// rows put together from their nibbles and two high bits (shared by the tokens), then per token
/// and 16 values (a scale block) two pairs of `vpmaddubsw` — a pair of products is at most 2 · 63
/// · 127 = 16,002, two pairs 32,004, inside an `i16` — widened, less `32 · Σ x`, each half scaled
/// by the rows' `d · sc`, the chunk's sum by the token's `d`.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; the strip holds `k / 256` Q6_K strip blocks; tokens `t0..t0
/// + N` lie in `a` (levels and scales) and `starts` (`−32 · Σ q` per 16 values).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_k<const N: usize>(
    strip: &[u8],
    a: &Activations,
    starts: &[i32],
    k: usize,
    t0: usize,
    out: &mut [[f32; STRIP_ROWS]; TOKENS],
) {
    let bytes = strip_block_bytes(QuantType::Q6_K);
    let high_bits = _mm256_set1_epi8(0x30);
    let mut acc = [[_mm256_setzero_ps(); 2]; N];
    for i in 0..k / QK_K {
        // SAFETY: the caller's contract: strip block `i` is `bytes` bytes at `i · bytes` (the 16
        // rows' `f16` `d`, 16 × 16 `i8` scales, then per 32 values 256 bytes of nibble groups and
        // 128 of high bits), and values `256 · i..256 · (i + 1)` of each token, their scales and
        // sums, lie in `a` and `levels`; `loadu` takes any alignment.
        unsafe {
            let block = strip.as_ptr().add(i * bytes);
            for (half, rows) in [0, 8].into_iter().enumerate() {
                let d = _mm256_cvtph_ps(_mm_loadu_si128(block.add(2 * rows).cast()));
                for c in 0..QK_K / BLOCK {
                    prefetch(
                        t0 == 0,
                        block.add((8 * half + c) * bytes / 16),
                        bytes / 16 + 1,
                    );
                    let chunk = block.add(288 + 384 * c);
                    // Level vector g meets values 4g..4g + 4: its nibbles as in Q4_0, its high
                    // bits at bits 2 (g % 4) of half g / 4 of the high-bit bytes, moved to 4..6.
                    let nibbles = nibble_levels(chunk, rows);
                    let w: [__m256i; 8] = std::array::from_fn(|g| {
                        let h = _mm256_loadu_si256(chunk.add(256 + 64 * (g / 4) + 4 * rows).cast());
                        let moved = match g % 4 {
                            0 => _mm256_slli_epi16::<4>(h),
                            1 => _mm256_slli_epi16::<2>(h),
                            2 => h,
                            _ => _mm256_srli_epi16::<2>(h),
                        };
                        _mm256_or_si256(nibbles[g], _mm256_and_si256(moved, high_bits))
                    });
                    // The rows' `d · sc` of this chunk's two scale blocks.
                    let scale = |sub: usize| {
                        let sc = _mm_loadl_epi64(block.add(32 + 16 * sub + rows).cast());
                        _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)))
                    };
                    let scales = [scale(2 * c), scale(2 * c + 1)];
                    for (t, acc) in acc.iter_mut().enumerate() {
                        let first = (t0 + t) * k + i * QK_K + c * BLOCK;
                        let x = a.q.as_ptr().add(first);
                        let xd = _mm256_set1_ps(*a.d.get_unchecked(first / BLOCK));
                        // Written out, not `[0, 1].map(..)`: the closure is compiled for AVX2
                        // and `array::map` is not, so the closure cannot be inlined into it and
                        // ran out of line per token and chunk (10 % of a batched GPT-2 Q4_0
                        // step on a Zen 3; the Q6_K head's time halved without it).
                        let low = scale_block_sum(&w[..4], x, *starts.get_unchecked(first / 16));
                        let high = scale_block_sum(
                            &w[4..],
                            x.add(16),
                            *starts.get_unchecked(first / 16 + 1),
                        );
                        // `xd · (sc₀ · Σ₀ + sc₁ · Σ₁)`, as the AVX-512 kernels scale a chunk.
                        let both = _mm256_fmadd_ps(low, scales[0], _mm256_mul_ps(high, scales[1]));
                        acc[half] = _mm256_fmadd_ps(both, xd, acc[half]);
                    }
                }
            }
        }
    }
    store(acc, out);
}
