//! The fused attention's small `f32` products whose right operand has contiguous rows, on AVX-512F:
//! `p v` in the forward pass, `dv += pᵀ dout`, `dk += dsᵀ q` and `dq += ds k` in the backward pass.
//!
//! These are tiles of at most 64 × 256 by 256 × 64, small enough that `gemm`'s packing of both
//! operands for every tile shows (12 % of the fused `f32` forward's samples on the Xeon with AMX).
//! Here nothing is packed. `c` is computed in blocks of [`ROWS`] rows by
//! [`VECTORS`] × 16 columns, whose 24 accumulators stay in registers; each step along `k` loads one
//! row of `b` (four vectors, masked at the right edge) and broadcasts one element of each `a` row,
//! read through any strides (so `pᵀ` needs no copy).
//!
//! Each element of `c` is the sum of its `k` products in `k` order, one fused multiply-add at a time,
//! then scaled once; the result does not depend on the block an element falls in. Only `f32` with
//! `b`'s column stride 1 comes here ([`super::matmul::gemm_tile`] dispatches); other products go to
//! `gemm`. Machines without AVX-512F (and valgrind, whose CPU model lacks it) use `gemm` for all.

use std::arch::x86_64::{
    __mmask16, _mm512_add_ps, _mm512_fmadd_ps, _mm512_mask_storeu_ps, _mm512_maskz_loadu_ps,
    _mm512_mul_ps, _mm512_set1_ps, _mm512_setzero_ps,
};

use super::matmul::{Strided, tile_fits};

/// Rows of `c` per block.
const ROWS: usize = 6;
/// 16-lane vectors per block row: 64 columns, a head's width.
const VECTORS: usize = 4;
const LANES: usize = 16;
/// Columns of `c` per block.
const COLUMNS: usize = VECTORS * LANES;

/// Proof that this CPU has AVX-512F: made only by [`Avx512::detect`].
#[derive(Clone, Copy, Debug)]
pub(super) struct Avx512(());

impl Avx512 {
    /// `Some` when the CPU runs AVX-512F (`std` caches the detection).
    pub(super) fn detect() -> Option<Avx512> {
        std::is_x86_feature_detected!("avx512f").then_some(Avx512(()))
    }
}

/// `c = scale · a b` (`c += scale · a b` when `accumulate`) for `a` `m × k` (any strides), `b`
/// `k × n` with column stride 1, and the `m × n` block `c` whose rows are `ldc` apart.
///
/// # Panics
/// When `b`'s column stride is not 1, or an operand's last element lies outside its slice (a
/// caller bug: the fused kernels pass in-range tiles).
#[allow(clippy::too_many_arguments)]
pub(super) fn product(
    unit: Avx512,
    (m, n, k): (usize, usize, usize),
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
    a: Strided<'_, f32>,
    b: Strided<'_, f32>,
    scale: f32,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(
        b.cols == 1 && k >= 1 && tile_fits((m, n, k), a, b, c.len(), ldc),
        "ndscope bug: a tile product's operand outside its slice"
    );
    for i0 in (0..m).step_by(ROWS) {
        let rows = ROWS.min(m - i0);
        for j0 in (0..n).step_by(COLUMNS) {
            let cols = COLUMNS.min(n - j0);
            let block = Block {
                k,
                a: &a.data[i0 * a.rows..],
                a_strides: (a.rows, a.cols),
                b: &b.data[j0..],
                ldb: b.rows,
                cols,
                accumulate,
                scale,
            };
            let c = &mut c[i0 * ldc + j0..];
            // SAFETY: `unit` proves AVX-512F. `block` reads `a` at `i * a.rows + p * a.cols` for
            // `i < rows`, `p < k`, and `b` at `p * b.rows + j` for `j < cols` (masked lanes are not
            // read): inside the slices by the assertion, as `i0 + i < m` and `j0 + j < n`. It writes
            // `c` at `i * ldc + j` for the same `i` and `j`, inside `c` (the assertion).
            unsafe {
                match rows {
                    6 => block.run::<6>(unit, c, ldc),
                    5 => block.run::<5>(unit, c, ldc),
                    4 => block.run::<4>(unit, c, ldc),
                    3 => block.run::<3>(unit, c, ldc),
                    2 => block.run::<2>(unit, c, ldc),
                    _ => block.run::<1>(unit, c, ldc),
                }
            }
        }
    }
}

/// One block of `c`: up to [`ROWS`] rows of `a` (starting at `a[0]`) times `cols <= COLUMNS`
/// columns of `b` (starting at `b[0]`).
struct Block<'a> {
    k: usize,
    a: &'a [f32],
    /// Distance between rows, and between columns, of `a`.
    a_strides: (usize, usize),
    b: &'a [f32],
    ldb: usize,
    cols: usize,
    accumulate: bool,
    scale: f32,
}

impl Block<'_> {
    /// # Safety
    /// AVX-512F is available (`_unit`); `a` holds `(R - 1) * a_strides.0 + (k - 1) * a_strides.1 + 1`
    /// elements, `b` `(k - 1) * ldb + cols`, and `c` `(R - 1) * ldc + cols`.
    #[target_feature(enable = "avx512f")]
    unsafe fn run<const R: usize>(&self, _unit: Avx512, c: &mut [f32], ldc: usize) {
        // Lanes of each vector that lie inside the block's columns. (Loops, not closures: a
        // closure would not be compiled for AVX-512.)
        let mut masks: [__mmask16; VECTORS] = [0; VECTORS];
        for (v, mask) in masks.iter_mut().enumerate() {
            let inside = self.cols.saturating_sub(v * LANES).min(LANES);
            *mask = ((1u32 << inside) - 1) as __mmask16;
        }
        let (a_rows, a_cols) = self.a_strides;
        let (a, b) = (self.a.as_ptr(), self.b.as_ptr());
        let mut acc = [[_mm512_setzero_ps(); VECTORS]; R];
        let mut bv = [_mm512_setzero_ps(); VECTORS];
        for p in 0..self.k {
            // `wrapping_add`: a vector wholly past the block's columns is addressed but masked off.
            let row = b.wrapping_add(p * self.ldb);
            for (v, lanes) in bv.iter_mut().enumerate() {
                // SAFETY: the lanes `masks` keep lie inside `b` (this function's contract); masked
                // lanes are not read.
                *lanes = unsafe { _mm512_maskz_loadu_ps(masks[v], row.wrapping_add(v * LANES)) };
            }
            for (i, acc) in acc.iter_mut().enumerate() {
                // SAFETY: `i < R` and `p < k`: inside `a` (this function's contract).
                let x = _mm512_set1_ps(unsafe { *a.add(i * a_rows + p * a_cols) });
                for (sum, &lanes) in acc.iter_mut().zip(&bv) {
                    *sum = _mm512_fmadd_ps(x, lanes, *sum);
                }
            }
        }
        let scale = _mm512_set1_ps(self.scale);
        for (i, acc) in acc.iter().enumerate() {
            let out = c.as_mut_ptr().wrapping_add(i * ldc);
            for (v, &sum) in acc.iter().enumerate() {
                let at = out.wrapping_add(v * LANES);
                let mut x = _mm512_mul_ps(sum, scale);
                if self.accumulate {
                    // SAFETY: the kept lanes lie inside `c` (this function's contract).
                    x = _mm512_add_ps(x, unsafe { _mm512_maskz_loadu_ps(masks[v], at) });
                }
                // SAFETY: as above; `c` is borrowed mutably, so no one else sees the write.
                unsafe { _mm512_mask_storeu_ps(at, masks[v], x) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Products of every block shape (full and partial rows and columns, several column blocks,
    /// `a` read transposed) against `f64` sums, overwriting and accumulating.
    #[test]
    fn products_match_f64_sums() {
        let Some(unit) = Avx512::detect() else {
            eprintln!("tile product: this CPU has no AVX-512F; not run");
            return;
        };
        let value = |i: usize| ((i * 7919) % 97) as f32 / 16.0 - 3.0;
        for (m, n, k) in [
            (1, 1, 1),
            (6, 64, 5),
            (7, 65, 3),
            (13, 130, 17),
            (64, 64, 256),
            (5, 3, 1),
        ] {
            for transposed in [false, true] {
                for accumulate in [false, true] {
                    let a_data: Vec<f32> = (0..m * k).map(value).collect();
                    let a = if transposed {
                        Strided {
                            data: &a_data,
                            rows: 1,
                            cols: m,
                        }
                    } else {
                        Strided {
                            data: &a_data,
                            rows: k,
                            cols: 1,
                        }
                    };
                    let ldb = n + 3;
                    let b_data: Vec<f32> = (0..k * ldb).map(|i| value(i + 11)).collect();
                    let b = Strided {
                        data: &b_data,
                        rows: ldb,
                        cols: 1,
                    };
                    let ldc = n + 2;
                    let before: Vec<f32> = (0..m * ldc).map(|i| value(i + 5)).collect();
                    let mut c = before.clone();
                    product(unit, (m, n, k), &mut c, ldc, accumulate, a, b, 0.5);
                    for i in 0..m {
                        for j in 0..ldc {
                            let got = c[i * ldc + j];
                            if j >= n {
                                assert_eq!(
                                    got,
                                    before[i * ldc + j],
                                    "column {j} past n was written"
                                );
                                continue;
                            }
                            let sum: f64 = (0..k)
                                .map(|p| {
                                    f64::from(a.data[i * a.rows + p * a.cols])
                                        * f64::from(b.data[p * ldb + j])
                                })
                                .sum();
                            let keep = if accumulate {
                                f64::from(before[i * ldc + j])
                            } else {
                                0.0
                            };
                            let want = 0.5 * sum + keep;
                            assert!(
                                (f64::from(got) - want).abs() <= 1e-5 * (1.0 + want.abs()),
                                "{m}x{n}x{k} transposed {transposed} accumulate {accumulate}: \
                                 c[{i}][{j}] = {got}, want {want}"
                            );
                        }
                    }
                }
            }
        }
    }
}
