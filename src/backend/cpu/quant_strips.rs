//! Quantized products on AVX-512 VNNI reading weights stored in strips of 16 interleaved rows
//! (`quant::strips`: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K): each `zmm` lane is one weight row, so a 64-byte load is 4
//! levels of 16 rows, `vpdpbusd` against 4 of a token's bytes broadcast sums them, and one
//! conversion, multiply and FMA per block scale 16 rows. Semantics as `quant_product`'s (the same
//! rounded activations, exact integer sums per block of 32, one `f32` scale per block); only the
//! instruction sequence differs.
//!
//! Per token, a block of 32 values of 16 rows is eight `vpdpbusd` and four vector instructions,
//! shared by all 16 rows, where the per-row kernels (`quant_vnni`) spend about seven per row and 64
//! values: a quarter of the instructions at one token, which is what lets decoding run at the
//! memory's pace. Against `quant_gemm`'s panels the strips need no decoding per call: the weight
//! was arranged once, when it was stored.
//!
//! The stored levels are unsigned (Q4_0's nibble `q`, value `d · (q − 8)`; Q5_0's `d · (q − 16)`;
//! Q8_0's level plus 128, value `d · (u − 128)`), the tokens' levels signed, so each lane starts
//! from `−bias · Σ x` of the token's block (`bias` 8, 16 or 128) and `vpdpbusd` adds `Σ u · x`.
//! Q4_1's, Q5_1's, Q4_K's and Q5_K's levels are plain (`d · q + m`, `(d · sc) · q − dmin · m`):
//! their minimums are added through the token's block sum `d_x · Σ x`, as the other kernels do.
//! The 5-bit levels' fifth bits are put into bit 4 of their nibbles (one `vpternlogd` per 4
//! values of 16 rows). Q6_K's 6-bit levels are put together from a nibble and
//! two high bits (one `vpternlogd` per 4 values of 16 rows) and start from `−32 · Σ x` per
//! 16 values, its scale block.

use std::arch::x86_64::*;

use super::few_rows::Columns;
use super::quant_product::{Activations, BLOCK};
use super::quant_vnni::{Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Small, by_token_chunks};
use crate::quant::strips::{STRIP_ROWS, k4_sub_block, small_strip, strip_block_bytes};
use crate::quant::{QK_K, QuantType};

mod tiles;
pub(super) use tiles::StripTiles;

/// Tokens per pass of the int8 tiles (`tiles`), and the rows of a pass's output buffer; the vector
/// kernels take at most [`DOT_TOKENS`].
const TOKENS: usize = 16;
/// A pass's sums, token by token, of a strip's 16 rows: kept by the caller for all the strips of a
/// task (zeroing a fresh kilobyte for every strip was 2-3 % of a decoding step).
pub(super) type StripSums = [[f32; STRIP_ROWS]; TOKENS];
/// How far ahead the AVX-512 kernels ask for lines when they walk several tokens. At 2 KiB eight
/// tokens streamed Q8_0 at 22-24 GiB/s, Q4_0 at 22, Q4_K at 21, Q6_K at 20 on the Zen 5 measured
/// (`streamed/*/8x` in `benches/quant.rs`, two threads); 8 KiB ahead, 35-39, 26-29, 28-30 and 28
/// (4 KiB: 25-34, 22-28, 28-31, 25-27; 16 KiB no better): the samples of the 2 KiB build sat on
/// the instructions right after each block's weight loads.
const SEVERAL_TOKENS_PREFETCH: usize = 8192;
/// How far ahead the K formats' kernels ask for lines for one token, on the CPUs where that helps
/// ([`one_token_k_prefetch`]). Their blocks of 256 values interleave scales, levels and high bits,
/// which the hardware prefetcher alone streamed at 20-41 GiB/s on the Zen 5 measured
/// (`streamed/Q4_K/1x`, `Q6_K/1x` in `benches/quant.rs`, builds alternated) against 38-45 asked
/// 4 KiB ahead (2 KiB: 30-46; 1 KiB: 31-35). The 32-value formats' one-token walk is left to the
/// hardware everywhere: Q8_0's fell from 57 to 37 GiB/s with the prefetches.
const ONE_TOKEN_K_PREFETCH: usize = 4096;

/// Whether the K formats' one-token walk asks for its lines ahead: on AMD's family 26 (Zen 5),
/// where it was measured to help, and nowhere else. On a Zen 4 (family 25 model 17) the
/// prefetches cost a sixth: `streamed/Q4_K/1x` 34.9 and 36.2 GiB/s without them against 31.5 and
/// 31.4 asked 4 KiB ahead (2 KiB 29.2, 8 KiB 30.1), `Q6_K/1x` 27.7 and 27.0 against 27.7 and 22.8,
/// one binary, runs alternated. A CPU nobody measured gets the simpler walk, as the 32-value
/// formats have everywhere.
fn one_token_k_prefetch() -> bool {
    static ASK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ASK.get_or_init(|| amd_family() == Some(0x1a))
}

/// The CPU's family (base plus extended, as AMD numbers them) when it is an AMD one.
fn amd_family() -> Option<u32> {
    if super::cpu_vendor() != *b"AuthenticAMD" {
        return None;
    }
    let eax = __cpuid(1).eax;
    let base = (eax >> 8) & 0xf;
    Some(if base == 0xf {
        base + ((eax >> 20) & 0xff)
    } else {
        base
    })
}

/// How far ahead the K formats' kernel for `tokens` tokens asks for lines, if at all.
fn k_prefetch(tokens: usize) -> Option<usize> {
    if tokens > 1 {
        Some(SEVERAL_TOKENS_PREFETCH)
    } else if one_token_k_prefetch() {
        Some(ONE_TOKEN_K_PREFETCH)
    } else {
        None
    }
}

/// Asks for the cache lines of the `len` bytes `distance` after `at` (one past the strip's end,
/// into the next strip or past the weight, is harmless: [`super::prefetch_lines`]).
#[inline(always)]
fn prefetch_ahead(distance: usize, at: *const u8, len: usize) {
    super::prefetch_lines(at.wrapping_add(distance), len);
}

/// What the strips' stored levels of `ty` are offset by (a value is `d · (u − bias)`): Q4_0's
/// nibble 8, Q5_0's 16, Q8_0's 128 (its signed levels stored plus 128), Q6_K's 32; 0 for the
/// formats with a minimum.
fn level_bias(ty: QuantType) -> i32 {
    match ty {
        QuantType::Q4_0 => i32::from(<Q4_0 as Small>::BIAS),
        QuantType::Q5_0 => i32::from(<Q5_0 as Small>::BIAS),
        QuantType::Q8_0 => 128,
        QuantType::Q6_K => 32,
        _ => 0,
    }
}

/// What the strip kernels read of the tokens besides their levels and scales: for the formats with
/// a bias (Q4_0, Q5_0, Q8_0 per block of 32, Q6_K per 16) each block's integer sum's start value
/// `−bias · Σ q`, stored multiplied so that a kernel broadcasts it from memory (one instruction
/// where a load, a multiply and a broadcast from a general register were three: 48 of the 212 of
/// Q6_K's eight-token block); `d · Σ q` per 32 for the minimums of Q4_1, Q5_1, Q4_K and Q5_K.
pub(super) struct BlockSums {
    starts: Vec<i32>,
    values: Vec<f32>,
}

impl BlockSums {
    pub(super) fn new(ty: QuantType, a: &Activations) -> BlockSums {
        if ty.has_minimum() {
            return BlockSums {
                starts: Vec::new(),
                values: a.block_sums(a.q.len()),
            };
        }
        let per = if ty == QuantType::Q6_K { 16 } else { BLOCK };
        let bias = level_bias(ty);
        let starts =
            a.q.chunks_exact(per)
                .map(|b| -bias * b.iter().map(|&v| i32::from(v)).sum::<i32>())
                .collect();
        BlockSums {
            starts,
            values: Vec::new(),
        }
    }

    /// `−bias · Σ q` per block of 32 (per 16 for Q6_K), for the formats with a bias.
    pub(super) fn starts(&self) -> &[i32] {
        &self.starts
    }

    /// `d · Σ q` per block of 32, for the formats with a minimum.
    pub(super) fn values(&self) -> &[f32] {
        &self.values
    }

    /// Sums per block of `ty`'s kind, for `m · k` values.
    fn cover(&self, ty: QuantType, values: usize) -> bool {
        match ty {
            _ if ty.has_minimum() => self.values.len() >= values / BLOCK,
            QuantType::Q6_K => self.starts.len() >= values / 16,
            _ => self.starts.len() >= values / BLOCK,
        }
    }
}

/// Whether a strip product's operands fit their shape: `k` whole blocks of `ty`, the strip's
/// blocks, `m` tokens of `k` in `a` with their sums for `ty`, and the columns `first..first + 16`
/// in `columns` (the AVX-512 and AVX2 strip kernels' common contract).
pub(super) fn operands_fit(
    ty: QuantType,
    strip: &[u8],
    a: &Activations,
    sums: &BlockSums,
    (m, k): (usize, usize),
    columns: &Columns<'_>,
    first: usize,
) -> bool {
    k.is_multiple_of(ty.block_size())
        && strip.len() == k / ty.block_size() * strip_block_bytes(ty)
        && a.q.len() >= m * k
        && a.d.len() >= m * k / BLOCK
        && sums.cover(ty, m * k)
        && first + STRIP_ROWS <= columns.len()
}

/// Column `first + r` of `columns`, row `t` `= x̂_t · ŵ_r` for the 16 rows of `strip` (a strip of
/// `ty`, `k` values per row) and every token `t` of `a` (`sums`: its [`BlockSums`] for `ty`).
/// With `tiles` (configured for `ty`), each whole 16 tokens' integer sums come from the AMX-INT8
/// tiles ([`tiles`]): the same bits.
///
/// # Panics
/// When `ty` has no strips or the operands do not fit (`k` whole blocks of `ty`, `m` tokens of `k`
/// in `a`, the columns `first..first + 16` in `columns`).
#[allow(clippy::too_many_arguments)]
pub(super) fn strip_product(
    ty: QuantType,
    strip: &[u8],
    a: &Activations,
    sums: &BlockSums,
    (m, k): (usize, usize),
    columns: &mut Columns<'_>,
    first: usize,
    mut tiles: Option<&mut StripTiles>,
    out: &mut StripSums,
) {
    assert!(
        operands_fit(ty, strip, a, sums, (m, k), columns, first),
        "quantized strip product: operands do not fit their shape"
    );
    assert!(
        std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx512bw")
            && std::is_x86_feature_detected!("avx512vnni"),
        "the strip kernels need AVX-512 F/BW and VNNI"
    );
    // Runs of 16 tokens go to the int8 tiles where there are tiles; the vector kernels take 8 at a
    // time (their sums, the 8 level registers and the accumulators fill the 32 `zmm`; at 16 the K
    // formats' kernels measured 5-10 % slower on a Zen 4, the 32-value formats' slower too).
    let largest = if tiles.is_some() { TOKENS } else { DOT_TOKENS };
    by_token_chunks(m, largest, |t0, run| {
        if let (Some(tiles), TOKENS) = (tiles.as_mut(), run) {
            // SAFETY: the tiles' existence says the CPU has AMX-INT8 and AVX-512 F/BW and VNNI,
            // and they were configured for `ty` (`StripTiles::configure` takes only the K
            // formats); the assertions above keep every read inside the strip and the tokens
            // t0..t0 + 16 <= m, with the sums `ty` reads.
            unsafe {
                match ty {
                    QuantType::Q4_K => tiles::tokens_k4::<false>(tiles, strip, a, sums, k, t0, out),
                    QuantType::Q5_K => tiles::tokens_k4::<true>(tiles, strip, a, sums, k, t0, out),
                    _ => tiles::tokens_q6_k(tiles, strip, a, sums, k, t0, out),
                }
            }
            for (t, s) in out.iter().enumerate() {
                columns.set_run(t0 + t, first, s);
            }
            return;
        }
        // SAFETY: the CPU has AVX-512 F/BW and VNNI (asserted); the assertions above keep every
        // read inside the strip and the tokens t0..t0 + run <= m, with the sums `ty` reads.
        unsafe {
            macro_rules! chunk {
                ($kernel:ident [$($c:tt)*]) => {
                    match run {
                        8 => $kernel::<8, $($c)*>(strip, a, sums, k, t0, out),
                        4 => $kernel::<4, $($c)*>(strip, a, sums, k, t0, out),
                        2 => $kernel::<2, $($c)*>(strip, a, sums, k, t0, out),
                        _ => $kernel::<1, $($c)*>(strip, a, sums, k, t0, out),
                    }
                };
            }
            match ty {
                QuantType::Q4_0 => chunk!(tokens[Q4_0]),
                QuantType::Q4_1 => chunk!(tokens[Q4_1]),
                QuantType::Q5_0 => chunk!(tokens[Q5_0]),
                QuantType::Q5_1 => chunk!(tokens[Q5_1]),
                QuantType::Q8_0 => chunk!(tokens[Q8_0]),
                QuantType::Q4_K => chunk!(tokens_k4[false]),
                QuantType::Q5_K => chunk!(tokens_k4[true]),
                QuantType::Q6_K => chunk!(tokens_q6_k[]),
                _ => panic!("{ty} has no strip kernel"),
            }
        }
        for (t, s) in out.iter().enumerate().take(run) {
            columns.set_run(t0 + t, first, s);
        }
    });
}

/// Each token's 16 row sums into its row of `out`.
#[target_feature(enable = "avx512f")]
fn store<const N: usize>(acc: [__m512; N], out: &mut [[f32; STRIP_ROWS]; TOKENS]) {
    for (o, acc) in out.iter_mut().zip(acc) {
        // SAFETY: a row of `out` holds 16 floats.
        unsafe { _mm512_storeu_ps(o.as_mut_ptr(), acc) };
    }
}

/// Eight groups of 4 values of 16 rows (the order of a token's 32 values) from 256 bytes of
/// nibble groups at `at`.
///
/// # Safety
/// The CPU must have AVX-512 F/BW; `at..at + 256` must be readable.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn nibble_groups(at: *const u8) -> [__m512i; 8] {
    let low = _mm512_set1_epi8(0x0f);
    let mut w = [_mm512_setzero_si512(); 8];
    for c in 0..4 {
        // SAFETY: the caller's contract; `loadu` takes any alignment.
        let v = unsafe { _mm512_loadu_si512(at.add(64 * c).cast()) };
        w[2 * c] = _mm512_and_si512(v, low);
        w[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16::<4>(v), low);
    }
    w
}

/// Puts the fifth bits at `at` (64 bytes: byte `4r + j` holds at bit `g` that of value `4g + j`
/// of row `r`) into bit 4 of the nibble groups `w`.
///
/// # Safety
/// The CPU must have AVX-512 F/BW; `at..at + 64` must be readable.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn add_fifth_bits(w: &mut [__m512i; 8], at: *const u8) {
    let bit4 = _mm512_set1_epi8(0x10);
    // SAFETY: the caller's contract; `loadu` takes any alignment.
    let v = unsafe { _mm512_loadu_si512(at.cast()) };
    // Bit g of each byte moved to bit 4 (a 16-bit shift by at most 4 keeps bit 4 in its byte).
    let moved = [
        _mm512_slli_epi16::<4>(v),
        _mm512_slli_epi16::<3>(v),
        _mm512_slli_epi16::<2>(v),
        _mm512_slli_epi16::<1>(v),
        v,
        _mm512_srli_epi16::<1>(v),
        _mm512_srli_epi16::<2>(v),
        _mm512_srli_epi16::<3>(v),
    ];
    for (g, moved) in w.iter_mut().zip(moved) {
        // nibble | (moved & 0x10)
        *g = _mm512_ternarylogic_epi32::<0xF8>(*g, moved, bit4);
    }
}

/// Most tokens [`dots`] takes at once: their sums, the weight's 8 groups and the callers'
/// accumulators fill the 32 `zmm`.
const DOT_TOKENS: usize = 8;

/// For each of the `N` (at most [`DOT_TOKENS`]) tokens `t`, `Σ` over `4 · w.len()` values of the
/// 16 rows' levels `w` times the token's levels at `x(t)`, from `start(t)`.
///
/// Tokens innermost: each group of 4 values meets every token's 4 bytes while its register is
/// loaded, and the sums are independent chains that stay in registers (a loop over tokens around
/// whole blocks left the kernels' accumulators on the stack). One token alternates two chains, so
/// that a block is not eight latencies deep.
///
/// # Safety
/// The CPU must have AVX-512 F and VNNI; `x(t)..x(t) + 4 · w.len()` must be readable for every
/// token.
#[target_feature(enable = "avx512f,avx512vnni")]
#[inline]
unsafe fn dots<const N: usize>(
    w: &[__m512i],
    x: impl Fn(usize) -> *const i8,
    start: impl Fn(usize) -> __m512i,
) -> [__m512i; N] {
    const { assert!(N <= DOT_TOKENS) };
    let mut dot: [__m512i; N] = std::array::from_fn(start);
    let mut odd = _mm512_setzero_si512();
    for (g, w) in w.iter().enumerate() {
        for (t, dot) in dot.iter_mut().enumerate() {
            // SAFETY: the caller's contract; `read_unaligned` takes any alignment.
            let four = unsafe { std::ptr::read_unaligned(x(t).add(4 * g).cast::<i32>()) };
            let chain = if N == 1 && g % 2 == 1 { &mut odd } else { dot };
            *chain = _mm512_dpbusd_epi32(*chain, *w, _mm512_set1_epi32(four));
        }
    }
    if N == 1 {
        dot[0] = _mm512_add_epi32(dot[0], odd);
    }
    dot
}

/// The strip of a 32-value format `F` times tokens `t0..t0 + N` into `out[..N]`.
///
/// # Safety
/// The CPU must have AVX-512 F/BW and VNNI; the strip holds `k / 32` strip blocks of `F`; tokens
/// `t0..t0 + N` lie in `a` and `sums` (`sums.values` for a format with a minimum, else
/// `sums.starts`).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn tokens<const N: usize, F: Small>(
    strip: &[u8],
    a: &Activations,
    sums: &BlockSums,
    k: usize,
    t0: usize,
    out: &mut [[f32; STRIP_ROWS]; TOKENS],
) {
    let (mins, levels_at, fifth_at, bytes) = small_strip(F::MINIMUM, F::FIFTH_BIT);
    let (levels_at, bytes) = if F::NIBBLES {
        (levels_at, bytes)
    } else {
        (32, 32 + 512)
    };
    let mut acc = [_mm512_setzero_ps(); N];
    for b in 0..k / BLOCK {
        // SAFETY: the caller's contract: block `b` of the strip is `bytes` bytes at `b · bytes`
        // (32 of scales, the minimums, the levels, the fifth bits, as `small_strip` places them),
        // and values `32 · b..32 · (b + 1)` of each token, its scale and its sum, lie in `a` and
        // `sums`; `loadu` takes any alignment.
        unsafe {
            let block = strip.as_ptr().add(b * bytes);
            // One token's walk is paced by the memory, and the hardware prefetcher keeps up
            // with these formats' blocks (the prefetches would only add instructions).
            if N > 1 {
                prefetch_ahead(SEVERAL_TOKENS_PREFETCH, block, bytes);
            }
            let scales = _mm512_cvtph_ps(_mm256_loadu_si256(block.cast()));
            let levels = block.add(levels_at);
            let mut w = if F::NIBBLES {
                nibble_groups(levels)
            } else {
                std::array::from_fn(|g| _mm512_loadu_si512(levels.add(64 * g).cast()))
            };
            if F::FIFTH_BIT {
                add_fifth_bits(&mut w, block.add(fifth_at));
            }
            let minimums = if F::MINIMUM {
                _mm512_cvtph_ps(_mm256_loadu_si256(block.add(mins).cast()))
            } else {
                _mm512_setzero_ps()
            };
            let first = |t: usize| (t0 + t) * k + b * BLOCK;
            let dot = dots::<N>(
                &w,
                |t| a.q.as_ptr().add(first(t)),
                |t| {
                    if F::MINIMUM {
                        _mm512_setzero_si512()
                    } else {
                        _mm512_set1_epi32(*sums.starts.get_unchecked(first(t) / BLOCK))
                    }
                },
            );
            for ((t, acc), dot) in acc.iter_mut().enumerate().zip(dot) {
                let d = _mm512_set1_ps(*a.d.get_unchecked(first(t) / BLOCK));
                let scale = _mm512_mul_ps(scales, d);
                *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, *acc);
                if F::MINIMUM {
                    let xsum = _mm512_set1_ps(*sums.values.get_unchecked(first(t) / BLOCK));
                    *acc = _mm512_fmadd_ps(minimums, xsum, *acc);
                }
            }
        }
    }
    store(acc, out);
}

/// The levels (0..=15; Q5_K's 0..=31) of sub-block `s` (values `32s..32s + 32`) of the Q4_K
/// (`FIVE` false) or Q5_K strip block at `block`, as eight groups of 4 values of 16 rows.
///
/// # Safety
/// The CPU must have AVX-512 F/BW; `block` must point to a whole strip block of the format,
/// `s < 8`.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn k4_groups<const FIVE: bool>(block: *const u8, s: usize) -> [__m512i; 8] {
    // SAFETY: the caller's contract: sub-block `s`'s nibble groups (and fifth bits) lie in the
    // block, from byte 320.
    unsafe {
        let levels = block.add(320 + k4_sub_block(FIVE) * s);
        let mut w = nibble_groups(levels);
        if FIVE {
            add_fifth_bits(&mut w, levels.add(256));
        }
        w
    }
}

/// The Q4_K (`FIVE` false) or Q5_K strip times tokens `t0..t0 + N` into `out[..N]`.
///
/// # Safety
/// The CPU must have AVX-512 F/BW and VNNI; the strip holds `k / 256` strip blocks of its format;
/// tokens `t0..t0 + N` lie in `a` and `sums.values`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn tokens_k4<const N: usize, const FIVE: bool>(
    strip: &[u8],
    a: &Activations,
    sums: &BlockSums,
    k: usize,
    t0: usize,
    out: &mut [[f32; STRIP_ROWS]; TOKENS],
) {
    let ty = if FIVE {
        QuantType::Q5_K
    } else {
        QuantType::Q4_K
    };
    let bytes = strip_block_bytes(ty);
    let prefetch = k_prefetch(N);
    let mut acc = [_mm512_setzero_ps(); N];
    for i in 0..k / QK_K {
        // SAFETY: the caller's contract: strip block `i` is `bytes` bytes at `i · bytes` (`d`,
        // `dmin`, 8 × 16 scales, 8 × 16 minimums, 8 × `stride` bytes of levels), and values
        // `256 · i..256 · (i + 1)` of each token, their scales and sums, lie in `a` and `sums`;
        // `loadu` takes any alignment.
        unsafe {
            let block = strip.as_ptr().add(i * bytes);
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(block.cast()));
            let dmin = _mm512_cvtph_ps(_mm256_loadu_si256(block.add(32).cast()));
            for s in 0..QK_K / BLOCK {
                // An eighth of the block per sub-block: the lines of the whole block, spread.
                if let Some(distance) = prefetch {
                    prefetch_ahead(distance, block.add(s * bytes / 8), bytes / 8 + 1);
                }
                let bytes16 = |at: usize| {
                    _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(
                        block.add(at + 16 * s).cast(),
                    )))
                };
                // `(d · sc)` and `dmin · m` of the 16 rows, formed as the dequantizer forms them.
                let scale = _mm512_mul_ps(d, bytes16(64));
                let min = _mm512_mul_ps(dmin, bytes16(192));
                let w = k4_groups::<FIVE>(block, s);
                let first = |t: usize| (t0 + t) * k + i * QK_K + s * BLOCK;
                let dot = dots::<N>(
                    &w,
                    |t| a.q.as_ptr().add(first(t)),
                    |_| _mm512_setzero_si512(),
                );
                for ((t, acc), dot) in acc.iter_mut().enumerate().zip(dot) {
                    let xd = _mm512_set1_ps(*a.d.get_unchecked(first(t) / BLOCK));
                    let xsum = _mm512_set1_ps(*sums.values.get_unchecked(first(t) / BLOCK));
                    let scale = _mm512_mul_ps(scale, xd);
                    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, *acc);
                    *acc = _mm512_fnmadd_ps(min, xsum, *acc);
                }
            }
        }
    }
    store(acc, out);
}

/// The 6-bit levels (0..=63) of chunk `c` (values `32c..32c + 32`) of the Q6_K strip block at
/// `block`, as eight groups of 4 values of 16 rows: the low nibbles' groups with the high bits
/// added.
///
/// # Safety
/// The CPU must have AVX-512 F/BW; `block` must point to a whole Q6_K strip block, `c < 8`.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn q6_k_groups(block: *const u8, c: usize) -> [__m512i; 8] {
    let high_bits = _mm512_set1_epi8(0x30);
    // SAFETY: the caller's contract: chunk `c`'s 256 bytes of nibble groups and 128 of high bits
    // lie in the block; `loadu` takes any alignment.
    unsafe {
        let chunk = block.add(288 + 384 * c);
        let mut w = nibble_groups(chunk);
        for h in 0..2 {
            let v = _mm512_loadu_si512(chunk.add(256 + 64 * h).cast());
            // The high bits of group 4h + i are bits 2i..2i + 2: moved to bits 4..6.
            let moved = [
                _mm512_slli_epi16::<4>(v),
                _mm512_slli_epi16::<2>(v),
                v,
                _mm512_srli_epi16::<2>(v),
            ];
            for (i, moved) in moved.into_iter().enumerate() {
                let g = &mut w[4 * h + i];
                // low | (moved & 0x30)
                *g = _mm512_ternarylogic_epi32::<0xF8>(*g, moved, high_bits);
            }
        }
        w
    }
}

/// `acc` plus one token's 32 values of a Q6_K chunk: `xd · (sc₀ · Σ₀ + sc₁ · Σ₁)`, the two
/// halves' integer sums `dots` (from their start values) scaled by the rows' `d · sc` of each half
/// and the token's block scale `xd`. Three multiplies, where scaling each half by `sc · xd` took
/// four, on the pipes the dot products use (BENCHMARKS.md, issue 35). The int8 tiles' kernel calls
/// it too, so both give the same bits.
#[target_feature(enable = "avx512f")]
#[inline]
fn q6_k_chunk(acc: __m512, dots: [__m512i; 2], scales: [__m512; 2], xd: __m512) -> __m512 {
    let high = _mm512_mul_ps(_mm512_cvtepi32_ps(dots[1]), scales[1]);
    let both = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[0]), scales[0], high);
    _mm512_fmadd_ps(both, xd, acc)
}

/// The Q6_K strip times tokens `t0..t0 + N` into `out[..N]`.
///
/// # Safety
/// The CPU must have AVX-512 F/BW and VNNI; the strip holds `k / 256` Q6_K strip blocks; tokens
/// `t0..t0 + N` lie in `a` and `sums.starts` (per 16 values).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn tokens_q6_k<const N: usize>(
    strip: &[u8],
    a: &Activations,
    sums: &BlockSums,
    k: usize,
    t0: usize,
    out: &mut [[f32; STRIP_ROWS]; TOKENS],
) {
    let bytes = strip_block_bytes(QuantType::Q6_K);
    let prefetch = k_prefetch(N);
    let mut acc = [_mm512_setzero_ps(); N];
    for i in 0..k / QK_K {
        // SAFETY: the caller's contract: strip block `i` is `bytes` bytes at `i · bytes` (`d`,
        // 16 × 16 scales, then 8 chunks of 256 bytes of low nibbles and 128 of high bits), and
        // values `256 · i..256 · (i + 1)` of each token, their scales and sums, lie in `a` and
        // `sums`; `loadu` takes any alignment.
        unsafe {
            let block = strip.as_ptr().add(i * bytes);
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(block.cast()));
            for c in 0..QK_K / BLOCK {
                if let Some(distance) = prefetch {
                    prefetch_ahead(distance, block.add(c * bytes / 8), bytes / 8 + 1);
                }
                let w = q6_k_groups(block, c);
                let scale = |sub: usize| {
                    let sc = _mm_loadu_si128(block.add(32 + 16 * sub).cast());
                    _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)))
                };
                let (first_scale, second_scale) = (scale(2 * c), scale(2 * c + 1));
                let first = |t: usize| (t0 + t) * k + i * QK_K + c * BLOCK;
                // Each half (16 values) from `−32 · Σ x` of its values (`sums.starts`).
                let half = |h: usize| {
                    dots::<N>(
                        &w[4 * h..4 * h + 4],
                        |t| a.q.as_ptr().add(first(t) + 16 * h),
                        |t| _mm512_set1_epi32(*sums.starts.get_unchecked(first(t) / 16 + h)),
                    )
                };
                let (low, high) = (half(0), half(1));
                for (((t, acc), low), high) in acc.iter_mut().enumerate().zip(low).zip(high) {
                    let xd = _mm512_set1_ps(*a.d.get_unchecked(first(t) / BLOCK));
                    *acc = q6_k_chunk(*acc, [low, high], [first_scale, second_scale], xd);
                }
            }
        }
    }
    store(acc, out);
}
