//! Row normalisations computed in one pass over each row (one kernel launch), where composing them
//! from elementwise ops would cost a launch and a pass per step.

use std::panic::Location;

use crate::error::{Error, Result};
use crate::ops::{require_float, same_device, same_dtype};
use crate::tensor::Tensor;

/// Checks a normalisation over the last axis of `shape`: at least one dimension, each affine
/// parameter `[features]`, `eps` positive and finite. Returns the feature count.
pub(crate) fn check_norm(
    op: &'static str,
    shape: &[usize],
    params: &[Option<&[usize]>],
    eps: f64,
) -> Result<usize> {
    let Some(&features) = shape.last() else {
        return Err(Error::InvalidShape {
            op,
            shape: Vec::new(),
            reason: "needs at least one dimension (the last one is normalised)".into(),
        });
    };
    for p in params.iter().flatten() {
        if *p != [features] {
            return Err(Error::ShapeMismatch {
                op,
                lhs: shape.to_vec(),
                rhs: p.to_vec(),
                hint: "the weight and bias must have one element per feature (the last dimension)",
            });
        }
    }
    if !(eps.is_finite() && eps > 0.0) {
        return Err(Error::InvalidShape {
            op,
            shape: shape.to_vec(),
            reason: format!("eps must be a positive finite number, got {eps}"),
        });
    }
    Ok(features)
}

impl<'s> Tensor<'s> {
    /// RMS normalisation over the last axis (Zhang and Sennrich, 2019). For each row `x` of `len`
    /// values, in the compute dtype (`f64` for `f64`, `f32` for the other floats):
    ///
    /// ```text
    /// inv    = 1 / sqrt(Σ x² / len + eps)
    /// out[j] = round(round(x[j] · inv) · weight[j])      (without a weight: round(x[j] · inv))
    /// ```
    ///
    /// rounding to the input's dtype: for 16-bit rows this is transformers' `LlamaRMSNorm` (the
    /// normalised value cast to the input's dtype, then scaled), for `f32` and `f64` the plain
    /// formula. `weight` has one element per feature, in the input's dtype.
    ///
    /// ```
    /// # ndscope::root(ndscope::Device::Cpu, |s| {
    /// let x = s.from_slice(&[3.0f32, 4.0], &[1, 2])?; // mean square 12.5
    /// let w = s.from_slice(&[1.0f32, 2.0], &[2])?;
    /// let y = x.rms_norm(Some(&w), 1e-6)?.to_vec::<f32>()?;
    /// let inv = 1.0 / (12.5f32 + 1e-6).sqrt();
    /// assert!((y[0] - 3.0 * inv).abs() < 1e-6 && (y[1] - 8.0 * inv).abs() < 1e-6);
    /// # Ok::<_, ndscope::Error>(()) })?; Ok::<(), ndscope::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidShape`] for a rank-0 input or an `eps` that is not positive and finite;
    /// [`Error::ShapeMismatch`] for a weight of another shape than `[len]`;
    /// [`Error::UnsupportedDType`] for integers; [`Error::DTypeMismatch`] for a weight of another
    /// dtype; [`Error::DeviceMismatch`].
    #[track_caller]
    pub fn rms_norm(&self, weight: Option<&Tensor<'_>>, eps: f64) -> Result<Tensor<'s>> {
        const OP: &str = "rms_norm";
        require_float(OP, self)?;
        check_norm(OP, self.shape(), &[weight.map(Tensor::shape)], eps)?;
        if let Some(w) = weight {
            same_dtype(OP, self, w)?;
            same_device(OP, self, w)?;
        }
        let x = self.contiguous()?;
        let w = weight.map(Tensor::contiguous).transpose()?;
        let mut out = Tensor::output_of(&[self], self.dtype(), self.shape(), Location::caller())?;
        self.backend()?.rms_norm(
            self.dtype(),
            x.src(),
            w.as_ref().map(Tensor::src),
            eps,
            out.dst(),
        )?;
        Ok(out)
    }
}
