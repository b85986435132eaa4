//! Helpers shared by the integration tests: plain f64 reference implementations that the tensor ops
//! are checked against (nested loops over multi-indices, written for clarity, not speed), and the
//! bytes of test files.
#![allow(dead_code)]

pub mod counting;
pub mod gpt;
pub mod reference;

/// Row-major strides of `shape`.
pub fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

/// Every multi-index of `shape` in row-major order.
pub fn indices(shape: &[usize]) -> Vec<Vec<usize>> {
    let n: usize = shape.iter().product();
    (0..n)
        .map(|mut flat| {
            let mut idx = vec![0; shape.len()];
            for d in (0..shape.len()).rev() {
                idx[d] = flat % shape[d];
                flat /= shape[d];
            }
            idx
        })
        .collect()
}

/// Value of `data` (row-major `shape`) at `idx`, which may have more leading axes (broadcasting) and
/// size-1 axes stretched.
pub fn at_broadcast(data: &[f64], shape: &[usize], idx: &[usize]) -> f64 {
    let lead = idx.len() - shape.len();
    let st = strides(shape);
    let mut off = 0;
    for d in 0..shape.len() {
        let i = if shape[d] == 1 { 0 } else { idx[lead + d] };
        off += i * st[d];
    }
    data[off]
}

pub fn broadcast_shape(a: &[usize], b: &[usize]) -> Vec<usize> {
    let r = a.len().max(b.len());
    (0..r)
        .map(|i| {
            let da = if i + a.len() >= r {
                a[i + a.len() - r]
            } else {
                1
            };
            let db = if i + b.len() >= r {
                b[i + b.len() - r]
            } else {
                1
            };
            da.max(db)
        })
        .collect()
}

pub fn binary(
    a: &[f64],
    sa: &[usize],
    b: &[f64],
    sb: &[usize],
    f: impl Fn(f64, f64) -> f64,
) -> Vec<f64> {
    let shape = broadcast_shape(sa, sb);
    indices(&shape)
        .iter()
        .map(|i| f(at_broadcast(a, sa, i), at_broadcast(b, sb, i)))
        .collect()
}

pub fn matmul(a: &[f64], b: &[f64], m: usize, k: usize, n: usize) -> Vec<f64> {
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            out[i * n + j] = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
        }
    }
    out
}

/// Reduces `axes` of row-major `data` with `f`, starting from `init`; keepdim shape.
pub fn reduce(
    data: &[f64],
    shape: &[usize],
    axes: &[usize],
    init: f64,
    f: impl Fn(f64, f64) -> f64,
) -> Vec<f64> {
    let kept: Vec<usize> = shape
        .iter()
        .enumerate()
        .map(|(d, &s)| if axes.contains(&d) { 1 } else { s })
        .collect();
    let ks = strides(&kept);
    let mut out = vec![init; kept.iter().product()];
    for (flat, idx) in indices(shape).iter().enumerate() {
        let o: usize = idx
            .iter()
            .enumerate()
            .map(|(d, &i)| if axes.contains(&d) { 0 } else { i * ks[d] })
            .sum();
        out[o] = f(out[o], data[flat]);
    }
    out
}

/// Deterministic test values in roughly [-2, 2], distinct enough to catch index mistakes.
pub fn values(n: usize, seed: u64) -> Vec<f64> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 33) as f64 / (1u64 << 31) as f64) * 4.0 - 2.0
        })
        .collect()
}

pub fn assert_close(got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "lengths differ");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let ok = (g.is_nan() && w.is_nan()) || (g - w).abs() <= tol * (1.0 + w.abs());
        assert!(
            ok,
            "element {i}: got {g}, want {w} (tolerance {tol})\n got: {got:?}\nwant: {want:?}"
        );
    }
}

/// The bytes of an IDX file (MNIST's format) of unsigned bytes with dimensions `dims`.
pub fn idx(dims: &[u32], data: &[u8]) -> Vec<u8> {
    let mut bytes = vec![0, 0, 0x08, dims.len() as u8];
    for d in dims {
        bytes.extend_from_slice(&d.to_be_bytes());
    }
    bytes.extend_from_slice(data);
    bytes
}

/// A small deterministic generator for test workloads (a linear congruential one: the numbers need
/// only vary, and come from the seed alone).
pub struct Lcg(pub u64);

impl Lcg {
    /// A whole number in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 33) % n as u64) as usize
    }
}
