//! Host matrix products through the `gemm` crate, which reads any strides (so transposed views need
//! no copy) and runs its own cache-blocked, SIMD kernels.

use gemm::Parallelism;

use crate::backend::{Dst, Src};
use crate::dtype::{DType, Element};
use crate::layout::{Layout, RowWalk, Shape, contiguous_strides};

/// Products with fewer multiply-adds than this run on one thread.
const PARALLEL_FLOPS: usize = 48 * 48 * 48;

pub(super) fn matmul(
    dtype: DType,
    a: Src,
    b: Src,
    batch: &[usize],
    mkn: (usize, usize, usize),
    out: Dst,
) {
    match dtype {
        DType::F32 => matmul_into::<f32>(a, b, batch, mkn, out.contiguous_host::<f32>()),
        DType::F64 => matmul_into::<f64>(a, b, batch, mkn, out.contiguous_host::<f64>()),
        DType::I64 => unreachable!("matmul refuses integer dtypes before computing"),
    }
}

/// `out[b] = a[b] @ b[b]` for every batch index.
fn matmul_into<T: Element>(
    a: Src,
    b: Src,
    batch: &[usize],
    (m, k, n): (usize, usize, usize),
    out: &mut [T],
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        out.fill(T::zero());
        return;
    }
    let (a_layout, b_layout) = (a.layout, b.layout);
    let (ar, br) = (a_layout.rank(), b_layout.rank());
    let batch_layout = |t: &Layout, r: usize| {
        let mut shape: Shape = t.shape()[..r - 2].iter().copied().collect();
        let mut strides: Shape = t.strides()[..r - 2].iter().copied().collect();
        // Broadcast the batch part alone.
        let lead = batch.len() - shape.len();
        for _ in 0..lead {
            shape.insert(0, 1);
            strides.insert(0, 0);
        }
        for i in 0..batch.len() {
            if shape[i] == 1 && batch[i] != 1 {
                strides[i] = 0;
            }
        }
        strides
    };
    let (sa, sb) = (batch_layout(a_layout, ar), batch_layout(b_layout, br));
    let so = contiguous_strides(batch)
        .iter()
        .map(|s| s * m * n)
        .collect::<Shape>();
    let walk = RowWalk::new(
        batch,
        [&sa, &sb, &so],
        [a_layout.offset(), b_layout.offset(), 0],
    );
    let [rsa, rsb, rso] = walk.row_strides();
    let (a_rs, a_cs) = (
        a_layout.strides()[ar - 2] as isize,
        a_layout.strides()[ar - 1] as isize,
    );
    let (b_rs, b_cs) = (
        b_layout.strides()[br - 2] as isize,
        b_layout.strides()[br - 1] as isize,
    );
    let parallelism = if m.saturating_mul(n).saturating_mul(k) >= PARALLEL_FLOPS {
        Parallelism::Rayon(0)
    } else {
        Parallelism::None
    };
    let (da, db) = (a.buf.host::<T>(), b.buf.host::<T>());
    let total: usize = batch.iter().product();
    walk.for_segments(0, total, |_, [oa, ob, oo], len| {
        for j in 0..len {
            let (ia, ib, io) = (oa + j * rsa, ob + j * rsb, oo + j * rso);
            debug_assert!(io + m * n <= out.len());
            // SAFETY: `a`'s layout keeps every element `ia + r*a_rs + c*a_cs` (r < m, c < k) inside its
            // block (layouts are checked against the block when created), likewise `b`; `out` is a
            // fresh contiguous block of `batch * m * n` elements, so rows `io..io + m*n` are in bounds
            // and it overlaps neither input. With `read_dst = false` the old contents are not read.
            unsafe {
                gemm::gemm(
                    m,
                    n,
                    k,
                    out.as_mut_ptr().add(io),
                    1,
                    n as isize,
                    false,
                    da.as_ptr().add(ia),
                    a_cs,
                    a_rs,
                    db.as_ptr().add(ib),
                    b_cs,
                    b_rs,
                    T::zero(),
                    T::one(),
                    false,
                    false,
                    false,
                    parallelism,
                );
            }
        }
    });
}
