//! The "K" formats (Q2_K … Q6_K): one block codes 256 values in sub-blocks of 16 or 32, each with
//! its own scale quantized against the block's `f16` scale `d` (and minimum against `dmin`).
//! Dequantization only, following gguf-py's numpy code operation by operation in `f32`: a
//! sub-block's scale is formed first (`d · sc`), then multiplies the level (`(d · sc) · q`), then
//! the minimum is subtracted (`− dmin · m`).
//!
//! Layouts (bytes, in order): Q2_K `scales[16] qs[64] d[2] dmin[2]`; Q3_K `hmask[32] qs[64]
//! scales[12] d[2]`; Q4_K `d[2] dmin[2] scales[12] qs[128]`; Q5_K `d[2] dmin[2] scales[12] qh[32]
//! qs[128]`; Q6_K `ql[128] qh[64] scales[16] d[2]`. Where each value's bits sit is written beside
//! each function.

use super::QK_K;
use super::blocks::f16_at;

/// Q2_K: 16 sub-blocks of 16. `scales[i]`: low nibble the scale, high nibble the minimum of
/// sub-block `i`. Value `v = a·128 + s·32 + j` (`a` < 2, `s` < 4, `j` < 32) has its two bits at
/// `qs[a·32 + j] >> 2s`.
pub(super) fn dequantize_q2_k(block: &[u8], out: &mut [f32]) {
    let (scales, qs) = (&block[..16], &block[16..80]);
    let (d, dmin) = (f16_at(block, 80), f16_at(block, 82));
    for (v, o) in out.iter_mut().enumerate().take(QK_K) {
        let (a, s, j) = (v / 128, (v / 32) % 4, v % 32);
        let q = (qs[a * 32 + j] >> (2 * s)) & 3;
        let sc = scales[v / 16];
        let dl = d * f32::from(sc & 0x0f);
        let ml = dmin * f32::from(sc >> 4);
        *o = dl * f32::from(q) - ml;
    }
}

/// Q3_K: 16 sub-blocks of 16 with 6-bit signed scales (`sc − 32`): the low 4 bits of scale `k`
/// are nibble `k / 8` of byte `k % 8`, the high 2 bits are bits `2·(k / 4)` of byte `8 + k % 4`.
/// Value `v` has its low two bits as Q2_K's, and `4` subtracted unless bit `v / 32` of
/// `hmask[v % 32]` is set.
pub(super) fn dequantize_q3_k(block: &[u8], out: &mut [f32]) {
    let (hmask, qs, packed) = (&block[..32], &block[32..96], &block[96..108]);
    let d = f16_at(block, 108);
    let scale = |k: usize| -> f32 {
        let low = (packed[k % 8] >> (4 * (k / 8))) & 0x0f;
        let high = (packed[8 + k % 4] >> (2 * (k / 4))) & 0x03;
        f32::from((low | (high << 4)) as i8 - 32)
    };
    for (v, o) in out.iter_mut().enumerate().take(QK_K) {
        let (a, s, j) = (v / 128, (v / 32) % 4, v % 32);
        let low = ((qs[a * 32 + j] >> (2 * s)) & 3) as i8;
        let high = ((hmask[j] >> (v / 32)) & 1) ^ 1;
        let q = low - ((high << 2) as i8);
        *o = (d * scale(v / 16)) * f32::from(q);
    }
}

/// The 6-bit scale and minimum of sub-block `i` (< 8) of Q4_K and Q5_K, from their 12 bytes: for
/// `i` < 4 the low 6 bits of bytes `i` and `4 + i`; above, a nibble of byte `8 + i − 4` with the
/// top two bits of bytes `i − 4` and `i`.
#[inline(always)]
pub(crate) fn scale_min_k4(scales: &[u8], i: usize) -> (u8, u8) {
    let (d, m, md) = (&scales[..4], &scales[4..8], &scales[8..12]);
    if i < 4 {
        (d[i] & 0x3f, m[i] & 0x3f)
    } else {
        let k = i - 4;
        (
            (md[k] & 0x0f) | ((d[k] >> 2) & 0x30),
            (md[k] >> 4) | ((m[k] >> 2) & 0x30),
        )
    }
}

/// All 8 of [`scale_min_k4`]'s pairs at once, with whole-word masks and shifts (the row kernels'
/// per-block decoding): the scales, then the minimums.
pub(crate) fn scales_mins_k4(packed: &[u8; 12]) -> ([u8; 8], [u8; 8]) {
    const LOW6: u32 = 0x3f3f_3f3f;
    const LOW4: u32 = 0x0f0f_0f0f;
    const LOW2: u32 = 0x0303_0303;
    let word = |i: usize| {
        u32::from_le_bytes([
            packed[4 * i],
            packed[4 * i + 1],
            packed[4 * i + 2],
            packed[4 * i + 3],
        ])
    };
    let (d, m, md) = (word(0), word(1), word(2));
    let scales_high = (md & LOW4) | (((d >> 6) & LOW2) << 4);
    let mins_high = ((md >> 4) & LOW4) | (((m >> 6) & LOW2) << 4);
    let join = |low: u32, high: u32| {
        let mut out = [0u8; 8];
        out[..4].copy_from_slice(&low.to_le_bytes());
        out[4..].copy_from_slice(&high.to_le_bytes());
        out
    };
    (join(d & LOW6, scales_high), join(m & LOW6, mins_high))
}

/// Q4_K: 8 sub-blocks of 32. Value `v` of sub-block `i = v / 32` is nibble `i % 2` of
/// `qs[(i / 2)·32 + v % 32]`.
pub(super) fn dequantize_q4_k(block: &[u8], out: &mut [f32]) {
    let (d, dmin) = (f16_at(block, 0), f16_at(block, 2));
    let (scales, qs) = (&block[4..16], &block[16..144]);
    for (i, out) in out.chunks_exact_mut(32).enumerate().take(8) {
        let (sc, m) = scale_min_k4(scales, i);
        let (dl, ml) = (d * f32::from(sc), dmin * f32::from(m));
        for (j, o) in out.iter_mut().enumerate() {
            let q = (qs[(i / 2) * 32 + j] >> (4 * (i % 2))) & 0x0f;
            *o = dl * f32::from(q) - ml;
        }
    }
}

/// Q5_K: Q4_K's levels with a fifth bit: bit `i` of `qh[v % 32]` for sub-block `i`.
pub(super) fn dequantize_q5_k(block: &[u8], out: &mut [f32]) {
    let (d, dmin) = (f16_at(block, 0), f16_at(block, 2));
    let (scales, qh, qs) = (&block[4..16], &block[16..48], &block[48..176]);
    for (i, out) in out.chunks_exact_mut(32).enumerate().take(8) {
        let (sc, m) = scale_min_k4(scales, i);
        let (dl, ml) = (d * f32::from(sc), dmin * f32::from(m));
        for (j, o) in out.iter_mut().enumerate() {
            let low = (qs[(i / 2) * 32 + j] >> (4 * (i % 2))) & 0x0f;
            let high = (qh[j] >> i) & 1;
            *o = dl * f32::from(low | (high << 4)) - ml;
        }
    }
}

/// Q6_K: 16 sub-blocks of 16 with `i8` scales. Value `v = a·128 + r·32 + j` (`a` < 2, `r` < 4,
/// `j` < 32) has its low 4 bits in nibble `r / 2` of `ql[a·64 + (r % 2)·32 + j]`, its high 2 bits
/// at `qh[a·32 + j] >> 2r`, and is offset by −32.
pub(super) fn dequantize_q6_k(block: &[u8], out: &mut [f32]) {
    let (ql, qh, scales) = (&block[..128], &block[128..192], &block[192..208]);
    let d = f16_at(block, 208);
    for (v, o) in out.iter_mut().enumerate().take(QK_K) {
        let (a, r, j) = (v / 128, (v / 32) % 4, v % 32);
        let low = (ql[a * 64 + (r % 2) * 32 + j] >> (4 * (r / 2))) & 0x0f;
        let high = (qh[a * 32 + j] >> (2 * r)) & 0x03;
        let q = (low | (high << 4)) as i8 - 32;
        *o = (d * f32::from(scales[v / 16] as i8)) * f32::from(q);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_scales_and_minimums_at_once_are_each_ones() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..10_000 {
            let mut packed = [0u8; 12];
            for b in &mut packed {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                *b = state as u8;
            }
            let (scales, mins) = scales_mins_k4(&packed);
            for i in 0..8 {
                assert_eq!(
                    (scales[i], mins[i]),
                    scale_min_k4(&packed, i),
                    "{packed:?} {i}"
                );
            }
        }
    }
}
