//! Products of `f32` rows by block-quantized weights, `out = x Ŵᵀ` with `Ŵ` `[n, k]` stored as
//! GGUF blocks (`quant`): decoding's `Linear` on a quantized model, reading 2 to 8 times fewer
//! weight bytes than `f32`.
//!
//! **Semantics.** As llama.cpp computes them: each row of `x` is first rounded to 8 bits per block
//! of 32 values as llama.cpp's Q8_0 blocks hold them (`d = max|x| / 127`, `q = round(x · (1/d))`
//! half away from zero, and `d` stored rounded to `f16` where `f16` holds it to 11 bits: `x̂ =
//! f16(d) · q`), and `out[t][j] = Σ_i ŵ_ji · x̂_ti` with `ŵ` the weight's decoded values; the
//! integer products of a block are exact, the blocks' scaled sums are added in `f32`. So a quantized model's product is exact up to `f32`
//! rounding given `x̂`, and `q` differs from `x / d` by at most half a step. (llama.cpp rounds the
//! activations of the K formats per 256 values instead, `Q8_K`; the per-32 rounding is finer.)
//!
//! **Schedule.** The weight is streamed once per call, whatever the number of rows of `x`: rows are
//! split into tasks of about 256 KiB of blocks, which the threads pull from one counter
//! ([`by_weight_rows`](super::few_rows::by_weight_rows)); a task decodes one weight row
//! at a time into 8-bit levels with a scale (and an offset, for the formats with minimums) per 16
//! values — every format to the same form, so one dot-product kernel serves all — then multiplies
//! that row into every row of `x`. Decoding is plain fixed-size byte loops the compiler vectorizes;
//! the dot product is AVX2 (`vpmaddubsw`/`vpmaddwd`, 32 values per step), else a portable loop
//! (CPUs without AVX2; forced in tests so both are checked). With AVX-512 VNNI, kernels multiply the
//! stored blocks directly: every format but Q2_K and Q3_K is stored in strips of 16 rows
//! (`quant_strips`; the few rows past the last strip are decoded), a matrix in rows goes through
//! the per-row kernels (`quant_vnni`, which tests force on every format); for
//! the formats without strips, from [`PANEL_TOKENS`] rows (a prompt) the weight is decoded 16 rows
//! at a time into panels whose `zmm` lanes are rows (`quant_gemm`): one scale step then serves 16
//! rows, where the per-row kernels pay one per row and token.

use crate::quant::{QK_K, QuantType};

/// Values per activation block (and per weight block of the 32-value formats).
pub(super) const BLOCK: usize = 32;
/// Weight bytes per task when one token streams the weight.
const TASK_BYTES: usize = 256 << 10;
/// Weight bytes per task for several tokens. Their products are paced by the arithmetic, not the
/// memory, so a task of [`TASK_BYTES`] takes 2-3x as long, and a layer of GPT-2 small (0.3-1.3 MB
/// of Q4_0) was 2 to 6 such tasks: the calling thread ran 55 % of the products' samples while the
/// other waited.
const TOKENS_TASK_BYTES: usize = 64 << 10;
/// Products whose weight is smaller than this run on the calling thread.
const PARALLEL_BYTES: usize = 128 << 10;

/// The dot-product kernel, found once per call (`std` caches the detection).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Kernel {
    /// AVX2 with AVX-512 F/BW and VNNI: `vpdpbusd` for Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K,
    /// Q5_K and Q6_K (`quant_vnni`, `quant_strips`), the decoding path for Q2_K and Q3_K.
    #[cfg(target_arch = "x86_64")]
    Avx512Vnni,
    /// AVX-512 VNNI's kernels, with the K formats' strips (Q4_K, Q5_K, Q6_K) multiplied on
    /// AMX-INT8 tiles inside the strip kernels (`quant_strips::tiles`) for products of at least
    /// [`TILE_TOKENS`] rows: the same bits, a prompt's pass 1.4x faster (BENCHMARKS.md, issue 37).
    /// The best kernel where the CPU has AMX-INT8 and Linux granted the tile state.
    #[cfg(target_arch = "x86_64")]
    Amx,
    /// AVX-512 VNNI's kernels, and every product of at least [`TILE_TOKENS`] rows on AMX-INT8
    /// tiles through weight panels decoded per call (`quant_tiles`). Only where
    /// [`KERNEL_VARIABLE`] asks for it (`amx-panels`): slower than the VNNI kernels as it stands
    /// (BENCHMARKS.md, issue 37).
    #[cfg(target_arch = "x86_64")]
    AmxPanels,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    Portable,
}

/// The environment variable that caps the quantized products' kernel below the CPU's best:
/// `portable`, `avx2`, `avx512-vnni` or `amx` (to compare the paths on one machine, or to
/// reproduce what a lesser CPU computes); `amx-panels` opts in to the AMX-INT8 panel tiles where
/// the CPU and kernel have tiles. A kernel the CPU lacks is never chosen; an unknown value is
/// reported once on standard error and ignored.
pub(crate) const KERNEL_VARIABLE: &str = "NDSCOPE_QUANT_KERNEL";

impl Kernel {
    /// The kernel every product uses: the CPU's best, capped by [`KERNEL_VARIABLE`] (read once).
    pub(crate) fn detect() -> Kernel {
        static CHOSEN: std::sync::OnceLock<Kernel> = std::sync::OnceLock::new();
        *CHOSEN.get_or_init(|| {
            let asked = std::env::var(KERNEL_VARIABLE).ok();
            Kernel::capped(Kernel::best(), asked.as_deref()).unwrap_or_else(|unknown| {
                eprintln!(
                    "ndscope: {KERNEL_VARIABLE}={unknown:?} is not a kernel (portable, avx2, \
                     avx512-vnni, amx, amx-panels); using the CPU's best"
                );
                Kernel::best()
            })
        })
    }

    /// `best`, or the kernel `asked` names if it is a lesser one; `Err(asked)` for a name that is
    /// not a kernel.
    fn capped(best: Kernel, asked: Option<&str>) -> Result<Kernel, String> {
        let rank = |kernel: Kernel| match kernel {
            Kernel::Portable => 0,
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => 1,
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512Vnni => 2,
            #[cfg(target_arch = "x86_64")]
            Kernel::Amx | Kernel::AmxPanels => 3,
        };
        let wanted = match asked.map(str::trim) {
            None | Some("") => return Ok(best),
            Some("portable") => Kernel::Portable,
            #[cfg(target_arch = "x86_64")]
            Some("avx2") => Kernel::Avx2,
            #[cfg(target_arch = "x86_64")]
            Some("avx512-vnni") => Kernel::Avx512Vnni,
            #[cfg(target_arch = "x86_64")]
            Some("amx") => Kernel::Amx,
            #[cfg(target_arch = "x86_64")]
            Some("amx-panels") => {
                // The opt-in: the tiles' kernel beside the default one, where the CPU has tiles.
                return Ok(if best == Kernel::Amx {
                    Kernel::AmxPanels
                } else {
                    best
                });
            }
            Some(other) => return Err(other.to_string()),
        };
        Ok(if rank(wanted) < rank(best) {
            wanted
        } else {
            best
        })
    }

    /// The best kernel the CPU runs.
    fn best() -> Kernel {
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c")
        {
            if std::is_x86_feature_detected!("avx512f")
                && std::is_x86_feature_detected!("avx512bw")
                && std::is_x86_feature_detected!("avx512vnni")
            {
                if super::quant_tiles::AmxInt8::detect().is_some() {
                    return Kernel::Amx;
                }
                return Kernel::Avx512Vnni;
            }
            return Kernel::Avx2;
        }
        Kernel::Portable
    }

    /// Whether the kernel reads matrices of `ty` in strips (`quant::strips`; `quant_strips` on
    /// AVX-512 VNNI, `quant_strips_avx2` on AVX2).
    pub(crate) fn reads_strips(self, ty: QuantType) -> bool {
        #[cfg(target_arch = "x86_64")]
        match self {
            Kernel::Avx512Vnni | Kernel::Amx | Kernel::AmxPanels => {
                return crate::quant::strips::has_strips(ty);
            }
            Kernel::Avx2 => return super::quant_strips_avx2::reads(ty),
            Kernel::Portable => {}
        }
        let _ = ty;
        false
    }

    /// Every kernel this CPU runs, the portable one first (for tests that check them all).
    #[cfg(test)]
    fn available() -> Vec<Kernel> {
        let mut all = vec![Kernel::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            let best = Kernel::best();
            if best != Kernel::Portable {
                all.push(Kernel::Avx2);
            }
            if best == Kernel::Avx512Vnni || best == Kernel::Amx {
                all.push(Kernel::Avx512Vnni);
            }
            if best == Kernel::Amx {
                all.extend([Kernel::Amx, Kernel::AmxPanels]);
            }
        }
        all
    }
}

/// Rows of `x` rounded to 8 bits per block of 32: levels, each block's scale, and each 16 values'
/// sum `d · Σ q` (what a weight's offset multiplies).
pub(super) struct Activations {
    pub(super) q: Vec<i8>,
    pub(super) d: Vec<f32>,
    pub(super) sums: Vec<f32>,
}

impl Activations {
    /// The levels plus 128, as unsigned bytes (against a kernel's signed weights), for the first
    /// `values`.
    #[cfg(target_arch = "x86_64")]
    pub(super) fn unsigned(&self, values: usize) -> Vec<u8> {
        self.q[..values].iter().map(|&v| (v as u8) ^ 0x80).collect()
    }

    /// `d · Σ q` per block of 32 (both halves' sums), for the first `values`.
    #[cfg(target_arch = "x86_64")]
    pub(super) fn block_sums(&self, values: usize) -> Vec<f32> {
        self.sums[..values / 16]
            .chunks_exact(2)
            .map(|h| h[0] + h[1])
            .collect()
    }
}

fn quantize_activations(x: &[f32], m: usize, k: usize) -> Activations {
    use rayon::prelude::*;
    let mut a = Activations {
        q: vec![0; m * k],
        d: vec![0.0; m * k / BLOCK],
        sums: vec![0.0; m * k / 16],
    };
    // A prompt's rows (hundreds of thousands of values) on every thread; a decoding row on this one.
    const BLOCKS_PER_TASK: usize = 1024;
    let x = &x[..m * k];
    if m * k <= BLOCKS_PER_TASK * BLOCK {
        quantize_blocks(&mut a.q, &mut a.d, &mut a.sums, x);
    } else {
        a.q.par_chunks_mut(BLOCKS_PER_TASK * BLOCK)
            .zip(a.d.par_chunks_mut(BLOCKS_PER_TASK))
            .zip(a.sums.par_chunks_mut(2 * BLOCKS_PER_TASK))
            .zip(x.par_chunks(BLOCKS_PER_TASK * BLOCK))
            .for_each(|(((q, d), sums), x)| quantize_blocks(q, d, sums, x));
    }
    a
}

/// Levels, scales and half sums of whole blocks of 32 activations, from their values.
///
/// The loops are also compiled for AVX-512 and picked at run time (a decoding step rounds about
/// 330,000 values of Llama-1B's activations: 0.9 ms a token as scalar code). Every version computes
/// the same bits: the operations are per value, and a maximum is exact in any order.
fn quantize_blocks(q: &mut [i8], d: &mut [f32], sums: &mut [f32], x: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512bw") {
        // SAFETY: the CPU has AVX-512 F and BW, the features the version is compiled for.
        return unsafe { quantize_blocks_avx512(q, d, sums, x) };
    }
    quantize_blocks_with(q, d, sums, x);
}

/// [`quantize_blocks`] for AVX-512: a block's two halves are two registers, so its maximum, levels
/// and half sums are a few whole-register instructions, where the compiler's version of the
/// portable loop moved the levels through the stack to sum them (0.55 ms of each step of eight
/// requests' decoding of GPT-2 small, 6 % of the calling thread's time). The same operations on
/// each value as [`quantize_block`], so the same bits.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
fn quantize_blocks_avx512(q: &mut [i8], d: &mut [f32], sums: &mut [f32], x: &[f32]) {
    use std::arch::x86_64::*;
    let blocks = (x.len() / BLOCK)
        .min(q.len() / BLOCK)
        .min(d.len())
        .min(sums.len() / 2);
    let sign = _mm512_set1_ps(-0.0);
    let almost_half = _mm512_set1_ps(0.499_999_97);
    let (lowest, highest) = (_mm512_set1_ps(-128.0), _mm512_set1_ps(127.0));
    for b in 0..blocks {
        // SAFETY: block `b < blocks` has its 32 values in `x` and its 32 levels in `q`; `loadu`
        // and `storeu` take any alignment.
        let halves = unsafe {
            [
                _mm512_loadu_ps(x.as_ptr().add(b * BLOCK)),
                _mm512_loadu_ps(x.as_ptr().add(b * BLOCK + 16)),
            ]
        };
        // `max(a, m)` keeps `m` where `a` is NaN, as the portable `a > m` does; the maximum of
        // non-negative numbers is exact in any order.
        let abs = halves.map(|h| _mm512_abs_ps(h));
        let lanes = _mm512_max_ps(abs[1], _mm512_max_ps(abs[0], _mm512_setzero_ps()));
        let amax = _mm512_reduce_max_ps(lanes);
        let exact = amax / 127.0;
        let id = _mm512_set1_ps(if exact == 0.0 { 0.0 } else { 1.0 / exact });
        let levels = halves.map(|h| {
            // `round_half_away`, lane by lane.
            let y = _mm512_mul_ps(h, id);
            // `0.49999997` with `y`'s sign: its magnitude, `y`'s sign bit.
            let signed_half = _mm512_or_si512(
                _mm512_and_si512(_mm512_castps_si512(y), _mm512_castps_si512(sign)),
                _mm512_castps_si512(almost_half),
            );
            let r = _mm512_add_ps(y, _mm512_castsi512_ps(signed_half));
            let number = _mm512_cmp_ps_mask::<_CMP_ORD_Q>(r, r);
            let r = _mm512_min_ps(_mm512_max_ps(r, lowest), highest);
            _mm512_maskz_cvttps_epi32(number, r)
        });
        // SAFETY: as above, for the levels of block `b`.
        unsafe {
            _mm512_mask_cvtepi32_storeu_epi8(q.as_mut_ptr().add(b * BLOCK).cast(), !0, levels[0]);
            _mm512_mask_cvtepi32_storeu_epi8(
                q.as_mut_ptr().add(b * BLOCK + 16).cast(),
                !0,
                levels[1],
            );
        }
        let scale = stored_scale(exact);
        d[b] = scale;
        for (half, levels) in levels.into_iter().enumerate() {
            sums[2 * b + half] = scale * _mm512_reduce_add_epi32(levels) as f32;
        }
    }
}

/// [`quantize_blocks`]' loop, inlined into each version.
#[inline(always)]
fn quantize_blocks_with(q: &mut [i8], d: &mut [f32], sums: &mut [f32], x: &[f32]) {
    for (((xs, qs), d), sums) in x
        .chunks_exact(BLOCK)
        .zip(q.chunks_exact_mut(BLOCK))
        .zip(d.iter_mut())
        .zip(sums.chunks_exact_mut(2))
    {
        quantize_block(xs, qs, d, sums);
    }
}

/// One block of 32 activations: levels, scale, and each half's `d · Σ q`. A NaN counts as 0 in
/// the block's maximum and becomes level 0.
#[inline(always)]
fn quantize_block(xs: &[f32], qs: &mut [i8], d: &mut f32, sums: &mut [f32]) {
    let (xs, qs): (&[f32; BLOCK], &mut [i8; BLOCK]) = (
        xs.try_into().expect("a whole block"),
        qs.try_into().expect("a whole block"),
    );
    // The maximum in 16 lanes, then halving them (`>` skips NaN, as `f32::max` does).
    let mut lanes = [0.0f32; 16];
    for half in xs.chunks_exact(16) {
        for (lane, &v) in lanes.iter_mut().zip(half) {
            let a = v.abs();
            *lane = if a > *lane { a } else { *lane };
        }
    }
    for width in [8, 4, 2, 1] {
        for j in 0..width {
            let other = lanes[j + width];
            lanes[j] = if other > lanes[j] { other } else { lanes[j] };
        }
    }
    let amax = lanes[0];
    let exact = amax / 127.0;
    let id = if exact == 0.0 { 0.0 } else { 1.0 / exact };
    let mut levels = [0i32; BLOCK];
    for (l, &v) in levels.iter_mut().zip(xs) {
        *l = round_half_away(v * id);
    }
    for (q, &l) in qs.iter_mut().zip(&levels) {
        *q = l as i8;
    }
    *d = stored_scale(exact);
    for (half, sum) in sums.iter_mut().enumerate() {
        let s: i32 = levels[16 * half..16 * half + 16].iter().sum();
        *sum = *d * s as f32;
    }
}

/// `y.round()` (half away from zero) as a level, clamped to `-128..=127`, NaN to 0, in a few
/// instructions rather than a call: adding the largest `f32` below 0.5 with `y`'s sign rounds a
/// half up to the next whole number (the sum's own rounding) and anything below a half short of it,
/// then the conversion to `i32` truncates (`f32::trunc` is a call to libm's `truncf` without
/// SSE4.1). The clamp comes first so that the conversion needs no saturation, which kept the
/// compiler from vectorising it.
#[inline(always)]
fn round_half_away(y: f32) -> i32 {
    let r = y + 0.499_999_97f32.copysign(y);
    let r = if r.is_nan() {
        0.0
    } else {
        r.clamp(-128.0, 127.0)
    };
    // SAFETY: `r` is finite and within `i32`'s range.
    unsafe { r.to_int_unchecked::<i32>() }
}

/// An activation block's scale as llama.cpp's Q8_0 block stores it, rounded to `f16` — except
/// where `f16` would lose it (above 65504 it is infinite, below 2^-14 it has fewer bits): there
/// the `f32` scale is kept, where llama.cpp's products would overflow or lose precision.
fn stored_scale(d: f32) -> f32 {
    let h = half::f16::from_f32(d);
    if h.is_finite() && (d == 0.0 || h.is_normal()) {
        h.to_f32()
    } else {
        d
    }
}

/// One weight row decoded: a level per value, and per 16 values a scale and an offset (the row's
/// value `i` is `scale[i / 16] · q[i] + offset[i / 16]`).
pub(super) struct Row {
    pub(super) q: Vec<i8>,
    pub(super) scale: Vec<f32>,
    pub(super) offset: Vec<f32>,
    /// Whether any offset is non-zero (the formats with minimums).
    pub(super) offsets: bool,
}

impl Row {
    pub(super) fn new(k: usize) -> Row {
        Row {
            q: vec![0; k],
            scale: vec![0.0; k / 16],
            offset: vec![0.0; k / 16],
            offsets: false,
        }
    }
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Fills `row` from one stored weight row (`k / block_size` blocks of `ty`).
pub(super) fn decode_row(ty: QuantType, bytes: &[u8], row: &mut Row) {
    let Row {
        q,
        scale,
        offset,
        offsets,
    } = row;
    *offsets = ty.has_minimum();
    let blocks = bytes.chunks_exact(ty.block_bytes());
    match ty {
        QuantType::Q8_0 => {
            for (i, b) in blocks.enumerate() {
                let d = f16_at(b, 0);
                scale[2 * i..2 * i + 2].fill(d);
                for (q, &v) in q[i * 32..i * 32 + 32].iter_mut().zip(&b[2..34]) {
                    *q = v as i8;
                }
            }
        }
        QuantType::Q4_0 | QuantType::Q4_1 => {
            let at = if ty == QuantType::Q4_0 { 2 } else { 4 };
            let bias = if ty == QuantType::Q4_0 { 8 } else { 0 };
            for (i, b) in blocks.enumerate() {
                scale[2 * i..2 * i + 2].fill(f16_at(b, 0));
                if ty == QuantType::Q4_1 {
                    offset[2 * i..2 * i + 2].fill(f16_at(b, 2));
                }
                let (lo, hi) = q[i * 32..i * 32 + 32].split_at_mut(16);
                for j in 0..16 {
                    lo[j] = (b[at + j] & 0x0f) as i8 - bias;
                    hi[j] = (b[at + j] >> 4) as i8 - bias;
                }
            }
        }
        QuantType::Q5_0 | QuantType::Q5_1 => {
            let at = if ty == QuantType::Q5_0 { 2 } else { 4 };
            let bias = if ty == QuantType::Q5_0 { 16 } else { 0 };
            for (i, b) in blocks.enumerate() {
                scale[2 * i..2 * i + 2].fill(f16_at(b, 0));
                if ty == QuantType::Q5_1 {
                    offset[2 * i..2 * i + 2].fill(f16_at(b, 2));
                }
                let high = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
                let qs = &b[at + 4..at + 20];
                let out = &mut q[i * 32..i * 32 + 32];
                for j in 0..16 {
                    let h0 = ((high >> j) & 1) as u8;
                    let h1 = ((high >> (j + 16)) & 1) as u8;
                    out[j] = ((qs[j] & 0x0f) | (h0 << 4)) as i8 - bias;
                    out[j + 16] = ((qs[j] >> 4) | (h1 << 4)) as i8 - bias;
                }
            }
        }
        QuantType::Q4_K | QuantType::Q5_K => {
            for (i, b) in blocks.enumerate() {
                let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
                let scales = &b[4..16];
                let (qh, qs) = if ty == QuantType::Q5_K {
                    (Some(&b[16..48]), &b[48..176])
                } else {
                    (None, &b[16..144])
                };
                for s in 0..8 {
                    let (sc, m) = crate::quant::scale_min_k4(scales, s);
                    let at = (i * QK_K + s * 32) / 16;
                    scale[at..at + 2].fill(d * f32::from(sc));
                    offset[at..at + 2].fill(-(dmin * f32::from(m)));
                    let out = &mut q[i * QK_K + s * 32..][..32];
                    let nibbles = &qs[(s / 2) * 32..][..32];
                    let shift = 4 * (s % 2);
                    for j in 0..32 {
                        let mut v = (nibbles[j] >> shift) & 0x0f;
                        if let Some(qh) = qh {
                            v |= ((qh[j] >> s) & 1) << 4;
                        }
                        out[j] = v as i8;
                    }
                }
            }
        }
        QuantType::Q6_K => {
            for (i, b) in blocks.enumerate() {
                let (ql, qh, scales) = (&b[..128], &b[128..192], &b[192..208]);
                let d = f16_at(b, 208);
                for (s, sc) in scales.iter().enumerate() {
                    scale[i * 16 + s] = d * f32::from(*sc as i8);
                }
                let out = &mut q[i * QK_K..][..QK_K];
                for a in 0..2 {
                    for r in 0..4 {
                        let low = &ql[a * 64 + (r % 2) * 32..][..32];
                        let high = &qh[a * 32..][..32];
                        let dst = &mut out[a * 128 + r * 32..][..32];
                        for j in 0..32 {
                            let l = (low[j] >> (4 * (r / 2))) & 0x0f;
                            let h = (high[j] >> (2 * r)) & 0x03;
                            dst[j] = (l | (h << 4)) as i8 - 32;
                        }
                    }
                }
            }
        }
        QuantType::Q2_K => {
            for (i, b) in blocks.enumerate() {
                let (scales, qs) = (&b[..16], &b[16..80]);
                let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
                for (s, sc) in scales.iter().enumerate() {
                    scale[i * 16 + s] = d * f32::from(sc & 0x0f);
                    offset[i * 16 + s] = -(dmin * f32::from(sc >> 4));
                }
                let out = &mut q[i * QK_K..][..QK_K];
                for a in 0..2 {
                    for s in 0..4 {
                        let dst = &mut out[a * 128 + s * 32..][..32];
                        for j in 0..32 {
                            dst[j] = ((qs[a * 32 + j] >> (2 * s)) & 3) as i8;
                        }
                    }
                }
            }
        }
        QuantType::Q3_K => {
            for (i, b) in blocks.enumerate() {
                let (hmask, qs, packed) = (&b[..32], &b[32..96], &b[96..108]);
                let d = f16_at(b, 108);
                for s in 0..16 {
                    let low = (packed[s % 8] >> (4 * (s / 8))) & 0x0f;
                    let high = (packed[8 + s % 4] >> (2 * (s / 4))) & 0x03;
                    scale[i * 16 + s] = d * f32::from((low | (high << 4)) as i8 - 32);
                }
                let out = &mut q[i * QK_K..][..QK_K];
                for (v, o) in out.iter_mut().enumerate() {
                    let (a, s, j) = (v / 128, (v / 32) % 4, v % 32);
                    let low = ((qs[a * 32 + j] >> (2 * s)) & 3) as i8;
                    let high = ((hmask[j] >> (v / 32)) & 1) ^ 1;
                    *o = low - ((high << 2) as i8);
                }
            }
        }
        QuantType::F32 | QuantType::F16 | QuantType::BF16 => {
            unreachable!("float weights take the float products")
        }
    }
}

/// `out = x Ŵᵀ` for `x` `m × k` (contiguous), `w` the `n` stored rows of `ty` (contiguous, `k /
/// block_size` blocks each) and `out` contiguous `m × n`, with `k` a multiple of `ty`'s block.
///
/// # Panics
/// When a slice does not fit its shape or `ty` is a float type (caller bugs: the op checks them).
pub(crate) fn product(
    kernel: Kernel,
    ty: QuantType,
    in_strips: bool,
    x: &[f32],
    w: &[u8],
    (m, k, n): (usize, usize, usize),
    out: &mut [f32],
) {
    let row_bytes = ty.bytes_for(k).expect("whole blocks per row");
    assert!(
        ty.is_quantized()
            && k % BLOCK == 0
            && x.len() >= m * k
            && w.len() >= n * row_bytes
            && out.len() == m * n,
        "quantized product: operands do not fit their shape"
    );
    if m == 0 || n == 0 {
        return;
    }
    if in_strips && !kernel.reads_strips(ty) {
        // A kernel that reads rows (tests force each one): the blocks back in row order.
        let rows = crate::quant::strips::from_strips(ty, w, n, k);
        return product(kernel, ty, false, x, &rows, (m, k, n), out);
    }
    let a = quantize_activations(x, m, k);
    let task_bytes = if m == 1 {
        TASK_BYTES
    } else {
        TOKENS_TASK_BYTES
    };
    let rows_per_task = (task_bytes / row_bytes.max(1)).max(1);
    let parallel = n * row_bytes >= PARALLEL_BYTES;
    // The K formats' strips take the tiles inside the strip kernels (`quant_strips::tiles`).
    #[cfg(target_arch = "x86_64")]
    let strip_tiles = (kernel == Kernel::Amx && in_strips && m >= TILE_TOKENS)
        .then(super::quant_tiles::AmxInt8::detect)
        .flatten()
        .filter(|_| super::quant_strips::StripTiles::take(ty));
    #[cfg(target_arch = "x86_64")]
    let kernel = if kernel == Kernel::AmxPanels {
        use super::quant_tiles::{AmxInt8, Stored};
        if let Some(amx) = AmxInt8::detect().filter(|_| m >= TILE_TOKENS) {
            let w = if in_strips {
                Stored::Strips(w)
            } else {
                Stored::Rows(w)
            };
            let schedule = (rows_per_task, parallel);
            return super::quant_tiles::product(amx, ty, w, &a, (m, k, n), schedule, out);
        }
        // Fewer rows: the VNNI kernels, which stream the weight once for all of them.
        Kernel::Avx512Vnni
    } else if kernel == Kernel::Amx {
        // The tiles inside the strip kernels (`strip_tiles`), the VNNI kernels everywhere else.
        Kernel::Avx512Vnni
    } else {
        kernel
    };
    #[cfg(target_arch = "x86_64")]
    if in_strips {
        use super::quant_strips::{BlockSums, strip_product};
        use crate::quant::strips::{STRIP_ROWS, strips_len};
        let sums = BlockSums::new(ty, &a);
        let strip_rows = n / STRIP_ROWS * STRIP_ROWS;
        let strip_bytes = strips_len(ty, STRIP_ROWS, k).expect("a format with strips");
        let rows_at = strip_rows / STRIP_ROWS * strip_bytes;
        assert!(
            strips_len(ty, n, k) == Some(w.len()),
            "quantized product: the strips do not fit their shape"
        );
        let rows_per_task = rows_per_task.div_ceil(STRIP_ROWS) * STRIP_ROWS;
        super::few_rows::by_weight_rows((m, n), rows_per_task, parallel, out, |mut columns| {
            // Only the rows past the last strip are decoded: a task of strips allocates nothing.
            let mut row = None;
            let mut tiles =
                strip_tiles.and_then(|amx| super::quant_strips::StripTiles::configure(amx, ty));
            let mut wide_sums = super::quant_strips::StripSums::default();
            let mut avx2_sums = super::quant_strips_avx2::StripSums::default();
            let (j0, rows) = (columns.first(), columns.len());
            for c in (0..rows).step_by(STRIP_ROWS) {
                let first = j0 + c;
                if first < strip_rows {
                    let at = first / STRIP_ROWS * strip_bytes;
                    let strip = &w[at..at + strip_bytes];
                    if kernel == Kernel::Avx512Vnni {
                        let tiles = tiles.as_mut();
                        let out = &mut wide_sums;
                        strip_product(ty, strip, &a, &sums, (m, k), &mut columns, c, tiles, out);
                    } else {
                        super::quant_strips_avx2::strip_product(
                            ty,
                            strip,
                            &a,
                            &sums,
                            (m, k),
                            &mut columns,
                            c,
                            &mut avx2_sums,
                        );
                    }
                    continue;
                }
                // The rows past the last whole strip, stored in row order after the strips.
                let mut sums = vec![0.0; m];
                for r in c..rows {
                    let at = rows_at + (j0 + r - strip_rows) * row_bytes;
                    let row = row.get_or_insert_with(|| Row::new(k));
                    decoded_into_tokens(kernel, ty, &w[at..at + row_bytes], row, &a, &mut sums);
                    columns.set_column(r, 0, &sums);
                }
            }
        });
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if kernel == Kernel::Avx512Vnni && m >= PANEL_TOKENS {
        use super::quant_gemm::{LANES, Panel, panel_product};
        let unsigned = a.unsigned(m * k);
        let rows_per_task = rows_per_task.div_ceil(LANES) * LANES;
        super::few_rows::by_weight_rows((m, n), rows_per_task, parallel, out, |mut columns| {
            let (mut panel, mut row) = (Panel::new(k), Row::new(k));
            let (j0, task_rows) = (columns.first(), columns.len());
            for c in (0..task_rows).step_by(LANES) {
                let (first, rows) = (j0 + c, LANES.min(task_rows - c));
                panel.fill(
                    ty,
                    &w[first * row_bytes..(first + rows) * row_bytes],
                    row_bytes,
                    &mut row,
                );
                panel_product(&panel, &a, &unsigned, (m, k), 0..m, &mut columns, (c, rows));
            }
        });
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if let Some((vnni, lanes)) = vnni_kernel(kernel, ty, k, &a, m) {
        super::few_rows::by_weight_rows((m, n), rows_per_task, parallel, out, |mut columns| {
            // A group of tokens at a time through all of the task's weight rows, so that a
            // prompt's activations are read from L1 rather than from L2 once per weight row.
            let mut sums = [0.0; TOKEN_GROUP];
            for t0 in (0..m).step_by(TOKEN_GROUP) {
                let sums = &mut sums[..TOKEN_GROUP.min(m - t0)];
                for r in 0..columns.len() {
                    let j = columns.first() + r;
                    let row = &w[j * row_bytes..(j + 1) * row_bytes];
                    vnni(row, &a, &lanes, k, t0, sums);
                    columns.set_column(r, t0, sums);
                }
            }
        });
        return;
    }
    let fused = fused_kernel(kernel, ty);
    super::few_rows::by_weight_rows((m, n), rows_per_task, parallel, out, |mut columns| {
        let mut row = Row::new(if fused.is_some() { 0 } else { k });
        let mut sums = vec![0.0; m];
        for r in 0..columns.len() {
            let j = columns.first() + r;
            let stored = &w[j * row_bytes..(j + 1) * row_bytes];
            match fused {
                Some(fused) => fused(stored, &a, k, &mut sums),
                None => decoded_into_tokens(kernel, ty, stored, &mut row, &a, &mut sums),
            }
            columns.set_column(r, 0, &sums);
        }
    });
}

/// `sums[t] = x̂_t · ŵ` for the stored row `stored` (decoded into `row`) and every token `t` of `a`.
fn decoded_into_tokens(
    kernel: Kernel,
    ty: QuantType,
    stored: &[u8],
    row: &mut Row,
    a: &Activations,
    sums: &mut [f32],
) {
    decode_row(ty, stored, row);
    let k = row.q.len();
    for (t, s) in sums.iter_mut().enumerate() {
        *s = dot(kernel, row, a, t, k);
    }
}

/// Rows of `x` from which the AVX-512 VNNI products decode the weight into 16-row panels
/// (`quant_gemm`) instead of multiplying each stored row into the tokens (`quant_vnni`): where the
/// panels' faster tokens pay for decoding the weight (Q4_0, 2048 × 8192 on 2 threads: 3.5 ms to
/// decode, then 36 µs a token against the row kernel's 108).
#[cfg(target_arch = "x86_64")]
pub(crate) const PANEL_TOKENS: usize = 48;

/// Rows of `x` from which an AMX machine's products decode the weight into panels and multiply
/// them on int8 tiles (`quant_tiles`).
#[cfg(target_arch = "x86_64")]
pub(crate) const TILE_TOKENS: usize = 32;

/// A VNNI kernel: one stored row times the rows `first..` of the activations (one per output), with
/// their lanes.
#[cfg(target_arch = "x86_64")]
type Vnni = fn(&[u8], &Activations, &super::quant_vnni::Lanes, usize, usize, &mut [f32]);

/// Tokens multiplied into a task's weight rows before the next tokens: 16 rows of activations
/// (32 KiB at k = 2048) stay in L1.
#[cfg(target_arch = "x86_64")]
const TOKEN_GROUP: usize = 16;

/// The VNNI kernel for `ty` where the CPU has one (and `k` is whole pairs of blocks), with the
/// activations' lanes it reads.
#[cfg(target_arch = "x86_64")]
fn vnni_kernel(
    kernel: Kernel,
    ty: QuantType,
    k: usize,
    a: &Activations,
    m: usize,
) -> Option<(Vnni, super::quant_vnni::Lanes)> {
    use super::quant_vnni::{self as vnni, Lanes, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0};
    if kernel != Kernel::Avx512Vnni || !k.is_multiple_of(64) {
        return None;
    }
    // Every kernel's contract: `Kernel::Avx512Vnni` is detected with AVX-512 F/BW, VNNI, AVX2 and
    // F16C; `product` checked that `w` holds the row's blocks and the activations `m` rows of `k`
    // (a multiple of 64), and calls with `first + sums.len() <= m`; the lanes hold the unsigned levels where the kernel reads
    // them (`unsigned` below).
    macro_rules! kernel {
        ($f:expr) => {
            |w, a, l, k, t, s| {
                // SAFETY: the contract above.
                unsafe { $f(w, a, l, k, t, s) }
            }
        };
    }
    let (f, unsigned): (Vnni, bool) = match ty {
        QuantType::Q8_0 => (kernel!(vnni::row::<Q8_0>), true),
        QuantType::Q4_0 => (kernel!(vnni::row::<Q4_0>), true),
        QuantType::Q5_0 => (kernel!(vnni::row::<Q5_0>), true),
        QuantType::Q4_1 => (kernel!(vnni::row::<Q4_1>), false),
        QuantType::Q5_1 => (kernel!(vnni::row::<Q5_1>), false),
        QuantType::Q4_K => (kernel!(vnni::row_k4::<false>), false),
        QuantType::Q5_K => (kernel!(vnni::row_k4::<true>), false),
        QuantType::Q6_K => (kernel!(vnni::row_q6_k), true),
        _ => return None,
    };
    Some((f, Lanes::new(a, m, k, unsigned)))
}

/// A kernel that decodes one stored row in registers and multiplies it into every row of the
/// activations (`sums[t]`), for the formats that have one on this CPU.
type Fused = fn(&[u8], &Activations, usize, &mut [f32]);

fn fused_kernel(kernel: Kernel, ty: QuantType) -> Option<Fused> {
    #[cfg(target_arch = "x86_64")]
    use super::quant_vnni as vnni;
    #[cfg(target_arch = "x86_64")]
    let kernel = if matches!(kernel, Kernel::Avx512Vnni | Kernel::Amx | Kernel::AmxPanels) {
        Kernel::Avx2
    } else {
        kernel
    };
    match (kernel, ty) {
        #[cfg(target_arch = "x86_64")]
        (Kernel::Avx2, QuantType::Q8_0) => Some(|w, a, k, sums| {
            // SAFETY: `Kernel::Avx2` is detected with AVX2, FMA and F16C; `product` checked that `w`
            // holds `k / 32` blocks and the activations `sums.len()` rows of `k`.
            unsafe { avx2::row::<vnni::Q8_0>(w, a, k, sums) }
        }),
        #[cfg(target_arch = "x86_64")]
        (Kernel::Avx2, QuantType::Q4_0) => Some(|w, a, k, sums| {
            // SAFETY: as for Q8_0.
            unsafe { avx2::row::<vnni::Q4_0>(w, a, k, sums) }
        }),
        #[cfg(target_arch = "x86_64")]
        (Kernel::Avx2, QuantType::Q4_1) => Some(|w, a, k, sums| {
            // SAFETY: as for Q8_0.
            unsafe { avx2::row::<vnni::Q4_1>(w, a, k, sums) }
        }),
        #[cfg(target_arch = "x86_64")]
        (Kernel::Avx2, QuantType::Q5_0) => Some(|w, a, k, sums| {
            // SAFETY: as for Q8_0.
            unsafe { avx2::row::<vnni::Q5_0>(w, a, k, sums) }
        }),
        #[cfg(target_arch = "x86_64")]
        (Kernel::Avx2, QuantType::Q5_1) => Some(|w, a, k, sums| {
            // SAFETY: as for Q8_0.
            unsafe { avx2::row::<vnni::Q5_1>(w, a, k, sums) }
        }),
        #[cfg(target_arch = "x86_64")]
        (Kernel::Avx2, QuantType::Q4_K) => Some(|w, a, k, sums| {
            // SAFETY: as for Q8_0 (`k / 256` blocks of 144 bytes).
            unsafe { avx2::row_k4::<false>(w, a, k, sums) }
        }),
        #[cfg(target_arch = "x86_64")]
        (Kernel::Avx2, QuantType::Q5_K) => Some(|w, a, k, sums| {
            // SAFETY: as for Q8_0 (`k / 256` blocks of 176 bytes).
            unsafe { avx2::row_k4::<true>(w, a, k, sums) }
        }),
        #[cfg(target_arch = "x86_64")]
        (Kernel::Avx2, QuantType::Q6_K) => Some(|w, a, k, sums| {
            // SAFETY: as for Q8_0 (`k / 256` blocks of 210 bytes).
            unsafe { avx2::row_q6_k(w, a, k, sums) }
        }),
        _ => None,
    }
}

/// Row `t` of the activations times the decoded weight row.
fn dot(kernel: Kernel, row: &Row, a: &Activations, t: usize, k: usize) -> f32 {
    let xq = &a.q[t * k..(t + 1) * k];
    let xd = &a.d[t * k / BLOCK..(t + 1) * k / BLOCK];
    let scaled = match kernel {
        // SAFETY: `Kernel::detect` returned `Avx2` only where the CPU has AVX2 and FMA; every
        // slice holds `k` values (or `k / 16`, `k / 32` scales), which is all the kernel reads.
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 | Kernel::Avx512Vnni | Kernel::Amx | Kernel::AmxPanels => unsafe {
            avx2::dot(&row.q, &row.scale, xq, xd)
        },
        Kernel::Portable => portable_dot(&row.q, &row.scale, xq, xd),
    };
    if !row.offsets {
        return scaled;
    }
    let sums = &a.sums[t * k / 16..(t + 1) * k / 16];
    scaled + row.offset.iter().zip(sums).map(|(o, s)| o * s).sum::<f32>()
}

/// `Σ_b xd[b] · Σ_{h<2} scale[2b + h] · Σ_{i in half h} q_i · x_i`, one block at a time.
fn portable_dot(q: &[i8], scale: &[f32], xq: &[i8], xd: &[f32]) -> f32 {
    let mut total = 0.0f32;
    for (b, (&d, (qs, xs))) in xd
        .iter()
        .zip(q.chunks_exact(BLOCK).zip(xq.chunks_exact(BLOCK)))
        .enumerate()
    {
        let mut block = 0.0f32;
        for h in 0..2 {
            let s: i32 = qs[16 * h..16 * h + 16]
                .iter()
                .zip(&xs[16 * h..16 * h + 16])
                .map(|(&a, &b)| i32::from(a) * i32::from(b))
                .sum();
            block += scale[2 * b + h] * s as f32;
        }
        total += d * block;
    }
    total
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::super::quant_vnni::{Small, f16_at, horizontal_sum};
    use super::{Activations, BLOCK};

    /// Tokens whose accumulators stay in registers during one pass over a weight row.
    const TOKENS: usize = 8;

    /// One weight row of a 32-value format `F` (`quant_vnni::Small` names each layout) times
    /// every row of the activations: each block's levels decoded once into 32 bytes in a register
    /// (nibbles split, a fifth bit added as 16 under a byte mask), then multiplied into up to 8
    /// tokens' accumulators by `vpmaddubsw` and `vpmaddwd`, scaled by `d_w · d_x`. Signed levels
    /// (Q8_0; Q4_0 and Q5_0 once offset) go in as `|q| · sign(x, q)`, as in [`dot`]; the formats
    /// with a minimum (Q4_1, Q5_1) keep their unsigned levels against the signed activations and
    /// add `m · d_x · Σ q_x` per block (the activations' sums).
    ///
    /// # Safety
    /// The CPU must have AVX2, FMA and F16C; `w` holds `k / 32` blocks of `F` and `a` `sums.len()`
    /// rows of `k` values.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn row<F: Small>(w: &[u8], a: &Activations, k: usize, sums: &mut [f32]) {
        let blocks = k / BLOCK;
        let m = sums.len();
        assert!(w.len() >= blocks * F::BYTES && a.q.len() >= m * k && a.d.len() >= m * blocks);
        assert!(!F::MINIMUM || a.sums.len() >= m * k / 16);
        let ones = _mm256_set1_epi16(1);
        let low = _mm_set1_epi8(0x0f);
        let bias = _mm256_set1_epi8(F::BIAS);
        let sixteen = _mm256_set1_epi8(16);
        for t0 in (0..m).step_by(TOKENS) {
            let tokens = TOKENS.min(m - t0);
            let mut acc = [_mm256_setzero_ps(); TOKENS];
            let mut offsets = [0.0f32; TOKENS];
            for b in 0..blocks {
                // SAFETY: the assertions keep every load inside `w`, `a.q`, `a.d` and `a.sums`
                // (block `b` < `blocks`, token `t0 + t` < `m`); `loadu` takes any alignment.
                unsafe {
                    let at = w.as_ptr().add(b * F::BYTES);
                    let d = f16_at(at);
                    let q = if F::NIBBLES {
                        let bytes = _mm_loadu_si128(at.add(F::LEVELS).cast());
                        let lo = _mm_and_si128(bytes, low);
                        let hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
                        _mm256_set_m128i(hi, lo)
                    } else {
                        _mm256_loadu_si256(at.add(F::LEVELS).cast())
                    };
                    let q = if F::FIFTH_BIT {
                        let fifth = at.add(F::LEVELS - 4);
                        let bits = u32::from_le_bytes([
                            *fifth,
                            *fifth.add(1),
                            *fifth.add(2),
                            *fifth.add(3),
                        ]);
                        _mm256_add_epi8(q, _mm256_and_si256(byte_mask(bits), sixteen))
                    } else {
                        q
                    };
                    if F::MINIMUM {
                        let minimum = f16_at(at.add(2));
                        for t in 0..tokens {
                            let row = t0 + t;
                            let halves = row * (k / 16) + 2 * b;
                            offsets[t] += minimum
                                * (a.sums.get_unchecked(halves) + a.sums.get_unchecked(halves + 1));
                            let x =
                                _mm256_loadu_si256(a.q.as_ptr().add(row * k + b * BLOCK).cast());
                            let products = _mm256_maddubs_epi16(q, x);
                            let s = _mm256_cvtepi32_ps(_mm256_madd_epi16(products, ones));
                            let scale = d * *a.d.get_unchecked(row * blocks + b);
                            acc[t] = _mm256_fmadd_ps(s, _mm256_set1_ps(scale), acc[t]);
                        }
                        continue;
                    }
                    let q = _mm256_sub_epi8(q, bias);
                    let magnitude = _mm256_sign_epi8(q, q);
                    for (t, acc) in acc.iter_mut().enumerate().take(tokens) {
                        let row = t0 + t;
                        let x = _mm256_loadu_si256(a.q.as_ptr().add(row * k + b * BLOCK).cast());
                        let products = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(x, q));
                        let s = _mm256_cvtepi32_ps(_mm256_madd_epi16(products, ones));
                        let scale = d * *a.d.get_unchecked(row * blocks + b);
                        *acc = _mm256_fmadd_ps(s, _mm256_set1_ps(scale), *acc);
                    }
                }
            }
            for t in 0..tokens {
                sums[t0 + t] = horizontal_sum(acc[t]) + offsets[t];
            }
        }
    }

    /// Byte `j` all ones where bit `j` of `bits` is set, else zero.
    #[target_feature(enable = "avx2")]
    fn byte_mask(bits: u32) -> __m256i {
        // Bytes 0..8 of the result take byte 0 of `bits`, 8..16 byte 1, and so on (the shuffle
        // indexes within each 128-bit lane, and each lane holds the broadcast word).
        let spread = _mm256_setr_epi8(
            0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3,
            3, 3, 3,
        );
        let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(bits as i32), spread);
        let select = _mm256_set1_epi64x(0x8040_2010_0804_0201_u64 as i64);
        _mm256_cmpeq_epi8(_mm256_and_si256(bytes, select), select)
    }

    /// One Q4_K (`FIVE` false) or Q5_K (`FIVE` true) weight row times every row of the
    /// activations: per block of 256, the 8 sub-blocks' 4-bit levels taken from registers (with
    /// Q5_K, 16 added where sub-block `s`'s values have bit `s` of their `qh` byte set), multiplied
    /// by `vpmaddubsw` of the unsigned levels and the signed activations, each scaled by `d · sc ·
    /// d_x`, and the minimums subtracted as `dmin · m` times the activations' block sums.
    ///
    /// # Safety
    /// As for [`row`]: `w` holds `k / 256` blocks of 144 (Q4_K) or 176 (Q5_K) bytes.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn row_k4<const FIVE: bool>(
        w: &[u8],
        a: &Activations,
        k: usize,
        sums: &mut [f32],
    ) {
        // Q5_K's 32 bytes of fifth bits lie between the scales and the levels.
        let (block_bytes, levels_at) = super::super::quant_vnni::k4_layout(FIVE);
        let blocks = k / 256;
        let m = sums.len();
        assert!(
            w.len() >= blocks * block_bytes && a.q.len() >= m * k && a.sums.len() >= m * k / 16
        );
        let ones = _mm256_set1_epi16(1);
        let low = _mm256_set1_epi8(0x0f);
        for t0 in (0..m).step_by(TOKENS) {
            let tokens = TOKENS.min(m - t0);
            let mut acc = [_mm256_setzero_ps(); TOKENS];
            let mut offsets = [_mm256_setzero_ps(); TOKENS];
            for b in 0..blocks {
                let block = &w[b * block_bytes..(b + 1) * block_bytes];
                // SAFETY: the block's bytes are in `w` (the assertion); Q5_K's fifth bits at 16..48.
                let (d, dmin, qh) = unsafe {
                    let qh = if FIVE {
                        _mm256_loadu_si256(block.as_ptr().add(16).cast())
                    } else {
                        _mm256_setzero_si256()
                    };
                    (f16_at(block.as_ptr()), f16_at(block.as_ptr().add(2)), qh)
                };
                // Each sub-block's scale `d · sc` and minimum `dmin · m`, decoded once per block;
                // the minimums times the activations' sums, once per token.
                let packed: &[u8; 12] = block[4..16].try_into().expect("12 bytes");
                let (scales, mins) = crate::quant::scales_mins_k4(packed);
                let scale = scales.map(|sc| d * f32::from(sc));
                // SAFETY: the 8-byte loads read the local arrays; the 16 sums of each token's
                // block are inside `a.sums` (the assertion: token < m, block < k / 256).
                unsafe {
                    let widen = |bytes: &[u8; 8]| {
                        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
                            bytes.as_ptr().cast(),
                        )))
                    };
                    // Each sub-block's minimum over its two halves' sums.
                    let minimum = _mm256_mul_ps(widen(&mins), _mm256_set1_ps(dmin));
                    let low = _mm256_permutevar8x32_ps(
                        minimum,
                        _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3),
                    );
                    let high = _mm256_permutevar8x32_ps(
                        minimum,
                        _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7),
                    );
                    for (t, offset) in offsets.iter_mut().enumerate().take(tokens) {
                        let at = a.sums.as_ptr().add((t0 + t) * (k / 16) + b * 16);
                        *offset = _mm256_fmadd_ps(low, _mm256_loadu_ps(at), *offset);
                        *offset = _mm256_fmadd_ps(high, _mm256_loadu_ps(at.add(8)), *offset);
                    }
                }
                let first = b * 256 / BLOCK;
                for pair in 0..4 {
                    // SAFETY: bytes `levels_at` + 32·pair .. + 32 lie inside the block; every activation index below is < m · k (the assertion).
                    unsafe {
                        let bytes =
                            _mm256_loadu_si256(block.as_ptr().add(levels_at + 32 * pair).cast());
                        let levels = [
                            _mm256_and_si256(bytes, low),
                            _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low),
                        ];
                        for (h, q) in levels.into_iter().enumerate() {
                            let sub = 2 * pair + h;
                            let q = if FIVE {
                                let bit = _mm256_set1_epi8((1u8 << sub) as i8);
                                let set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
                                _mm256_add_epi8(q, _mm256_and_si256(set, _mm256_set1_epi8(16)))
                            } else {
                                q
                            };
                            let scale = scale[sub];
                            let x_block = first + sub;
                            for (t, acc) in acc.iter_mut().enumerate().take(tokens) {
                                let row = t0 + t;
                                let x = _mm256_loadu_si256(
                                    a.q.as_ptr().add(row * k + x_block * BLOCK).cast(),
                                );
                                let s = _mm256_cvtepi32_ps(_mm256_madd_epi16(
                                    _mm256_maddubs_epi16(q, x),
                                    ones,
                                ));
                                let xd = *a.d.get_unchecked(row * (k / BLOCK) + x_block);
                                *acc = _mm256_fmadd_ps(s, _mm256_set1_ps(scale * xd), *acc);
                            }
                        }
                    }
                }
            }
            for t in 0..tokens {
                sums[t0 + t] = horizontal_sum(acc[t]) - horizontal_sum(offsets[t]);
            }
        }
    }

    /// One Q6_K weight row times every row of the activations: per block of 256, 6-bit levels
    /// assembled in registers from their low 4 and high 2 bits, offset by −32, and each 16
    /// values scaled by their own `i8` scale (`d · sc · d_x`, the four 32-bit lanes of a half).
    ///
    /// # Safety
    /// As for [`row`]: `w` holds `k / 256` blocks of 210 bytes.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn row_q6_k(w: &[u8], a: &Activations, k: usize, sums: &mut [f32]) {
        const BYTES: usize = 210;
        let blocks = k / 256;
        let m = sums.len();
        assert!(w.len() >= blocks * BYTES && a.q.len() >= m * k && a.d.len() >= m * k / BLOCK);
        let ones = _mm256_set1_epi16(1);
        let low = _mm256_set1_epi8(0x0f);
        let two = _mm256_set1_epi8(0x03);
        let offset = _mm256_set1_epi8(32);
        for t0 in (0..m).step_by(TOKENS) {
            let tokens = TOKENS.min(m - t0);
            let mut acc = [_mm256_setzero_ps(); TOKENS];
            for b in 0..blocks {
                let block = &w[b * BYTES..(b + 1) * BYTES];
                // SAFETY: the block's 210 bytes are in `w` (the assertion).
                let d = unsafe { f16_at(block.as_ptr().add(208)) };
                for half in 0..2 {
                    // SAFETY: the loads read bytes 64·half .. + 64 of `ql`, 128 + 32·half .. + 32
                    // of `qh`, inside the block; activation indices are < m · k.
                    unsafe {
                        let ql0 = _mm256_loadu_si256(block.as_ptr().add(64 * half).cast());
                        let ql1 = _mm256_loadu_si256(block.as_ptr().add(64 * half + 32).cast());
                        let qh = _mm256_loadu_si256(block.as_ptr().add(128 + 32 * half).cast());
                        let lows = [
                            _mm256_and_si256(ql0, low),
                            _mm256_and_si256(ql1, low),
                            _mm256_and_si256(_mm256_srli_epi16(ql0, 4), low),
                            _mm256_and_si256(_mm256_srli_epi16(ql1, 4), low),
                        ];
                        let highs = [
                            _mm256_and_si256(qh, two),
                            _mm256_and_si256(_mm256_srli_epi16(qh, 2), two),
                            _mm256_and_si256(_mm256_srli_epi16(qh, 4), two),
                            _mm256_and_si256(_mm256_srli_epi16(qh, 6), two),
                        ];
                        for r in 0..4 {
                            let q = _mm256_sub_epi8(
                                _mm256_or_si256(lows[r], _mm256_slli_epi16(highs[r], 4)),
                                offset,
                            );
                            let magnitude = _mm256_sign_epi8(q, q);
                            let sub = half * 8 + 2 * r; // the first of this 32's two 16-scales
                            let (s0, s1) = (
                                f32::from(block[192 + sub] as i8) * d,
                                f32::from(block[192 + sub + 1] as i8) * d,
                            );
                            let x_block = (b * 256 + half * 128 + r * 32) / BLOCK;
                            for (t, acc) in acc.iter_mut().enumerate().take(tokens) {
                                let row = t0 + t;
                                let x = _mm256_loadu_si256(
                                    a.q.as_ptr().add(row * k + x_block * BLOCK).cast(),
                                );
                                let p = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(x, q));
                                let s = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones));
                                let xd = *a.d.get_unchecked(row * (k / BLOCK) + x_block);
                                let scale =
                                    _mm256_set_m128(_mm_set1_ps(s1 * xd), _mm_set1_ps(s0 * xd));
                                *acc = _mm256_fmadd_ps(s, scale, *acc);
                            }
                        }
                    }
                }
            }
            for t in 0..tokens {
                sums[t0 + t] = horizontal_sum(acc[t]);
            }
        }
    }

    /// As `portable_dot`, 32 values per step: `|q| · sign(x, q)` multiplied and paired to 16-bit
    /// sums (`vpmaddubsw`: at most 2 · 127 · 128, no saturation), paired again to 32-bit sums
    /// (`vpmaddwd`), the four lanes of each 16 values scaled by that half's scale and the block's
    /// activation scale, accumulated in 8 `f32` lanes.
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA; `q` and `xq` hold `32 · xd.len()` values and `scale`
    /// `2 · xd.len()`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot(q: &[i8], scale: &[f32], xq: &[i8], xd: &[f32]) -> f32 {
        let blocks = xd.len();
        assert!(
            q.len() >= blocks * BLOCK && xq.len() >= blocks * BLOCK && scale.len() >= 2 * blocks
        );
        let ones = _mm256_set1_epi16(1);
        let mut acc = _mm256_setzero_ps();
        for b in 0..blocks {
            // SAFETY: the assertion keeps each 32-byte load and 2-float read inside the slices;
            // unaligned loads (`loadu`) take any address.
            unsafe {
                let w = _mm256_loadu_si256(q.as_ptr().add(b * BLOCK).cast());
                let x = _mm256_loadu_si256(xq.as_ptr().add(b * BLOCK).cast());
                let products = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
                let sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(products, ones));
                let d = *xd.get_unchecked(b);
                let lo = _mm_set1_ps(*scale.get_unchecked(2 * b) * d);
                let hi = _mm_set1_ps(*scale.get_unchecked(2 * b + 1) * d);
                acc = _mm256_fmadd_ps(sums, _mm256_set_m128(hi, lo), acc);
            }
        }
        horizontal_sum(acc)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant;

    /// Random floats from a seed (xorshift), spread over a few magnitudes.
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed | 1;
        (0..n)
            .map(|i| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                let u = (s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0;
                (u * [0.02, 1.0, 3.0][i % 3]) as f32
            })
            .collect()
    }

    /// Random bytes with finite `f16` scales where each format keeps them.
    fn blocks(ty: QuantType, rows: usize, k: usize, seed: u64) -> Vec<u8> {
        if ty.can_quantize() {
            return quant::quantize(ty, &values(rows * k, seed)).unwrap();
        }
        let mut s = seed | 1;
        let mut bytes: Vec<u8> = (0..ty.bytes_for(rows * k).unwrap())
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                s as u8
            })
            .collect();
        let halves: &[usize] = match ty {
            QuantType::Q2_K => &[80, 82],
            QuantType::Q3_K => &[108],
            QuantType::Q4_K | QuantType::Q5_K => &[0, 2],
            _ => &[208],
        };
        for (i, block) in bytes.chunks_exact_mut(ty.block_bytes()).enumerate() {
            for &at in halves {
                let v = half::f16::from_f32(0.001 * (1 + (i + at) % 7) as f32);
                block[at..at + 2].copy_from_slice(&v.to_le_bytes());
            }
        }
        bytes
    }

    /// `x̂`: `x` rounded to 8 bits per block as the kernel documents.
    fn rounded(x: &[f32]) -> Vec<f64> {
        let a = quantize_activations(x, 1, x.len());
        a.q.iter()
            .enumerate()
            .map(|(i, &q)| f64::from(a.d[i / BLOCK]) * f64::from(q))
            .collect()
    }

    /// Q4_0, Q5_K, Q6_K and Q8_0 levels at their extremes (every nibble 15, every 5-bit level 31,
    /// every 6-bit level 63, every 8-bit level 127 or −128) against tokens at theirs (every level
    /// ±127): the kernels that sum byte products in 16 bits (AVX2's `vpmaddubsw`) must not
    /// saturate.
    #[test]
    fn extreme_levels_do_not_saturate_any_kernel() {
        let (m, k, n) = (2, 256, 16);
        // Q4_0: d = 1 (f16 0x3c00), then 16 bytes of two nibbles 15: every value 7. Q6_K: 128
        // bytes of low nibbles 15, 64 of high bits 3, 16 scales 1, d = 1: every value 31.
        let q4_0: Vec<u8> = [0x00, 0x3c].into_iter().chain([0xff; 16]).collect();
        let q6_k: Vec<u8> = [0xff; 192]
            .into_iter()
            .chain([1; 16])
            .chain([0x00, 0x3c])
            .collect();
        // Q5_K: d = 1, dmin = 0, the 8 sub-blocks' 6-bit scales 1 and minimums 0, every fifth
        // bit and nibble set: every value 31. Q8_0: d = 1, every level 127 (stored in strips as
        // 255) or −128.
        let q5_k: Vec<u8> = [0x00, 0x3c, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1]
            .into_iter()
            .chain([0xff; 160])
            .collect();
        let q8_0 = |level: u8| -> Vec<u8> { [0x00, 0x3c].into_iter().chain([level; 32]).collect() };
        let x: Vec<f32> = (0..m * k).map(|i| if i < k { 1.0 } else { -1.0 }).collect();
        for (ty, block, value) in [
            (QuantType::Q4_0, q4_0, 7.0),
            (QuantType::Q5_K, q5_k, 31.0),
            (QuantType::Q6_K, q6_k, 31.0),
            (QuantType::Q8_0, q8_0(127), 127.0),
            (QuantType::Q8_0, q8_0(0x80), -128.0),
        ] {
            let w: Vec<u8> = block.repeat(n * k / ty.block_size());
            let strips = quant::strips::to_strips(ty, &w, n, k);
            for kernel in Kernel::available() {
                for (in_strips, w) in [(false, &w), (true, &strips)] {
                    let mut out = vec![0.0f32; m * n];
                    product(kernel, ty, in_strips, &x, w, (m, k, n), &mut out);
                    for (t, row) in out.chunks_exact(n).enumerate() {
                        let want = if t == 0 { value } else { -value } * k as f32;
                        for &got in row {
                            assert!(
                                (got - want).abs() <= 1e-4 * want.abs(),
                                "{ty} {kernel:?} strips {in_strips} token {t}: {got} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn every_format_and_kernel_matches_an_f64_product_of_the_decoded_weight() {
        let kernels = Kernel::available();
        for &ty in QuantType::all().iter().filter(|t| t.is_quantized()) {
            for (m, k, n) in [
                (1, 256, 3),
                (3, 512, 5),
                (16, 256, 2),
                (23, 256, 3),
                (9, 512, 37),
                (1, 512, 32),
                (5, 256, 48),
                (PANEL_TOKENS + 3, 256, 37),
                (24, 64, 40),
                (24, 160, 40),
            ] {
                if k % ty.block_size() != 0 {
                    continue;
                }
                let w = blocks(ty, n, k, 7 + n as u64);
                let mut decoded = vec![0.0f32; n * k];
                quant::dequantize(ty, &w, &mut decoded).unwrap();
                let x = values(m * k, 99 + m as u64);
                // Every kernel on the rows, and on the strips where the format has them (read
                // directly by the kernel that reads strips, put back in row order for the others).
                let mut orders = vec![(false, w.clone())];
                if quant::strips::has_strips(ty) {
                    orders.push((true, quant::strips::to_strips(ty, &w, n, k)));
                }
                let cases = kernels.iter().flat_map(|&kernel| {
                    orders
                        .iter()
                        .map(move |(in_strips, w)| (kernel, *in_strips, w))
                });
                for (kernel, in_strips, w) in cases {
                    let mut out = vec![0.0f32; m * n];
                    product(kernel, ty, in_strips, &x, w, (m, k, n), &mut out);
                    for t in 0..m {
                        let xr = rounded(&x[t * k..(t + 1) * k]);
                        for j in 0..n {
                            let wr = &decoded[j * k..(j + 1) * k];
                            let want: f64 =
                                wr.iter().zip(&xr).map(|(&w, &x)| f64::from(w) * x).sum();
                            let scale: f64 = wr
                                .iter()
                                .zip(&xr)
                                .map(|(&w, &x)| (f64::from(w) * x).abs())
                                .sum();
                            let got = f64::from(out[t * n + j]);
                            assert!(
                                (got - want).abs() <= 1e-5 * scale + 1e-30,
                                "{ty} {kernel:?} strips {in_strips} m={m} k={k} n={n} [{t}][{j}]: {got} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// The int8 tiles compute what the VNNI kernels compute, bit for bit: the same integer sums
    /// per scale block, scaled and added in the same order. The strip tiles (`Kernel::Amx`) give
    /// the VNNI strip kernels' bits; the panel tiles (`Kernel::AmxPanels`) the VNNI panels', for a
    /// weight in strips as in rows.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_int8_tiles_give_the_vnni_kernels_bits() {
        if Kernel::best() != Kernel::Amx {
            eprintln!(
                "not run: this CPU or kernel has no AMX-INT8 tiles (the VNNI path is tested)"
            );
            return;
        }
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        for &ty in QuantType::all().iter().filter(|t| t.is_quantized()) {
            // Whole 16-token groups and a tail; one to three chunks of scale blocks, an odd count.
            for (m, k, n) in [(64, 512, 37), (51, 1280, 16), (PANEL_TOKENS, 160, 33)] {
                if k % ty.block_size() != 0 {
                    continue;
                }
                let w = blocks(ty, n, k, 3 + n as u64);
                let x = values(m * k, 17 + m as u64);
                let run = |kernel, in_strips, w: &[u8]| {
                    let mut out = vec![0.0f32; m * n];
                    product(kernel, ty, in_strips, &x, w, (m, k, n), &mut out);
                    bits(&out)
                };
                let panels = run(Kernel::Avx512Vnni, false, &w);
                assert_eq!(
                    run(Kernel::AmxPanels, false, &w),
                    panels,
                    "{ty} panel tiles, rows, m={m} k={k} n={n}"
                );
                if quant::strips::has_strips(ty) {
                    let strips = quant::strips::to_strips(ty, &w, n, k);
                    assert_eq!(
                        run(Kernel::Amx, true, &strips),
                        run(Kernel::Avx512Vnni, true, &strips),
                        "{ty} strip tiles m={m} k={k} n={n}"
                    );
                    assert_eq!(
                        run(Kernel::AmxPanels, true, &strips),
                        panels,
                        "{ty} panel tiles, strips, m={m} k={k} n={n}"
                    );
                }
            }
        }
    }

    #[test]
    fn the_kernel_variable_caps_the_kernel_and_never_raises_it() {
        let best = Kernel::best();
        assert_eq!(Kernel::capped(best, None), Ok(best));
        assert_eq!(Kernel::capped(best, Some(" ")), Ok(best));
        assert_eq!(Kernel::capped(best, Some("portable")), Ok(Kernel::Portable));
        assert_eq!(
            Kernel::capped(Kernel::Portable, Some("portable")),
            Ok(Kernel::Portable)
        );
        assert_eq!(Kernel::capped(best, Some("sse")), Err("sse".to_string()));
        #[cfg(target_arch = "x86_64")]
        {
            assert_eq!(
                Kernel::capped(Kernel::Avx512Vnni, Some("avx2")),
                Ok(Kernel::Avx2)
            );
            assert_eq!(
                Kernel::capped(Kernel::Portable, Some("avx512-vnni")),
                Ok(Kernel::Portable)
            );
            assert_eq!(
                Kernel::capped(Kernel::Avx2, Some("avx512-vnni")),
                Ok(Kernel::Avx2)
            );
            // The strip tiles are the default where the CPU and kernel have tiles; the panel
            // tiles are asked for; neither is chosen above what the CPU runs.
            let tiles = super::super::quant_tiles::AmxInt8::detect().is_some();
            assert_eq!(
                Kernel::best() == Kernel::Amx,
                tiles && matches!(best, Kernel::Avx512Vnni | Kernel::Amx)
            );
            assert_eq!(Kernel::capped(Kernel::Avx2, Some("amx")), Ok(Kernel::Avx2));
            assert_eq!(
                Kernel::capped(Kernel::Avx512Vnni, Some("amx")),
                Ok(Kernel::Avx512Vnni)
            );
            assert_eq!(
                Kernel::capped(Kernel::Avx512Vnni, Some("amx-panels")),
                Ok(Kernel::Avx512Vnni)
            );
            assert_eq!(Kernel::capped(Kernel::Amx, Some("amx")), Ok(Kernel::Amx));
            assert_eq!(
                Kernel::capped(Kernel::Amx, Some("amx-panels")),
                Ok(Kernel::AmxPanels)
            );
            assert_eq!(
                Kernel::capped(Kernel::Amx, Some("avx512-vnni")),
                Ok(Kernel::Avx512Vnni)
            );
        }
    }

    #[test]
    fn every_version_rounds_the_activations_to_the_same_bits() {
        // Blocks of ordinary values, halves a level apart, zeros, NaN, infinities, denormals and
        // values whose scale f16 cannot hold.
        let mut x = values(64 * 32, 11);
        for (b, block) in x.chunks_mut(32).enumerate() {
            match b % 8 {
                0 => block.fill(0.0),
                1 => block[3] = f32::NAN,
                2 => block[5] = f32::INFINITY,
                3 => block.iter_mut().for_each(|v| *v *= 1e-40),
                4 => block.iter_mut().for_each(|v| *v *= 1e8),
                5 => {
                    for (i, v) in block.iter_mut().enumerate() {
                        *v = (i as f32 - 16.0) + 0.5;
                    }
                }
                6 => block.iter_mut().for_each(|v| *v = -v.abs()),
                _ => {}
            }
        }
        let blocks = x.len() / 32;
        let mut portable = (
            vec![0i8; x.len()],
            vec![0f32; blocks],
            vec![0f32; 2 * blocks],
        );
        quantize_blocks_with(&mut portable.0, &mut portable.1, &mut portable.2, &x);
        let mut dispatched = (
            vec![0i8; x.len()],
            vec![0f32; blocks],
            vec![0f32; 2 * blocks],
        );
        quantize_blocks(&mut dispatched.0, &mut dispatched.1, &mut dispatched.2, &x);
        assert_eq!(portable.0, dispatched.0);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&portable.1), bits(&dispatched.1));
        assert_eq!(bits(&portable.2), bits(&dispatched.2));
    }

    #[test]
    fn the_fast_rounding_rounds_half_away_from_zero() {
        let mut specials = vec![
            0.0f32, -0.0, 0.5, -0.5, 1.5, 2.5, -2.5, 126.5, -127.5, 127.0,
        ];
        for whole in -128..128 {
            let half = whole as f32 + 0.5;
            specials.extend([half, half.next_up(), half.next_down()]);
        }
        specials.extend(values(100_000, 17).iter().map(|v| v * 40.0));
        specials.extend([300.0, -300.0, f32::INFINITY, f32::NEG_INFINITY]);
        for y in specials {
            assert_eq!(
                round_half_away(y) as f32,
                y.round().clamp(-128.0, 127.0),
                "{y:e}"
            );
        }
        assert_eq!(round_half_away(f32::NAN), 0);
    }

    #[test]
    fn rounding_the_activations_moves_them_by_at_most_half_a_step() {
        let x = values(4 * 32, 5);
        let a = quantize_activations(&x, 1, x.len());
        for (b, (xb, qb)) in x.chunks(32).zip(a.q.chunks(32)).enumerate() {
            let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            // llama.cpp's Q8_0 block: the scale stored in f16, the levels from the exact scale.
            let d = amax / 127.0;
            assert_eq!(a.d[b], half::f16::from_f32(d).to_f32());
            assert_eq!(a.d[b], stored_scale(d));
            for (&v, &q) in xb.iter().zip(qb) {
                assert_eq!(q, (v * (1.0 / d)).round() as i8);
                assert!(
                    (f64::from(v) - f64::from(d) * f64::from(q)).abs()
                        <= f64::from(d) * 0.5 * (1.0 + 1e-6)
                );
            }
        }
        // Scales f16 cannot hold stay f32: no infinite products from huge activations.
        for d in [1e6f32, 3e-6, 1e-30] {
            assert_eq!(stored_scale(d), d);
        }
        assert_eq!(stored_scale(0.0), 0.0);
    }
}
