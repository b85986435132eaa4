//! Q4_K's quantizer: ggml's reference `quantize_row_q4_K_ref` (its `make_qkx2_quants` search for
//! each sub-block's scale and minimum), operation by operation in `f32`. gguf-py has no K
//! quantizer, so the reference is the C function compiled with ISO C's float semantics
//! (`-ffp-contract=off`: no multiply and add fused): `tests/quant.rs` holds the result to its output
//! bit for bit (`tests/fixtures/make_q4_k.py`; llama.cpp's own `-march=native` build wrote the same
//! bytes for the fixture's 41 blocks).
//!
//! Per block of 256: each sub-block of 32 is fitted as `scale · l + min` (`l` in 0..=15, `min` ≤ 0)
//! by a weighted least-squares search over 21 trial scales (weights `√(mean x²) + |x|`); the 8
//! scales and minimums are then quantized to 6 bits against the block's `d = max scale / 63` and
//! `dmin = max min / 63`, and the levels recomputed against the rounded ones.

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

/// `make_qkx2_quants(32, 15, x, weights, L, &min, Laux, -1, 0.1, 20, false)`: the levels `l` and the
/// returned `(scale, −min)` of one sub-block.
fn fit_sub_block(x: &[f32; 32], weights: &[f32; 32], l: &mut [u8]) -> (f32, f32) {
    const NMAX: i32 = 15;
    let (rmin, rdelta, nstep) = (-1.0f32, 0.1f32, 20);
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
    let mut iscale = NMAX as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0.0f32;
    for i in 0..32 {
        l[i] = clamp_level(nearest_int(iscale * (x[i] - min)), NMAX);
        let diff = scale * f32::from(l[i]) + min - x[i];
        best_error += weights[i] * (diff * diff);
    }
    let mut aux = [0u8; 32];
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + NMAX as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0.0f32, 0.0f32, 0.0f32);
        for i in 0..32 {
            let level = clamp_level(nearest_int(iscale * (x[i] - min)), NMAX);
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
        (scales[j], mins[j]) = fit_sub_block(sub, &weights, &mut levels[32 * j..32 * j + 32]);
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
            levels[32 * j + i] = clamp_level(nearest_int((x[32 * j + i] + dm) / dl), 15);
        }
    }
    let qs = &mut block[16..144];
    for (chunk, pair) in qs.chunks_exact_mut(32).zip(levels.chunks_exact(64)) {
        for (l, q) in chunk.iter_mut().enumerate() {
            *q = pair[l] | (pair[l + 32] << 4);
        }
    }
}
