//! Normalisations over the last axis. Layer normalisation is composed from the differentiable ops
//! (its derivative, and its kernels on every device, are those of the ops it is made of); RMS
//! normalisation runs forward as one op (`Tensor::rms_norm`: one pass over each row, where the
//! composition took seven launches on a GPU), its derivative composed from the ops.

use smallvec::{SmallVec, smallvec};

use super::Var;
use super::reduce_to::sum_to;
use crate::dtype::DType;
#[cfg(doc)]
use crate::error::Error;
use crate::error::Result;
use crate::ops::check_norm;

impl<'t, 's> Var<'t, 's> {
    /// Layer normalisation over the last axis (Ba et al., 2016):
    /// `(x - mean) / sqrt(var + eps) * weight + bias`, with the biased variance (divided by the
    /// feature count, as PyTorch's `layer_norm`). `weight` and `bias` have one element per feature;
    /// `None` leaves the normalised value unscaled or unshifted.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] for a rank-0 input or an `eps` that is not positive and finite;
    /// [`Error::ShapeMismatch`] for a weight or bias of another length than the last dimension.
    #[track_caller]
    pub fn layer_norm(
        &self,
        weight: Option<&Var<'t, 's>>,
        bias: Option<&Var<'t, 's>>,
        eps: f64,
    ) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        if let Some(x) = self.autocast_f32()? {
            return x.layer_norm(weight, bias, eps);
        }
        check_norm(
            "layer_norm",
            self.shape(),
            &[weight.map(Var::shape), bias.map(Var::shape)],
            eps,
        )?;
        let centred = self.sub(&self.mean(&[-1], true)?)?;
        let variance = centred.square()?.mean(&[-1], true)?;
        let normalised = centred.mul(&variance.add_scalar(eps)?.sqrt()?.recip()?)?;
        affine(normalised, weight, bias)
    }

    /// RMS normalisation over the last axis (Zhang and Sennrich, 2019):
    /// `x / sqrt(mean(x²) + eps) * weight`, computed and rounded as [`Tensor::rms_norm`] says (for
    /// 16-bit values, transformers' `LlamaRMSNorm`); under autocast in `f32`.
    ///
    /// # Errors
    /// As for [`layer_norm`](Self::layer_norm); [`Error::DTypeMismatch`] for a weight of another
    /// dtype than the values (outside autocast).
    ///
    /// [`Tensor::rms_norm`]: crate::Tensor::rms_norm
    #[track_caller]
    pub fn rms_norm(&self, weight: Option<&Var<'t, 's>>, eps: f64) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        if let Some(x) = self.autocast_f32()? {
            // The norm runs in f32 under autocast, its weight too.
            let weight = match weight {
                Some(w) if w.value().dtype() != DType::F32 => Some(w.to_dtype(DType::F32)?),
                other => other.cloned(),
            };
            return x.rms_norm(weight.as_ref(), eps);
        }
        // One pass over each row forward (`Tensor::rms_norm`, which checks the operands); the
        // derivative is composed.
        let out = self.value.rms_norm(weight.map(Var::value), eps)?;
        let features = out.shape()[out.rank() - 1];
        let x = self.value.clone();
        let w = weight.map(|w| w.value().clone());
        let inputs: SmallVec<[&Var<'t, 's>; 2]> = std::iter::once(self).chain(weight).collect();
        Var::record(&inputs, "rms_norm", out, move |g, needs| {
            // With n = x · inv and inv = (mean(x²) + eps)^(-1/2), for y = n · w:
            // dx = inv · (g·w - n · mean(g·w · n)) along the row, dw = Σ over rows of g · n.
            let inv = x
                .square()?
                .mean(&[-1], true)?
                .add_scalar(eps)?
                .sqrt()?
                .recip()?;
            let n = x.mul(&inv)?;
            let gn = match &w {
                Some(w) => g.mul(w)?,
                None => g.clone(),
            };
            let dx = if needs[0] {
                let dot = gn.mul(&n)?.mean(&[-1], true)?;
                Some(gn.sub(&n.mul(&dot)?)?.mul(&inv)?)
            } else {
                None
            };
            let mut grads = smallvec![dx];
            if w.is_some() {
                grads.push(if needs[1] {
                    Some(sum_to(&g.mul(&n)?, &[features])?)
                } else {
                    None
                });
            }
            Ok(grads)
        })
    }
}

fn affine<'t, 's>(
    x: Var<'t, 's>,
    weight: Option<&Var<'t, 's>>,
    bias: Option<&Var<'t, 's>>,
) -> Result<Var<'t, 's>> {
    let x = match weight {
        Some(w) => x.mul(w)?,
        None => x,
    };
    match bias {
        Some(b) => x.add(b),
        None => Ok(x),
    }
}
