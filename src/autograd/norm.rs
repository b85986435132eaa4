//! Normalisations over the last axis, composed from the differentiable ops (so their derivatives,
//! and their kernels on every device, are those of the ops they are made of).

use super::Var;
use crate::error::{Error, Result};

/// Checks the normalised axis, the affine parameters' shapes and `eps`.
fn check_norm(
    op: &'static str,
    x: &Var<'_, '_>,
    params: &[Option<&Var<'_, '_>>],
    eps: f64,
) -> Result<usize> {
    let Some(&features) = x.shape().last() else {
        return Err(Error::InvalidShape {
            op,
            shape: Vec::new(),
            reason: "needs at least one dimension (the last one is normalised)".into(),
        });
    };
    for p in params.iter().flatten() {
        if p.shape() != [features] {
            return Err(Error::ShapeMismatch {
                op,
                lhs: x.shape().to_vec(),
                rhs: p.shape().to_vec(),
                hint: "the weight and bias must have one element per feature (the last dimension)",
            });
        }
    }
    if !(eps.is_finite() && eps > 0.0) {
        return Err(Error::InvalidShape {
            op,
            shape: x.shape().to_vec(),
            reason: format!("eps must be a positive finite number, got {eps}"),
        });
    }
    Ok(features)
}

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
        check_norm("layer_norm", self, &[weight, bias], eps)?;
        let centred = self.sub(&self.mean(&[-1], true)?)?;
        let variance = centred.square()?.mean(&[-1], true)?;
        let normalised = centred.mul(&variance.add_scalar(eps)?.sqrt()?.recip()?)?;
        affine(normalised, weight, bias)
    }

    /// RMS normalisation over the last axis (Zhang and Sennrich, 2019):
    /// `x / sqrt(mean(x²) + eps) * weight`.
    ///
    /// # Errors
    /// As for [`layer_norm`](Self::layer_norm).
    #[track_caller]
    pub fn rms_norm(&self, weight: Option<&Var<'t, 's>>, eps: f64) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        if let Some(x) = self.autocast_f32()? {
            return x.rms_norm(weight, eps);
        }
        check_norm("rms_norm", self, &[weight], eps)?;
        let mean_square = self.square()?.mean(&[-1], true)?;
        let normalised = self.mul(&mean_square.add_scalar(eps)?.sqrt()?.recip()?)?;
        affine(normalised, weight, None)
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
