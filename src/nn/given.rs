//! Checks for layers built from tensors the caller already holds (`Linear::from_tensors`, ...): the
//! layer's methods assume their parameters' shapes, dtypes and device agree, so a mismatch is
//! refused where the layer is made, naming the parameter, rather than at its first forward pass.

use crate::error::{Error, Result};
use crate::ops::{same_device, same_dtype};
use crate::tensor::Tensor;

/// Checks that `t`, the `what` of a layer made by `op`, has `shape` (no zero dimension), a float
/// dtype, and the dtype and device of `like` (the layer's first parameter), where given.
pub(super) fn check(
    op: &'static str,
    what: &str,
    t: &Tensor<'_>,
    shape: &[usize],
    like: Option<&Tensor<'_>>,
) -> Result<()> {
    if t.shape() != shape || shape.contains(&0) {
        return Err(Error::InvalidShape {
            op,
            shape: t.shape().to_vec(),
            reason: format!("the {what} must have the shape {shape:?}, without a zero dimension"),
        });
    }
    if !t.dtype().is_float() {
        return Err(Error::UnsupportedDType {
            op,
            dtype: t.dtype(),
            expected: "a float dtype (f32, f64, bf16, f16) for a layer's parameters",
        });
    }
    if let Some(like) = like {
        same_dtype(op, like, t)?;
        same_device(op, like, t)?;
    }
    Ok(())
}
