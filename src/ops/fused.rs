//! Fused in-place updates: one pass that rewrites several tensors from one source, as optimizers need
//! (a parameter and its moment estimates from a gradient) without a temporary per term.

use crate::dtype::Element;
use crate::error::{Error, Result};
use crate::layout::RowWalk;
use crate::ops::{same_device, same_dtype};
use crate::tensor::Tensor;

/// Calls `f(targets' elements, source element)` for every position, writing the targets in place.
///
/// Every target must have `source`'s shape and all must hold `T`. A shared or strided target first
/// gets a private contiguous copy (copy-on-write, like every in-place op); a unique contiguous one is
/// updated where it lies, so a steady-state optimizer step allocates nothing.
pub(crate) fn update_in_place<T: Element, const M: usize>(
    op: &'static str,
    targets: [&mut Tensor<'_>; M],
    source: &Tensor<'_>,
    f: impl Fn([&mut T; M], T),
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
    let mut slices: [&mut [T]; M] = targets.map(|t| t.fresh_mut::<T>());
    let walk = RowWalk::new(
        source.shape(),
        [source.strides()],
        [source.layout().offset()],
    );
    let [ss] = walk.row_strides();
    let src = source.block_data::<T>();
    walk.for_segments(0, source.numel(), |pos, [is], len| {
        for j in 0..len {
            let at = pos + j;
            f(slices.each_mut().map(|s| &mut s[at]), src[is + j * ss]);
        }
    });
    Ok(())
}
