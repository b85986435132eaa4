//! Normalisation layers: [`LayerNorm`] and [`RmsNorm`] over the last dimension.

use super::given;
use super::params::layer_parts;
use super::{Mode, Module};
use crate::autograd::Var;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::scope::Scope;
use crate::tensor::Tensor;
use crate::weights::Weights;

fn check(op: &'static str, features: usize, eps: f64) -> Result<()> {
    if features == 0 || !eps.is_finite() || eps < 0.0 {
        return Err(Error::InvalidShape {
            op,
            shape: vec![features],
            reason: format!(
                "a normalisation needs at least one feature and a finite eps >= 0, got eps = {eps}"
            ),
        });
    }
    Ok(())
}

/// Layer normalisation with a learned scale (ones) and an optional learned shift (zeros):
/// [`Var::layer_norm`].
#[derive(Debug, Clone)]
pub struct LayerNorm<'m> {
    /// `[features]`, starts at 1.
    pub weight: Tensor<'m>,
    /// `[features]`, starts at 0; `None` for a layer without a shift.
    pub bias: Option<Tensor<'m>>,
    eps: f64,
}

impl<'m> LayerNorm<'m> {
    /// A layer over `features` features with a shift and PyTorch's `eps = 1e-5`.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] for zero features; allocation errors.
    #[track_caller]
    pub fn new(scope: &Scope<'m>, features: usize) -> Result<LayerNorm<'m>> {
        LayerNorm::with_options(scope, features, 1e-5, true)
    }

    /// A layer over `features` features adding `eps` to the variance, with a shift if `bias`.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] for zero features or an `eps` that is not a finite number `>= 0`;
    /// allocation errors.
    #[track_caller]
    pub fn with_options(
        scope: &Scope<'m>,
        features: usize,
        eps: f64,
        bias: bool,
    ) -> Result<LayerNorm<'m>> {
        check("LayerNorm", features, eps)?;
        Ok(LayerNorm {
            weight: scope.ones(&[features])?.named("weight"),
            bias: bias
                .then(|| Ok(scope.zeros(&[features])?.named("bias")))
                .transpose()?,
            eps,
        })
    }

    /// A layer loaded from `weights` (`weight` and, if `bias`, `bias`, each `[features]`) as
    /// `dtype`.
    ///
    /// # Errors
    /// As for [`with_options`](Self::with_options); [`Error::MissingTensor`],
    /// [`Error::TensorMismatch`].
    #[track_caller]
    pub fn load(
        scope: &Scope<'m>,
        weights: &Weights,
        features: usize,
        eps: f64,
        bias: bool,
        dtype: DType,
    ) -> Result<LayerNorm<'m>> {
        check("LayerNorm", features, eps)?;
        Ok(LayerNorm {
            weight: weights.parameter(scope, "weight", &[features], dtype)?,
            bias: bias
                .then(|| weights.parameter(scope, "bias", &[features], dtype))
                .transpose()?,
            eps,
        })
    }

    /// A layer of tensors the caller holds: a scale `weight` (`[features]`), an optional shift
    /// `bias` of the same shape, dtype and device, adding `eps` to the variance. The tensors are
    /// taken as they are, so the layer lives in their scope.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] for a weight that is not a vector with at least one element, a bias
    /// of another shape, or an `eps` that is not a finite number `>= 0`;
    /// [`Error::UnsupportedDType`], [`Error::DTypeMismatch`], [`Error::DeviceMismatch`].
    pub fn from_tensors(
        weight: Tensor<'m>,
        bias: Option<Tensor<'m>>,
        eps: f64,
    ) -> Result<LayerNorm<'m>> {
        let features = given_scale("LayerNorm", "LayerNorm::from_tensors", &weight, eps)?;
        if let Some(b) = &bias {
            given::check(
                "LayerNorm::from_tensors",
                "bias",
                b,
                &[features],
                Some(&weight),
            )?;
        }
        Ok(LayerNorm { weight, bias, eps })
    }

    /// What is added to the variance.
    pub fn eps(&self) -> f64 {
        self.eps
    }
}

/// Checks a norm's given scale `weight` (a float vector `[features]`) and `eps` as the layer's
/// constructors check theirs (`layer`'s `check`); the number of features.
fn given_scale(
    layer: &'static str,
    op: &'static str,
    weight: &Tensor<'_>,
    eps: f64,
) -> Result<usize> {
    let &[features] = weight.shape() else {
        return Err(Error::InvalidShape {
            op,
            shape: weight.shape().to_vec(),
            reason: "the weight must be a vector [features]".into(),
        });
    };
    check(layer, features, eps)?;
    given::check(op, "weight", weight, &[features], None)?;
    Ok(features)
}

impl<'m> Module<'m> for LayerNorm<'m> {
    fn forward<'t, 's>(&self, x: &Var<'t, 's>, _mode: Mode) -> Result<Var<'t, 's>>
    where
        'm: 's,
    {
        let tape = x.tape();
        x.layer_norm(
            Some(&tape.param(&self.weight)),
            self.bias.as_ref().map(|b| tape.param(b)).as_ref(),
            self.eps,
        )
    }
}

layer_parts!(LayerNorm {
    tensors: [weight],
    layers: [bias],
    plain: [eps]
});

/// RMS normalisation with a learned scale (ones): [`Var::rms_norm`].
#[derive(Debug, Clone)]
pub struct RmsNorm<'m> {
    /// `[features]`, starts at 1.
    pub weight: Tensor<'m>,
    eps: f64,
}

impl<'m> RmsNorm<'m> {
    /// A layer over `features` features with `eps = 1e-6` (LLaMA's).
    ///
    /// # Errors
    /// [`Error::InvalidShape`] for zero features; allocation errors.
    #[track_caller]
    pub fn new(scope: &Scope<'m>, features: usize) -> Result<RmsNorm<'m>> {
        RmsNorm::with_eps(scope, features, 1e-6)
    }

    /// A layer over `features` features adding `eps` to the mean square.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] for zero features or an `eps` that is not a finite number `>= 0`;
    /// allocation errors.
    #[track_caller]
    pub fn with_eps(scope: &Scope<'m>, features: usize, eps: f64) -> Result<RmsNorm<'m>> {
        check("RmsNorm", features, eps)?;
        Ok(RmsNorm {
            weight: scope.ones(&[features])?.named("weight"),
            eps,
        })
    }

    /// A layer loaded from `weights` (`weight`, `[features]`) as `dtype`.
    ///
    /// # Errors
    /// As for [`with_eps`](Self::with_eps); [`Error::MissingTensor`], [`Error::TensorMismatch`].
    #[track_caller]
    pub fn load(
        scope: &Scope<'m>,
        weights: &Weights,
        features: usize,
        eps: f64,
        dtype: DType,
    ) -> Result<RmsNorm<'m>> {
        check("RmsNorm", features, eps)?;
        Ok(RmsNorm {
            weight: weights.parameter(scope, "weight", &[features], dtype)?,
            eps,
        })
    }

    /// A layer of a scale `weight` (`[features]`) the caller holds, adding `eps` to the mean
    /// square. The tensor is taken as it is, so the layer lives in its scope.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] for a weight that is not a vector with at least one element or an
    /// `eps` that is not a finite number `>= 0`; [`Error::UnsupportedDType`] for an integer weight.
    pub fn from_tensors(weight: Tensor<'m>, eps: f64) -> Result<RmsNorm<'m>> {
        given_scale("RmsNorm", "RmsNorm::from_tensors", &weight, eps)?;
        Ok(RmsNorm { weight, eps })
    }

    /// What is added to the mean square.
    pub fn eps(&self) -> f64 {
        self.eps
    }
}

impl<'m> Module<'m> for RmsNorm<'m> {
    fn forward<'t, 's>(&self, x: &Var<'t, 's>, _mode: Mode) -> Result<Var<'t, 's>>
    where
        'm: 's,
    {
        x.rms_norm(Some(&x.tape().param(&self.weight)), self.eps)
    }
}

layer_parts!(RmsNorm {
    tensors: [weight],
    layers: [],
    plain: [eps]
});
