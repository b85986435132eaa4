//! Fused in-place updates: one pass that rewrites several tensors from one source, as optimizers need
//! (a parameter and its moment estimates from a gradient) without a temporary per term.

use rayon::prelude::*;

use crate::dtype::Element;
use crate::error::{Error, Result};
use crate::layout::RowWalk;
use crate::ops::{CHUNK, PARALLEL_MIN, same_device, same_dtype};
use crate::tensor::Tensor;

/// A fused update by name, for the GPU kernels (`kernels/optim.cu`); the host runs the closure
/// given beside it, which must compute the same.
#[derive(Debug, Clone, Copy)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) enum FusedKernel {
    /// Targets `[param, velocity]`.
    Sgd {
        lr: f64,
        momentum: f64,
        weight_decay: f64,
        nesterov: bool,
    },
    /// Targets `[param, first moment, second moment]`.
    Adam {
        b1: f64,
        b2: f64,
        eps: f64,
        step_size: f64,
        v_scale: f64,
        l2: f64,
        decay: f64,
    },
}

/// Calls `f(targets' elements, source element)` for every position, writing the targets in place
/// (on a GPU, `kernel` does the same).
///
/// Every target must have `source`'s shape and all must hold `T`. A shared or strided target first
/// gets a private contiguous copy (copy-on-write, like every in-place op); a unique contiguous one is
/// updated where it lies, so a steady-state optimizer step allocates nothing.
pub(crate) fn update_in_place<T: Element, const M: usize>(
    op: &'static str,
    targets: [&mut Tensor<'_>; M],
    source: &Tensor<'_>,
    kernel: FusedKernel,
    f: impl Fn([&mut T; M], T) + Sync,
) -> Result<()> {
    for t in &targets {
        same_dtype(op, t, source)?;
        same_device(op, t, source)?;
        if t.shape() != source.shape() {
            return Err(Error::ShapeMismatch {
                op,
                lhs: t.shape().to_vec(),
                rhs: source.shape().to_vec(),
                hint: "an in-place update needs a source of exactly the updated tensor's shape",
            });
        }
    }
    source.check_dtype::<T>(op)?;
    let mut targets = targets;
    for t in targets.iter_mut() {
        t.make_unique_contiguous()?;
    }
    #[cfg(feature = "cuda")]
    if source.device().is_cuda() {
        return crate::cuda::ops::fused_update(op, kernel, &mut targets, &source.contiguous()?);
    }
    #[cfg(not(feature = "cuda"))]
    let _ = kernel;
    let mut slices: [&mut [T]; M] = targets.map(|t| t.fresh_mut::<T>());
    if source.is_contiguous() {
        update_contiguous(slices, source.contiguous_data::<T>(), &f);
        return Ok(());
    }
    let (src, n) = (source.block_data::<T>(), source.numel());
    let walk = RowWalk::new(
        source.shape(),
        [source.strides()],
        [source.layout().offset()],
    );
    let [ss] = walk.row_strides();
    walk.for_segments(0, n, |pos, [is], len| {
        for j in 0..len {
            let at = pos + j;
            f(slices.each_mut().map(|s| &mut s[at]), src[is + j * ss]);
        }
    });
    Ok(())
}

/// The update over contiguous elements: split into chunks that rayon's threads take when there are
/// enough elements (an optimizer step over a large weight), on the calling thread otherwise.
fn update_contiguous<T: Element, const M: usize>(
    targets: [&mut [T]; M],
    source: &[T],
    f: &(impl Fn([&mut T; M], T) + Sync),
) {
    if source.len() < PARALLEL_MIN {
        update_chunk(targets, source, f);
        return;
    }
    let mut pieces = Vec::with_capacity(source.len().div_ceil(CHUNK));
    let (mut rest, mut src) = (targets, source);
    while !src.is_empty() {
        let take = CHUNK.min(src.len());
        let mut halves = rest.map(|s| s.split_at_mut(take));
        // `&mut [T]` defaults to an empty slice, so the heads can be taken out of the pairs.
        let heads = halves.each_mut().map(|(head, _)| std::mem::take(head));
        rest = halves.map(|(_, tail)| tail);
        pieces.push((heads, &src[..take]));
        src = &src[take..];
    }
    pieces
        .into_par_iter()
        .for_each(|(targets, source)| update_chunk(targets, source, f));
}

/// One pass over a chunk; every target has the source's length.
#[inline]
fn update_chunk<T: Element, const M: usize>(
    mut targets: [&mut [T]; M],
    source: &[T],
    f: &impl Fn([&mut T; M], T),
) {
    let n = source.len();
    // Re-slicing to exactly `n` lets the compiler drop the bounds checks in the loop.
    let mut targets = targets.each_mut().map(|t| &mut t[..n]);
    for (j, &g) in source.iter().enumerate() {
        f(targets.each_mut().map(|t| &mut t[j]), g);
    }
}
