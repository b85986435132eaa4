//! The K formats' quantizers: ggml's reference `quantize_row_q4_K_ref`, `quantize_row_q5_K_ref`
//! (their `make_qkx2_quants` search for each sub-block's scale and minimum) and
//! `quantize_row_q6_K_ref` (`make_qx_quants`' search for each 16 values' signed scale), operation by
//! operation in `f32`. gguf-py has no K quantizer, so the reference is the C functions compiled with
//! ISO C's float semantics (`-ffp-contract=off`: no multiply and add fused): `tests/quant.rs` holds
//! the results to their output bit for bit (`tests/fixtures/make_k_quants.py`; llama.cpp's own
//! `-march=native` build wrote the same Q4_K bytes for the fixture's blocks).
//!
//! Q4_K and Q5_K, per block of 256: each sub-block of 32 is fitted as `scale · l + min` (`l` in
//! 0..=15, or 0..=31; `min` ≤ 0) by a weighted least-squares search over trial scales (weights
//! `√(mean x²) + |x|`); the 8 scales and minimums are then quantized to 6 bits against the block's
//! `d = max scale / 63` and `dmin = max min / 63`, and the levels recomputed against the rounded
//! ones. Q6_K, per block of 256: each 16 values get a signed scale (levels −32..=31, weights `x²`,
//! 18 trial scales around `−32 / max`), the 16 scales are quantized to `i8` against
//! `d = −max scale / 128`, and the levels recomputed.

use super::QK_K;
use super::blocks::f16_at;
use super::kquants::scale_min_k4;

/// ggml's `nearest_int`: round to nearest, ties to even, by adding 1.5 · 2^23 (for |x| ≤ 2^22,
/// which a level search never exceeds; larger values give ggml's result for them too).
fn nearest_int(x: f32) -> i32 {
    let bits = (x + 12_582_912.0f32).to_bits() as i32;
    (bits & 0x007f_ffff) - 0x0040_0000
}

/// ggml's `MAX(0, MIN(nmax, l))` as a level.
fn clamp_level(l: i32, nmax: i32) -> u8 {
    l.min(nmax).max(0) as u8
}

/// `make_qkx2_quants(32, nmax, x, weights, L, &min, Laux, rmin, 0.1, nstep, false)`: the levels `l`
/// and the returned `(scale, −min)` of one sub-block. Q4_K searches with `(15, −1, 20)`, Q5_K with
/// `(31, −0.5, 15)`.
fn fit_sub_block(
    x: &[f32; 32],
    weights: &[f32; 32],
    l: &mut [u8],
    (nmax, rmin, nstep): (i32, f32, i32),
) -> (f32, f32) {
    let rdelta = 0.1f32;
    let (mut min, mut max) = (x[0], x[0]);
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..32 {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        let w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l.fill(0);
        return (0.0, -min);
    }
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0.0f32;
    for i in 0..32 {
        l[i] = clamp_level(nearest_int(iscale * (x[i] - min)), nmax);
        let diff = scale * f32::from(l[i]) + min - x[i];
        best_error += weights[i] * (diff * diff);
    }
    let mut aux = [0u8; 32];
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0.0f32, 0.0f32, 0.0f32);
        for i in 0..32 {
            let level = clamp_level(nearest_int(iscale * (x[i] - min)), nmax);
            aux[i] = level;
            let (w, lf) = (weights[i], f32::from(level));
            sum_l += w * lf;
            sum_l2 += w * lf * lf;
            sum_xl += w * lf * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0.0f32;
            for i in 0..32 {
                let diff = this_scale * f32::from(aux[i]) + this_min - x[i];
                cur_error += weights[i] * (diff * diff);
            }
            if cur_error < best_error {
                l.copy_from_slice(&aux);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// Quantizes 256 values into one Q4_K block (`d[2] dmin[2] scales[12] qs[128]`).
pub(super) fn quantize_q4_k(x: &[f32], block: &mut [u8]) {
    quantize_k4::<false>(x, block);
}

/// Quantizes 256 values into one Q5_K block (`d[2] dmin[2] scales[12] qh[32] qs[128]`).
pub(super) fn quantize_q5_k(x: &[f32], block: &mut [u8]) {
    quantize_k4::<true>(x, block);
}

/// Q4_K's quantizer, or with `FIVE` Q5_K's: the same search and scales, 5-bit levels whose fifth
/// bits go to `qh`.
fn quantize_k4<const FIVE: bool>(x: &[f32], block: &mut [u8]) {
    let search = if FIVE { (31, -0.5, 15) } else { (15, -1.0, 20) };
    let nmax = search.0;
    let mut levels = [0u8; QK_K];
    let (mut scales, mut mins) = ([0.0f32; 8], [0.0f32; 8]);
    let (mut max_scale, mut max_min) = (0.0f32, 0.0f32);
    for j in 0..8 {
        let sub: &[f32; 32] = x[32 * j..32 * j + 32].try_into().expect("32 values");
        let mut sum_x2 = 0.0f32;
        for &v in sub {
            sum_x2 += v * v;
        }
        let av_x = (sum_x2 / 32.0).sqrt();
        let weights: [f32; 32] = std::array::from_fn(|l| av_x + sub[l].abs());
        (scales[j], mins[j]) =
            fit_sub_block(sub, &weights, &mut levels[32 * j..32 * j + 32], search);
        if scales[j] > max_scale {
            max_scale = scales[j];
        }
        if mins[j] > max_min {
            max_min = mins[j];
        }
    }
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let packed = &mut block[4..16];
    packed.fill(0);
    for j in 0..8 {
        // ggml stores nearest_int's result in a uint8_t before taking the minimum with 63.
        let ls = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        let lm = (nearest_int(inv_min * mins[j]) as u8).min(63);
        if j < 4 {
            packed[j] = ls;
            packed[j + 4] = lm;
        } else {
            packed[j + 4] = (ls & 0xf) | ((lm & 0xf) << 4);
            packed[j - 4] |= (ls >> 4) << 6;
            packed[j] |= (lm >> 4) << 6;
        }
    }
    block[0..2].copy_from_slice(&half::f16::from_f32(max_scale / 63.0).to_le_bytes());
    block[2..4].copy_from_slice(&half::f16::from_f32(max_min / 63.0).to_le_bytes());
    let (d, dmin) = (f16_at(block, 0), f16_at(block, 2));
    for j in 0..8 {
        let (sc, m) = scale_min_k4(&block[4..16], j);
        let dl = d * f32::from(sc);
        if dl == 0.0 {
            continue; // the sub-block keeps the levels of its fit, as ggml's does
        }
        let dm = dmin * f32::from(m);
        for i in 0..32 {
            levels[32 * j + i] = clamp_level(nearest_int((x[32 * j + i] + dm) / dl), nmax);
        }
    }
    // Levels 64t + l and 64t + 32 + l share byte 32t + l of `qs` (low and high nibble); with Q5_K
    // their fifth bits are bits 2t and 2t + 1 of `qh[l]`.
    let (qh, qs) = block[16..].split_at_mut(if FIVE { 32 } else { 0 });
    qh.fill(0);
    for (t, (chunk, pair)) in qs
        .chunks_exact_mut(32)
        .zip(levels.chunks_exact(64))
        .enumerate()
    {
        for (l, q) in chunk.iter_mut().enumerate() {
            let (low, high) = (pair[l], pair[l + 32]);
            *q = (low & 0x0f) | ((high & 0x0f) << 4);
            if FIVE {
                qh[l] |= ((low >> 4) << (2 * t)) | ((high >> 4) << (2 * t + 1));
            }
        }
    }
}

/// ggml's `GROUP_MAX_EPS`: a group whose largest magnitude is below it quantizes to zeros.
const GROUP_MAX_EPS: f32 = 1e-15;

/// `make_qx_quants(16, 32, x, L, 1, NULL)`: the levels `l` (stored: the level plus 32) and the
/// signed scale of 16 values, fitted with weights `x²` over the trial scales `−(32 + 0.1 · is) /
/// max` (`max` the value of largest magnitude, `is` in −9..=9).
fn fit_signed(x: &[f32; 16], l: &mut [u8]) -> f32 {
    const NMAX: i32 = 32;
    let (mut max, mut amax) = (0.0f32, 0.0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        l.fill(0);
        return 0.0;
    }
    let level = |iscale: f32, v: f32| nearest_int(iscale * v).clamp(-NMAX, NMAX - 1);
    // ggml's sums: `w·x·l` and `w·l·l`, each product rounded in that order.
    let sums = |iscale: f32| {
        let (mut sum_lx, mut sum_l2) = (0.0f32, 0.0f32);
        for &v in x {
            let (w, q) = (v * v, level(iscale, v) as f32);
            sum_lx += w * v * q;
            sum_l2 += w * q * q;
        }
        (sum_lx, sum_l2)
    };
    let iscale = -(NMAX as f32) / max;
    for (l, &v) in l.iter_mut().zip(x) {
        *l = (level(iscale, v) + NMAX) as u8;
    }
    let (sum_lx, sum_l2) = sums(iscale);
    let mut scale = if sum_l2 != 0.0 { sum_lx / sum_l2 } else { 0.0 };
    let mut best = scale * sum_lx;
    for is in (-9..=9).filter(|&is| is != 0) {
        let iscale = -(NMAX as f32 + 0.1f32 * is as f32) / max;
        let (sum_lx, sum_l2) = sums(iscale);
        if sum_l2 > 0.0 && sum_lx * sum_lx > best * sum_l2 {
            for (l, &v) in l.iter_mut().zip(x) {
                *l = (level(iscale, v) + NMAX) as u8;
            }
            scale = sum_lx / sum_l2;
            best = scale * sum_lx;
        }
    }
    scale
}

/// Quantizes 256 values into one Q6_K block (`ql[128] qh[64] scales[16] d[2]`, the scales `i8`).
pub(super) fn quantize_q6_k(x: &[f32], block: &mut [u8]) {
    let mut levels = [0u8; QK_K];
    let mut scales = [0.0f32; QK_K / 16];
    let (mut max_scale, mut max_abs_scale) = (0.0f32, 0.0f32);
    for (ib, scale) in scales.iter_mut().enumerate() {
        let sub: &[f32; 16] = x[16 * ib..16 * ib + 16].try_into().expect("16 values");
        *scale = fit_signed(sub, &mut levels[16 * ib..16 * ib + 16]);
        if scale.abs() > max_abs_scale {
            max_abs_scale = scale.abs();
            max_scale = *scale;
        }
    }
    block.fill(0);
    if max_abs_scale < GROUP_MAX_EPS {
        return; // ggml writes a block of zeros (d = 0)
    }
    let iscale = -128.0f32 / max_scale;
    block[208..210].copy_from_slice(&half::f16::from_f32(1.0 / iscale).to_le_bytes());
    for (ib, &scale) in scales.iter().enumerate() {
        // ggml stores `MIN(127, nearest_int(·))` in an `int8_t` (the smallest is −128 exactly).
        block[192 + ib] = nearest_int(iscale * scale).min(127) as i8 as u8;
    }
    let d = f16_at(block, 208);
    for j in 0..QK_K / 16 {
        let dl = d * f32::from(block[192 + j] as i8);
        if dl == 0.0 {
            continue; // the 16 values keep the levels of their fit, as ggml's do
        }
        for i in 0..16 {
            let l = nearest_int(x[16 * j + i] / dl).clamp(-32, 31);
            levels[16 * j + i] = (l + 32) as u8;
        }
    }
    // Per 128 values (half h): value 32k + l (k in 0..4) has its low 4 bits in nibble k / 2 of
    // `ql[64h + 32 (k % 2) + l]` and its high 2 bits at bit 2k of `qh[32h + l]`.
    let (ql, rest) = block.split_at_mut(128);
    let qh = &mut rest[..64];
    for (h, half) in levels.chunks_exact(128).enumerate() {
        for l in 0..32 {
            let q: [u8; 4] = std::array::from_fn(|k| half[32 * k + l]);
            ql[64 * h + l] = (q[0] & 0x0f) | ((q[2] & 0x0f) << 4);
            ql[64 * h + 32 + l] = (q[1] & 0x0f) | ((q[3] & 0x0f) << 4);
            qh[32 * h + l] =
                (q[0] >> 4) | ((q[1] >> 4) << 2) | ((q[2] >> 4) << 4) | ((q[3] >> 4) << 6);
        }
    }
}
