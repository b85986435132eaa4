//! Fused in-place updates: one pass that rewrites several tensors from one source, as optimizers need
//! (a parameter and its moment estimates from a gradient) without a temporary per term. The update's
//! math is stated in `backend::op::FusedUpdate`.

use smallvec::SmallVec;

pub(crate) use crate::backend::op::FusedUpdate;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::ops::{same_device, same_dtype};
use crate::tensor::Tensor;

/// Runs `update` over `targets` (the parameter first, then its state) from `source`, in place.
///
/// Every target must have `source`'s shape and dtype, a float dtype. A shared or strided target first
/// gets a private contiguous copy (copy-on-write, like every in-place op); a unique contiguous one is
/// updated where it lies, so a steady-state optimizer step allocates nothing.
///
/// An Adam update also reads `powers`, the `f64` tensor `[b1^t, b2^t]` on the source's device.
pub(crate) fn update_in_place(
    op: &'static str,
    update: FusedUpdate,
    targets: &mut [&mut Tensor<'_>],
    source: &Tensor<'_>,
    powers: Option<&Tensor<'_>>,
) -> Result<()> {
    debug_assert_eq!(targets.len(), update.targets());
    debug_assert_eq!(powers.is_some(), update.reads_powers());
    if let Some(p) = powers {
        same_device(op, p, source)?;
        debug_assert!(p.dtype() == DType::F64 && p.shape() == [2] && p.layout().is_contiguous());
    }
    if !source.dtype().is_float() {
        return Err(Error::UnsupportedDType {
            op,
            dtype: source.dtype(),
            expected: "float parameters (f32, f64, bf16 or f16)",
        });
    }
    for t in targets.iter() {
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
    for t in targets.iter_mut() {
        t.make_unique_contiguous()?;
    }
    let backend = source.backend()?;
    // GPU kernels read the source packed; the host walks any layout.
    let packed = if backend.reads_any_layout() {
        source.clone()
    } else {
        source.contiguous()?
    };
    let dsts: SmallVec<[_; 3]> = targets.iter_mut().map(|t| t.dst()).collect();
    backend.fused_update(
        source.dtype(),
        update,
        dsts,
        packed.src(),
        powers.map(|p| p.src()),
    )
}
