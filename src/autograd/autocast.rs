//! Autocast ([`Scope::autocast`](crate::Scope::autocast)): the dtype each differentiable op computes
//! in when its tape's scope autocasts. The casts are ordinary [`Var::to_dtype`] ops recorded on the
//! tape, so gradients flow back through them into each operand's own dtype, and the cast copies live
//! in the tape's scope.
//!
//! The rules, as PyTorch's autocast has them: matrix products and convolutions compute in the
//! 16-bit dtype; an elementwise op whose operands mix float dtypes computes in it too (a bias added
//! to a 16-bit product stays 16-bit, so activations and what the tape saves for the backward pass
//! take half the bytes); softmax, log-softmax, the losses and layer and RMS norms compute in `f32`.
//! Batch norm runs in its input's dtype, as under PyTorch's autocast: its statistics are sums, which
//! the kernels accumulate in `f32` for every dtype (measured on the CNN example: the same accuracy as
//! an `f32` batch norm, and 0.52x the `f32` step's workspace instead of 0.84x).

use super::Var;
use crate::dtype::DType;
use crate::error::Result;

impl<'t, 's> Var<'t, 's> {
    /// The 16-bit dtype the tape's scope autocasts to, if it does.
    pub(crate) fn autocast(&self) -> Option<DType> {
        self.tape().scope().autocast_dtype()
    }

    /// `self` in `dtype` (a recorded cast when the dtype differs and both are floats).
    pub(super) fn cast_to(&self, dtype: DType) -> Result<Var<'t, 's>> {
        if self.value().dtype() == dtype || !self.value().dtype().is_float() {
            Ok(self.clone())
        } else {
            self.to_dtype(dtype)
        }
    }

    /// The operands of a matrix product or convolution in the autocast dtype, or `None` when the
    /// scope does not autocast or they already have it.
    pub(crate) fn autocast_operands<const N: usize>(
        operands: [&Var<'t, 's>; N],
    ) -> Result<Option<[Var<'t, 's>; N]>> {
        let Some(dtype) = operands[0].autocast() else {
            return Ok(None);
        };
        if operands.iter().all(|v| {
            let d = v.value().dtype();
            d == dtype || !d.is_float()
        }) {
            return Ok(None);
        }
        let mut cast = Vec::with_capacity(N);
        for v in operands {
            cast.push(v.cast_to(dtype)?);
        }
        Ok(cast.try_into().ok())
    }

    /// The operands of an elementwise op whose operands mix float dtypes, both in the autocast dtype;
    /// `None` when the scope does not autocast or the dtypes agree (a mismatch outside autocast stays
    /// the tensor op's error).
    pub(crate) fn autocast_mixed(&self, other: &Var<'t, 's>) -> Result<Option<[Var<'t, 's>; 2]>> {
        let (a, b) = (self.value().dtype(), other.value().dtype());
        if a == b || !a.is_float() || !b.is_float() {
            return Ok(None);
        }
        Var::autocast_operands([self, other])
    }

    /// `self` in `f32` when the scope autocasts and `self` is 16-bit: the input of an op that
    /// autocast keeps in `f32` (softmax, losses, norms).
    pub(crate) fn autocast_f32(&self) -> Result<Option<Var<'t, 's>>> {
        if self.autocast().is_some() && self.value().dtype().is_half() {
            Ok(Some(self.to_dtype(DType::F32)?))
        } else {
            Ok(None)
        }
    }
}
