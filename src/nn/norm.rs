//! Normalisation layers: [`LayerNorm`] and [`RmsNorm`] over the last dimension.

use super::params::layer_parts;
use super::{Mode, Module};
use crate::autograd::Var;
use crate::error::{Error, Result};
use crate::scope::Scope;
use crate::tensor::Tensor;

fn check_features(op: &'static str, features: usize) -> Result<()> {
    if features == 0 {
        return Err(Error::InvalidShape {
            op,
            shape: vec![0],
            reason: "a normalisation needs at least one feature".into(),
        });
    }
    Ok(())
}

/// Layer normalisation with a learned scale (ones) and shift (zeros): [`Var::layer_norm`].
#[derive(Debug)]
pub struct LayerNorm<'m> {
    /// `[features]`, starts at 1.
    pub weight: Tensor<'m>,
    /// `[features]`, starts at 0.
    pub bias: Tensor<'m>,
    eps: f64,
}

impl<'m> LayerNorm<'m> {
    /// A layer over `features` features with PyTorch's `eps = 1e-5`.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] for zero features; allocation errors.
    #[track_caller]
    pub fn new(scope: &Scope<'m>, features: usize) -> Result<LayerNorm<'m>> {
        check_features("LayerNorm::new", features)?;
        Ok(LayerNorm {
            weight: scope.ones(&[features])?.named("weight"),
            bias: scope.zeros(&[features])?.named("bias"),
            eps: 1e-5,
        })
    }
}

impl<'m> Module<'m> for LayerNorm<'m> {
    fn forward<'t, 's>(&self, x: &Var<'t, 's>, _mode: Mode) -> Result<Var<'t, 's>>
    where
        'm: 's,
    {
        let tape = x.tape();
        x.layer_norm(
            Some(&tape.param(&self.weight)),
            Some(&tape.param(&self.bias)),
            self.eps,
        )
    }
}

layer_parts!(LayerNorm {
    tensors: [weight, bias],
    layers: [],
    plain: [eps]
});

/// RMS normalisation with a learned scale (ones): [`Var::rms_norm`].
#[derive(Debug)]
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
        check_features("RmsNorm::new", features)?;
        Ok(RmsNorm {
            weight: scope.ones(&[features])?.named("weight"),
            eps: 1e-6,
        })
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
