//! Tensor operations: the semantics of each op, stated once. An op checks shapes, dtypes and
//! devices, places its output in the innermost owner among its operands (`Tensor::output_of`),
//! and makes one call into the backend of the operands' device (`crate::backend`), which holds the
//! kernels. Every op returns `Result`: mismatches, and allocations refused by a cap or budget, are
//! errors, never panics.

mod attention;
mod elementwise;
pub(crate) mod fused;
mod index;
mod join;
mod mask;
mod matmul;
mod norm;
pub(crate) mod paged;
mod quantized;
mod reduce;
mod rotary;
mod scan;
mod softmax;
mod view;
mod window;

/// The statistics of a row of logits on the host that every sampled token needs (first largest,
/// softmax denominator), by the backend's loops picked for the CPU at run time: for `serve`, which
/// may not name the backend.
pub(crate) use crate::backend::cpu::logits as host_logits;
/// The binary ops and derivatives autograd chains, by name (stated in `backend::op`).
pub(crate) use crate::backend::op::{Binary, Window2d};
pub use attention::{AttentionSpec, Causal};
pub(crate) use mask::Triangle;
pub(crate) use norm::check_norm;
pub use window::Conv2dOptions;
pub(crate) use window::window;

use std::panic::Location;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// A kernel's scratch of `bytes` (none when 0): a temporary of the innermost owner of `inputs`,
/// freed to the pool when the op returns, so that the next call (the next training step) reuses
/// the block. Backends say how much they need (`Backend::matmul_scratch_bytes`,
/// `Backend::quant_scratch_bytes`) and allocate nothing themselves.
pub(crate) fn scratch<'s>(
    inputs: &[&Tensor<'s>],
    bytes: usize,
    caller: &'static Location<'static>,
) -> Result<Option<Tensor<'s>>> {
    if bytes == 0 {
        return Ok(None);
    }
    let words = bytes.div_ceil(DType::F32.size());
    Tensor::output_of(inputs, DType::F32, &[words], caller).map(Some)
}

/// The error of a float-only op given integers.
pub(crate) fn not_float(op: &'static str, dtype: DType) -> Error {
    Error::UnsupportedDType {
        op,
        dtype,
        expected: "a float dtype (f32, f64, bf16 or f16)",
    }
}

/// Refuses an integer `t` for a float-only op.
pub(crate) fn require_float(op: &'static str, t: &Tensor<'_>) -> Result<()> {
    if t.dtype().is_float() {
        Ok(())
    } else {
        Err(not_float(op, t.dtype()))
    }
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
