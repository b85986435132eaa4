//! Tensor operations. The host kernels live here; an op whose operands are on a GPU hands them to
//! the CUDA backend (`crate::cuda`) after the same checks. Every op returns `Result`: shape, dtype
//! and device mismatches, and allocations refused by a cap or budget, are errors, never panics.

pub(crate) mod copy;
mod elementwise;
pub(crate) mod fused;
mod index;
mod join;
mod matmul;
pub(crate) mod op_code;
mod reduce;
mod softmax;
mod view;

use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::layout::RowWalk;
use crate::tensor::Tensor;

/// Outputs with fewer elements than this are computed on the calling thread: below it, waking rayon's
/// workers costs more than the work (measured on the 2-core CI machine; see BENCHMARKS.md).
pub(crate) const PARALLEL_MIN: usize = 1 << 16;
/// Elements per parallel task.
pub(crate) const CHUNK: usize = 1 << 14;

/// Fills the contiguous `out` from a walk over the same elements: `f(out_piece, starts)` computes one
/// row piece, reading operand `k` from `starts[k]` with the walk's row strides. Large outputs are split
/// across rayon's threads.
pub(crate) fn fill_segments<T: Send, const N: usize>(
    walk: &RowWalk<N>,
    out: &mut [T],
    f: impl Fn(&mut [T], [usize; N]) + Sync,
) {
    if out.len() < PARALLEL_MIN {
        walk.for_segments(0, out.len(), |pos, starts, len| {
            f(&mut out[pos..pos + len], starts)
        });
        return;
    }
    out.par_chunks_mut(CHUNK)
        .enumerate()
        .for_each(|(i, chunk)| {
            let base = i * CHUNK;
            walk.for_segments(base, chunk.len(), |pos, starts, len| {
                f(&mut chunk[pos - base..pos - base + len], starts)
            });
        });
}

pub(crate) fn same_dtype(op: &'static str, a: &Tensor<'_>, b: &Tensor<'_>) -> Result<()> {
    if a.dtype() != b.dtype() {
        return Err(Error::DTypeMismatch {
            op,
            lhs: a.dtype(),
            rhs: b.dtype(),
        });
    }
    Ok(())
}

/// Refuses operands in GPU memory, for ops that only have a host implementation.
pub(crate) fn host_only(op: &'static str, tensors: &[&Tensor<'_>]) -> Result<()> {
    match tensors.iter().map(|t| t.device()).find(|d| d.is_cuda()) {
        None => Ok(()),
        Some(device) => Err(Error::UnsupportedOnDevice {
            op,
            device: device.to_string(),
        }),
    }
}

pub(crate) fn same_device(op: &'static str, a: &Tensor<'_>, b: &Tensor<'_>) -> Result<()> {
    if a.device() != b.device() {
        return Err(Error::DeviceMismatch {
            op,
            lhs: a.device().to_string(),
            rhs: b.device().to_string(),
        });
    }
    Ok(())
}
