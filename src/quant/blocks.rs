//! The 32-value formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): one block codes 32 values against an `f16`
//! scale (and, for the `_1` formats, an `f16` minimum). Each function follows gguf-py's numpy code
//! operation by operation in `f32` (Rust never fuses a multiply and an add unasked), so a value
//! rounds exactly as the reference rounds it.
//!
//! Layouts (bytes): Q4_0 `d[2] qs[16]`, Q4_1 `d[2] m[2] qs[16]`, Q5_0 `d[2] qh[4] qs[16]`, Q5_1
//! `d[2] m[2] qh[4] qs[16]`, Q8_0 `d[2] qs[32]`. In `qs`, byte `j` holds value `j` in its low nibble
//! and value `j + 16` in its high one; `qh` (a little-endian `u32`) holds the fifth bit of value
//! `j` at bit `j`.

/// The `f16` at `block[at..at + 2]`, widened.
pub(super) fn f16_at(block: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([block[at], block[at + 1]]).to_f32()
}

fn put_f16(block: &mut [u8], at: usize, x: f32) {
    block[at..at + 2].copy_from_slice(&half::f16::from_f32(x).to_le_bytes());
}

/// `x` rounded to bfloat16 as ggml's `ggml_compute_fp32_to_bf16`: a NaN made quiet, otherwise
/// round to nearest, ties to even.
pub(super) fn bf16_bits(x: f32) -> u16 {
    let n = x.to_bits();
    if n & 0x7fff_ffff > 0x7f80_0000 {
        return ((n & 0xffff_0000) >> 16) as u16 | 64;
    }
    ((u64::from(n) + u64::from(0x7fff + ((n >> 16) & 1))) >> 16) as u16
}

/// The value of largest magnitude, the first such one (numpy's `argmax` of `abs`).
fn signed_absmax(x: &[f32]) -> f32 {
    let mut best = x[0];
    for &v in &x[1..] {
        if v.abs() > best.abs() {
            best = v;
        }
    }
    best
}

/// `1 / d`, or 0 for `d = 0` (an all-zero block).
fn inverse(d: f32) -> f32 {
    if d == 0.0 { 0.0 } else { 1.0 / d }
}

/// numpy's `astype(np.uint8)` of a truncated value in range, then `clip(0, max)`.
fn level(t: f32, max: u8) -> u8 {
    (t as u8).min(max)
}

pub(super) fn quantize_q8_0(x: &[f32], block: &mut [u8]) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = inverse(d);
    put_f16(block, 0, d);
    for (q, &v) in block[2..].iter_mut().zip(x) {
        // gguf-py's np_roundf: half away from zero, which is `f32::round`.
        *q = ((v * id).round() as i8) as u8;
    }
}

pub(super) fn dequantize_q8_0(block: &[u8], out: &mut [f32]) {
    let d = f16_at(block, 0);
    for (o, &q) in out.iter_mut().zip(&block[2..34]) {
        *o = f32::from(q as i8) * d;
    }
}

pub(super) fn quantize_q4_0(x: &[f32], block: &mut [u8]) {
    let d = signed_absmax(x) / -8.0;
    let id = inverse(d);
    put_f16(block, 0, d);
    let q = |v: f32| level((v * id + 8.5).trunc(), 15);
    for j in 0..16 {
        block[2 + j] = q(x[j]) | (q(x[j + 16]) << 4);
    }
}

pub(super) fn dequantize_q4_0(block: &[u8], out: &mut [f32]) {
    let d = f16_at(block, 0);
    for j in 0..16 {
        let b = block[2 + j];
        out[j] = d * f32::from((b & 0x0f) as i8 - 8);
        out[j + 16] = d * f32::from((b >> 4) as i8 - 8);
    }
}

/// The block's minimum and maximum (numpy's `min`/`max`).
fn min_max(x: &[f32]) -> (f32, f32) {
    x[1..]
        .iter()
        .fold((x[0], x[0]), |(lo, hi), &v| (lo.min(v), hi.max(v)))
}

pub(super) fn quantize_q4_1(x: &[f32], block: &mut [u8]) {
    let (min, max) = min_max(x);
    let d = (max - min) / 15.0;
    let id = inverse(d);
    put_f16(block, 0, d);
    put_f16(block, 2, min);
    let q = |v: f32| level(((v - min) * id + 0.5).trunc(), 15);
    for j in 0..16 {
        block[4 + j] = q(x[j]) | (q(x[j + 16]) << 4);
    }
}

pub(super) fn dequantize_q4_1(block: &[u8], out: &mut [f32]) {
    let (d, m) = (f16_at(block, 0), f16_at(block, 2));
    for j in 0..16 {
        let b = block[4 + j];
        out[j] = d * f32::from(b & 0x0f) + m;
        out[j + 16] = d * f32::from(b >> 4) + m;
    }
}

/// Packs 32 five-bit levels: low nibbles into `qs`, fifth bits into the `u32` `qh`.
pub(super) fn pack5(q: &[u8; 32], qh: &mut [u8], qs: &mut [u8]) {
    let mut high = 0u32;
    for (j, &v) in q.iter().enumerate() {
        high |= u32::from(v >> 4) << j;
    }
    qh.copy_from_slice(&high.to_le_bytes());
    for j in 0..16 {
        qs[j] = (q[j] & 0x0f) | (q[j + 16] << 4);
    }
}

/// The 32 five-bit levels of `qh` and `qs`.
pub(super) fn unpack5(qh: &[u8], qs: &[u8]) -> [u8; 32] {
    let high = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    std::array::from_fn(|j| {
        let low = if j < 16 {
            qs[j] & 0x0f
        } else {
            qs[j - 16] >> 4
        };
        low | ((((high >> j) & 1) as u8) << 4)
    })
}

pub(super) fn quantize_q5_0(x: &[f32], block: &mut [u8]) {
    let d = signed_absmax(x) / -16.0;
    let id = inverse(d);
    put_f16(block, 0, d);
    let q: [u8; 32] = std::array::from_fn(|j| level((x[j] * id + 16.5).trunc(), 31));
    let (qh, qs) = block[2..].split_at_mut(4);
    pack5(&q, qh, qs);
}

pub(super) fn dequantize_q5_0(block: &[u8], out: &mut [f32]) {
    let d = f16_at(block, 0);
    for (o, q) in out.iter_mut().zip(unpack5(&block[2..6], &block[6..22])) {
        *o = d * f32::from(q as i8 - 16);
    }
}

pub(super) fn quantize_q5_1(x: &[f32], block: &mut [u8]) {
    let (min, max) = min_max(x);
    let d = (max - min) / 31.0;
    let id = inverse(d);
    put_f16(block, 0, d);
    put_f16(block, 2, min);
    let q: [u8; 32] = std::array::from_fn(|j| level(((x[j] - min) * id + 0.5).trunc(), 31));
    let (qh, qs) = block[4..].split_at_mut(4);
    pack5(&q, qh, qs);
}

pub(super) fn dequantize_q5_1(block: &[u8], out: &mut [f32]) {
    let (d, m) = (f16_at(block, 0), f16_at(block, 2));
    for (o, q) in out.iter_mut().zip(unpack5(&block[4..8], &block[8..24])) {
        *o = d * f32::from(q) + m;
    }
}
