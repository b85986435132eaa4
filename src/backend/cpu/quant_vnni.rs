//! The quantized products' AVX-512 VNNI kernels: 64 multiply-adds of 8-bit levels per
//! `vpdpbusd` (unsigned by signed bytes, summed by four into 32-bit lanes), against the AVX2
//! kernels' 32 per three instructions. Semantics as `quant_product`'s (the same rounded
//! activations, exact integer sums per block, one `f32` scale per 4 values); only the instruction
//! sequence differs.
//!
//! `vpdpbusd` multiplies unsigned bytes by signed ones. Where the weight's levels are signed
//! (Q8_0's, and Q4_0's `q − 8`, Q5_0's `q − 16` and Q6_K's `q − 32` once offset) the activations go
//! in unsigned (`x + 128`, [`Lanes`]) and the `128 · Σ w` that adds is subtracted once per weight
//! block, for every token: each lane starts from `−128 · Σ` of its four weights. The levels of the
//! formats with minimums (Q4_1, Q5_1, Q4_K, Q5_K) are unsigned and plain, so they go in as stored
//! against the signed activations (the minimums are added through the activations' sums, as in the
//! AVX2 kernel). The 5-bit formats' fifth bits become a byte mask (`vpaddb` of 16 under it). Per token, a step reads 64 activation
//! bytes and two block scales: what the weight's rows share, when several tokens are multiplied.

use std::arch::x86_64::*;

use super::quant_product::{Activations, BLOCK};
use crate::quant::QuantType;

/// `$kernel::<[$c,] N>(w, a, lanes, k, t0, sums)` over the tokens `first..first + sums.len()`, in
/// chunks of N = 8, 4, 2 and 1 tokens: each chunk's accumulators are a fixed-size array the
/// compiler keeps in registers. The caller's assertions must cover every token.
macro_rules! in_token_chunks {
    ($kernel:ident [$($c:ident)?] ($w:expr, $a:expr, $lanes:expr, $k:expr, $first:expr, $sums:expr)) => {
        by_token_chunks($sums.len(), 8, |t0, n| {
            let (sums, t0) = (&mut $sums[t0..t0 + n], $first + t0);
            // SAFETY: the caller asserted the contract of `$kernel` for every token of `sums`.
            unsafe {
                match n {
                    8 => $kernel::<$($c,)? 8>($w, $a, $lanes, $k, t0, sums),
                    4 => $kernel::<$($c,)? 4>($w, $a, $lanes, $k, t0, sums),
                    2 => $kernel::<$($c,)? 2>($w, $a, $lanes, $k, t0, sums),
                    _ => $kernel::<$($c,)? 1>($w, $a, $lanes, $k, t0, sums),
                }
            }
        })
    };
}

/// Splits `m` tokens into chunks of `largest` (16 or 8), then 8, 4, 2 and 1 (`run(first, len)`).
pub(super) fn by_token_chunks(m: usize, largest: usize, mut run: impl FnMut(usize, usize)) {
    let mut t0 = 0;
    while t0 < m {
        let n = [16, 8, 4, 2, 1]
            .into_iter()
            .find(|&n| n <= largest && n <= m - t0)
            .expect("1 <= m - t0");
        run(t0, n);
        t0 += n;
    }
}

/// What a kernel reads of the activations beyond their levels and scales: the levels plus 128 as
/// unsigned bytes (for the signed weights), or each block's `d · Σ q` (for Q4_K's minimums).
pub(super) struct Lanes {
    unsigned: Vec<u8>,
    block_sums: Vec<f32>,
}

impl Lanes {
    /// For `a` (`m` rows of `k`): the unsigned levels if `unsigned`, else the block sums.
    pub(super) fn new(a: &Activations, m: usize, k: usize, unsigned: bool) -> Lanes {
        if unsigned {
            return Lanes {
                unsigned: a.unsigned(m * k),
                block_sums: Vec::new(),
            };
        }
        Lanes {
            unsigned: Vec::new(),
            block_sums: a.block_sums(m * k),
        }
    }
}

/// `−128 · Σ` of each lane's 4 signed weights: where a lane of `(x + 128) · w` starts.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
fn signed_start(q: __m512i) -> __m512i {
    let bias = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(-128), q);
    _mm512_sub_epi32(_mm512_setzero_si512(), bias)
}

/// The `f16` at `at`, widened.
///
/// # Safety
/// `at` and `at + 1` must be readable; the CPU must have F16C.
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn f16_at(at: *const u8) -> f32 {
    // SAFETY: the caller's contract.
    let bits = unsafe { u16::from_le_bytes([*at, *at.add(1)]) };
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
}

/// Lanes 0..8 `a`, lanes 8..16 `b`: two 32-value blocks' scales over their 8 lanes each.
#[target_feature(enable = "avx512f")]
fn halves(a: f32, b: f32) -> __m512 {
    _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(a), _mm512_set1_ps(b))
}

/// The accumulation every kernel shares: for tokens `t0..t0 + N`, the 64 values at `at` (a
/// multiple of 64 within a row of `k`) times the weight's levels `q` (64 bytes, signed if
/// `SIGNED`, against the unsigned activations, else unsigned), each lane started from `start`
/// (the weight's own correction), scaled by `scale` (the weight's, per lane) times the
/// activations' two block scales.
///
/// # Safety
/// The CPU must have AVX-512 F/BW and VNNI; `at + 64 <= k`; tokens `t0..t0 + N` are rows of `a`
/// and (if `SIGNED`) of `lanes`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[allow(clippy::too_many_arguments)]
unsafe fn accumulate<const SIGNED: bool, const N: usize>(
    acc: &mut [__m512; N],
    t0: usize,
    a: &Activations,
    lanes: &Lanes,
    k: usize,
    at: usize,
    q: __m512i,
    start: __m512i,
    scale: __m512,
) {
    // The first scale over lanes 0..8, the second over 8..16.
    let spread = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    for (t, acc) in acc.iter_mut().enumerate() {
        let row = (t0 + t) * k + at;
        // SAFETY: the caller's contract keeps the 64 bytes at `row` and the two scales at
        // `row / 32` inside the activations; `loadu` takes any alignment.
        unsafe {
            let dp = if SIGNED {
                let x = _mm512_loadu_si512(lanes.unsigned.as_ptr().add(row).cast());
                _mm512_dpbusd_epi32(start, x, q)
            } else {
                let x = _mm512_loadu_si512(a.q.as_ptr().add(row).cast());
                _mm512_dpbusd_epi32(start, q, x)
            };
            let pair = _mm_castpd_ps(_mm_load_sd(a.d.as_ptr().add(row / BLOCK).cast()));
            let xd = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(pair));
            *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dp), _mm512_mul_ps(xd, scale), *acc);
        }
    }
}

/// A 32-value format as [`row`] reads it (`quant::blocks` documents the layouts): the byte offset
/// of its levels, whether it stores a fifth bit per value (a little-endian `u32` before the
/// levels) and a minimum (an `f16` after `d`, the value `d · q + m`; otherwise `d · (q − BIAS)`).
pub(super) trait Small {
    const BYTES: usize;
    /// Where the levels start.
    const LEVELS: usize;
    /// Levels as nibbles (else one signed byte each, Q8_0).
    const NIBBLES: bool;
    const FIFTH_BIT: bool;
    const MINIMUM: bool;
    /// What a signed format's stored level is offset by.
    const BIAS: i8;
}

/// A format's layout: `$bytes` per block, levels from `$levels`, nibbles or bytes, and the offset of
/// a signed format's levels; whether it stores a minimum or fifth bits is the format's own
/// (`QuantType::has_minimum`, `has_fifth_bit`), so the kernels and the strips cannot disagree.
macro_rules! small_format {
    ($name:ident, $bytes:expr, $levels:expr, $nibbles:expr, $bias:expr) => {
        pub(super) struct $name;
        impl Small for $name {
            const BYTES: usize = $bytes;
            const LEVELS: usize = $levels;
            const NIBBLES: bool = $nibbles;
            const FIFTH_BIT: bool = QuantType::$name.has_fifth_bit();
            const MINIMUM: bool = QuantType::$name.has_minimum();
            const BIAS: i8 = $bias;
        }
    };
}

small_format!(Q8_0, 34, 2, false, 0);
small_format!(Q4_0, 18, 2, true, 8);
small_format!(Q4_1, 20, 4, true, 0);
small_format!(Q5_0, 22, 6, true, 16);
small_format!(Q5_1, 24, 8, true, 0);

/// One weight row of a 32-value format `F` times the rows `first..first + sums.len()` of the
/// activations, two blocks (64 values) per step. The signed formats (no minimum) go against the
/// unsigned activations; the formats with a minimum keep their levels unsigned against the signed
/// activations and add `m · d_x · Σ q_x` per block, as Q4_K subtracts its minimums.
///
/// # Safety
/// The CPU must have AVX-512 F/BW, VNNI, FMA and F16C; `k` a multiple of 64; `w` holds `k / 32`
/// blocks; `a` and `lanes` `first + sums.len()` rows of `k` (`lanes` with the unsigned levels for
/// a format without a minimum, else with the block sums).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn row<F: Small>(
    w: &[u8],
    a: &Activations,
    lanes: &Lanes,
    k: usize,
    first: usize,
    sums: &mut [f32],
) {
    let m = first + sums.len();
    assert!(k.is_multiple_of(64) && w.len() >= k / BLOCK * F::BYTES && a.q.len() >= m * k);
    assert!(a.d.len() >= m * k / BLOCK);
    if F::MINIMUM {
        assert!(lanes.block_sums.len() >= m * k / BLOCK);
    } else {
        assert!(lanes.unsigned.len() >= m * k);
    }
    // SAFETY (inside the macro): the assertions above, for tokens t0..t0 + n <= m.
    in_token_chunks!(row_n[F](w, a, lanes, k, first, sums));
}

/// [`row`] for the `N` tokens from `t0` (`sums` their outputs).
///
/// # Safety
/// As for [`row`], with tokens `t0..t0 + N` in `a` and `lanes`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn row_n<F: Small, const N: usize>(
    w: &[u8],
    a: &Activations,
    lanes: &Lanes,
    k: usize,
    t0: usize,
    sums: &mut [f32],
) {
    let low = _mm256_set1_epi8(0x0f);
    let bias = _mm512_set1_epi8(F::BIAS);
    let sixteen = _mm512_set1_epi8(16);
    let mut acc = [_mm512_setzero_ps(); N];
    // The minimums' terms, in lanes 0 and 1 (a pair's two blocks).
    let mut offsets = [_mm_setzero_ps(); N];
    for pair in 0..k / 64 {
        // SAFETY: blocks 2·pair and 2·pair + 1 lie in `w` (the assertion); `loadu` takes any
        // alignment; the block sums of tokens t0..t0 + N and `accumulate`'s contract follow from
        // the assertions.
        unsafe {
            let first = w.as_ptr().add(2 * pair * F::BYTES);
            let second = first.add(F::BYTES);
            let scale = halves(f16_at(first), f16_at(second));
            let q = if F::NIBBLES {
                let bytes = _mm256_set_m128i(
                    _mm_loadu_si128(second.add(F::LEVELS).cast()),
                    _mm_loadu_si128(first.add(F::LEVELS).cast()),
                );
                let lo = _mm256_and_si256(bytes, low);
                let hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
                // [first's lows, second's lows, first's highs, second's highs] in 128-bit
                // lanes, reordered to the values' order: lanes 0, 2, 1, 3.
                let z = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
                _mm512_shuffle_i64x2(z, z, 0b11_01_10_00)
            } else {
                _mm512_inserti64x4(
                    _mm512_castsi256_si512(_mm256_loadu_si256(first.add(F::LEVELS).cast())),
                    _mm256_loadu_si256(second.add(F::LEVELS).cast()),
                    1,
                )
            };
            // The fifth bits, value j of the pair at bit j: 16 added where set.
            let q = if F::FIFTH_BIT {
                let at = F::LEVELS - 4;
                let word = |b: *const u8| {
                    u64::from(u32::from_le_bytes([*b, *b.add(1), *b.add(2), *b.add(3)]))
                };
                let fifth = word(first.add(at)) | word(second.add(at)) << 32;
                _mm512_mask_add_epi8(q, fifth, q, sixteen)
            } else {
                q
            };
            if F::MINIMUM {
                let mins = _mm_set_ps(0.0, 0.0, f16_at(second.add(2)), f16_at(first.add(2)));
                for (t, offset) in offsets.iter_mut().enumerate() {
                    let at = (t0 + t) * (k / BLOCK) + 2 * pair;
                    let pair_sums =
                        _mm_castpd_ps(_mm_load_sd(lanes.block_sums.as_ptr().add(at).cast()));
                    *offset = _mm_fmadd_ps(mins, pair_sums, *offset);
                }
                let zero = _mm512_setzero_si512();
                accumulate::<false, N>(&mut acc, t0, a, lanes, k, pair * 64, q, zero, scale);
            } else {
                let q = _mm512_sub_epi8(q, bias);
                let start = signed_start(q);
                accumulate::<true, N>(&mut acc, t0, a, lanes, k, pair * 64, q, start, scale);
            }
        }
    }
    for ((sum, acc), offset) in sums.iter_mut().zip(acc).zip(offsets) {
        *sum =
            _mm512_reduce_add_ps(acc) + _mm_cvtss_f32(_mm_add_ss(offset, _mm_movehdup_ps(offset)));
    }
}

/// One Q6_K weight row times the rows `first..first + sums.len()` of the activations: per block of 256, the 6-bit levels
/// assembled 64 at a time from their low 4 and high 2 bits and offset by −32, each 16 values
/// scaled by their `i8` scale times `d`.
///
/// # Safety
/// As for [`row`]: `w` holds `k / 256` blocks of 210 bytes.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
pub(super) unsafe fn row_q6_k(
    w: &[u8],
    a: &Activations,
    lanes: &Lanes,
    k: usize,
    first: usize,
    sums: &mut [f32],
) {
    const BYTES: usize = 210;
    let blocks = k / 256;
    let m = first + sums.len();
    assert!(w.len() >= blocks * BYTES && a.q.len() >= m * k && lanes.unsigned.len() >= m * k);
    assert!(a.d.len() >= m * k / BLOCK);
    // SAFETY (inside the macro): the assertions above, for tokens t0..t0 + n <= m.
    in_token_chunks!(row_q6_k_n[](w, a, lanes, k, first, sums));
}

/// [`row_q6_k`] for the `N` tokens from `t0`.
///
/// # Safety
/// As for [`row_q6_k`], with tokens `t0..t0 + N` in `a` and `lanes`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
unsafe fn row_q6_k_n<const N: usize>(
    w: &[u8],
    a: &Activations,
    lanes: &Lanes,
    k: usize,
    t0: usize,
    sums: &mut [f32],
) {
    const BYTES: usize = 210;
    let blocks = k / 256;
    let low = _mm512_set1_epi8(0x0f);
    let two = _mm512_set1_epi8(0x03);
    let offset = _mm512_set1_epi8(32);
    // Each of 4 scales over its 4 lanes (16 values).
    let spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    {
        let mut acc = [_mm512_setzero_ps(); N];
        for b in 0..blocks {
            // SAFETY: the block's 210 bytes are in `w` (the assertion): `ql` at 64·half, `qh` at
            // 128 + 32·half, the scales at 192 + 8·half + 4·r, `d` at 208; `accumulate`'s
            // contract follows from the assertions.
            unsafe {
                let block = w.as_ptr().add(b * BYTES);
                let d = _mm512_set1_ps(f16_at(block.add(208)));
                for half in 0..2 {
                    let ql = _mm512_loadu_si512(block.add(64 * half).cast());
                    let qh = _mm256_loadu_si256(block.add(128 + 32 * half).cast());
                    let qh =
                        _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
                    let levels = [
                        _mm512_or_si512(
                            _mm512_and_si512(ql, low),
                            _mm512_slli_epi16(_mm512_and_si512(qh, two), 4),
                        ),
                        _mm512_or_si512(
                            _mm512_and_si512(_mm512_srli_epi16(ql, 4), low),
                            _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh, 4), two), 4),
                        ),
                    ];
                    for (r, q) in levels.into_iter().enumerate() {
                        let at = block.add(192 + 8 * half + 4 * r);
                        let four = _mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_cvtsi32_si128(
                            i32::from_le_bytes([*at, *at.add(1), *at.add(2), *at.add(3)]),
                        )));
                        let scale = _mm512_mul_ps(
                            _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(four)),
                            d,
                        );
                        let q = _mm512_sub_epi8(q, offset);
                        accumulate::<true, N>(
                            &mut acc,
                            t0,
                            a,
                            lanes,
                            k,
                            b * 256 + half * 128 + r * 64,
                            q,
                            signed_start(q),
                            scale,
                        );
                    }
                }
            }
        }
        for (sum, acc) in sums.iter_mut().zip(acc) {
            *sum = _mm512_reduce_add_ps(acc);
        }
    }
}

/// Bytes of a Q4_K block (`FIVE` false) or a Q5_K block (`FIVE` true), and where its levels start
/// (Q5_K's fifth bits lie between, 32 bytes from offset 16).
pub(super) const fn k4_layout(five: bool) -> (usize, usize) {
    if five { (176, 48) } else { (144, 16) }
}

/// One Q4_K (`FIVE` false) or Q5_K (`FIVE` true) weight row times the rows `first..first +
/// sums.len()` of the activations: per block of 256, two sub-blocks of 32 (one byte row's low and
/// high nibbles, with Q5_K the bits `2p` and `2p + 1` of its fifth-bit bytes) per step, each scaled
/// by `d · sc`; the minimums `dmin · m` times the activations' sums subtracted per token, as in
/// the AVX2 kernel.
///
/// # Safety
/// As for [`row`]: `w` holds `k / 256` blocks of 144 (Q4_K) or 176 (Q5_K) bytes; `lanes` holds
/// the block sums.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
pub(super) unsafe fn row_k4<const FIVE: bool>(
    w: &[u8],
    a: &Activations,
    lanes: &Lanes,
    k: usize,
    first: usize,
    sums: &mut [f32],
) {
    let (bytes, _) = k4_layout(FIVE);
    let blocks = k / 256;
    let m = first + sums.len();
    assert!(w.len() >= blocks * bytes && a.q.len() >= m * k && a.d.len() >= m * k / BLOCK);
    assert!(lanes.block_sums.len() >= m * k / BLOCK);
    // SAFETY (inside the macro): the assertions above, for tokens t0..t0 + n <= m.
    in_token_chunks!(row_k4_n[FIVE](w, a, lanes, k, first, sums));
}

/// [`row_k4`] for the `N` tokens from `t0`.
///
/// # Safety
/// As for [`row_k4`], with tokens `t0..t0 + N` in `a` and `lanes`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
unsafe fn row_k4_n<const FIVE: bool, const N: usize>(
    w: &[u8],
    a: &Activations,
    lanes: &Lanes,
    k: usize,
    t0: usize,
    sums: &mut [f32],
) {
    let (bytes, levels) = k4_layout(FIVE);
    let blocks = k / 256;
    let low = _mm256_set1_epi8(0x0f);
    let sixteen = _mm512_set1_epi8(16);
    {
        let mut acc = [_mm512_setzero_ps(); N];
        let mut offsets = [_mm256_setzero_ps(); N];
        for b in 0..blocks {
            let block = &w[b * bytes..(b + 1) * bytes];
            // Q5_K's fifth bits, the 32 bytes in both halves: a pair's low half tests bit 2p,
            // its high half bit 2p + 1.
            let (fifth, mut bit) = if FIVE {
                // SAFETY: bytes 16..48 lie inside the block.
                let qh = unsafe { _mm256_loadu_si256(block.as_ptr().add(16).cast()) };
                let bit = _mm512_inserti64x4(_mm512_set1_epi8(1), _mm256_set1_epi8(2), 1);
                (_mm512_inserti64x4(_mm512_castsi256_si512(qh), qh, 1), bit)
            } else {
                (_mm512_setzero_si512(), _mm512_setzero_si512())
            };
            let packed: &[u8; 12] = block[4..16].try_into().expect("12 bytes");
            let (scales, mins) = crate::quant::scales_mins_k4(packed);
            // SAFETY: the block's 144 bytes are in `w` and the block sums of tokens t0..t0 + N
            // in `lanes` (the caller's contract); the 8-byte loads read the local arrays.
            let scale = unsafe {
                let (d, dmin) = (f16_at(block.as_ptr()), f16_at(block.as_ptr().add(2)));
                let widen = |bytes: &[u8; 8]| {
                    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(bytes.as_ptr().cast())))
                };
                let minimum = _mm256_mul_ps(widen(&mins), _mm256_set1_ps(dmin));
                for (t, offset) in offsets.iter_mut().enumerate() {
                    let at = (t0 + t) * (k / BLOCK) + b * 8;
                    let sums = _mm256_loadu_ps(lanes.block_sums.as_ptr().add(at));
                    *offset = _mm256_fmadd_ps(minimum, sums, *offset);
                }
                let mut scale = [0.0f32; 8];
                _mm256_storeu_ps(
                    scale.as_mut_ptr(),
                    _mm256_mul_ps(widen(&scales), _mm256_set1_ps(d)),
                );
                scale
            };
            for pair in 0..4 {
                // SAFETY: bytes `levels` + 32·pair .. + 32 lie inside the block; `accumulate`'s
                // contract follows from the caller's.
                unsafe {
                    let nibbles = _mm256_loadu_si256(block.as_ptr().add(levels + 32 * pair).cast());
                    let q = _mm512_inserti64x4(
                        _mm512_castsi256_si512(_mm256_and_si256(nibbles, low)),
                        _mm256_and_si256(_mm256_srli_epi16(nibbles, 4), low),
                        1,
                    );
                    let q = if FIVE {
                        let set = _mm512_test_epi8_mask(fifth, bit);
                        bit = _mm512_slli_epi16(bit, 2);
                        _mm512_mask_add_epi8(q, set, q, sixteen)
                    } else {
                        q
                    };
                    accumulate::<false, N>(
                        &mut acc,
                        t0,
                        a,
                        lanes,
                        k,
                        b * 256 + pair * 64,
                        q,
                        _mm512_setzero_si512(),
                        halves(scale[2 * pair], scale[2 * pair + 1]),
                    );
                }
            }
        }
        for ((sum, acc), offset) in sums.iter_mut().zip(acc).zip(offsets) {
            *sum = _mm512_reduce_add_ps(acc) - horizontal_sum(offset);
        }
    }
}

/// The sum of the 8 lanes.
#[target_feature(enable = "avx2")]
pub(super) fn horizontal_sum(v: __m256) -> f32 {
    let half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
    _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 1)))
}
