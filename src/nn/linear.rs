//! The fully connected layer.

use super::params::layer_parts;
use super::{Init, Mode, Module};
use crate::autograd::Var;
use crate::error::{Error, Result};
use crate::scope::Scope;
use crate::tensor::Tensor;

/// `y = x Wᵀ + b`, with `W` of shape `[out_features, in_features]` (PyTorch's layout, so checkpoints
/// load in other frameworks) and `b` of shape `[out_features]`.
#[derive(Debug)]
pub struct Linear<'m> {
    /// `[out_features, in_features]`.
    pub weight: Tensor<'m>,
    /// `[out_features]`.
    pub bias: Tensor<'m>,
}

impl<'m> Linear<'m> {
    /// A layer in `scope` with `init`ialised weights and zero bias.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] for a zero feature count; allocation errors.
    #[track_caller]
    pub fn new(
        scope: &Scope<'m>,
        in_features: usize,
        out_features: usize,
        init: Init,
    ) -> Result<Linear<'m>> {
        if in_features == 0 || out_features == 0 {
            return Err(Error::InvalidShape {
                op: "Linear::new",
                shape: vec![out_features, in_features],
                reason: "a linear layer needs at least one input and one output feature".into(),
            });
        }
        Ok(Linear {
            weight: init
                .tensor(scope, &[out_features, in_features])?
                .named("weight"),
            bias: scope.zeros(&[out_features])?.named("bias"),
        })
    }

    /// Input features.
    pub fn in_features(&self) -> usize {
        self.weight.shape()[1]
    }

    /// Output features.
    pub fn out_features(&self) -> usize {
        self.weight.shape()[0]
    }
}

impl<'m> Module<'m> for Linear<'m> {
    fn forward<'t, 's>(&self, x: &Var<'t, 's>, _mode: Mode) -> Result<Var<'t, 's>>
    where
        'm: 's,
    {
        let tape = x.tape();
        let (weight, bias) = (tape.param(&self.weight), tape.param(&self.bias));
        if x.shape().len() <= 2 {
            return x.matmul(&weight.t()?)?.add(&bias);
        }
        // [..., in] as one matrix: one product instead of a batch of small ones.
        let mut shape = x.shape().to_vec();
        let rows = shape[..shape.len() - 1].iter().product();
        let y = x
            .reshape(&[rows, self.in_features()])?
            .matmul(&weight.t()?)?
            .add(&bias)?;
        *shape.last_mut().expect("rank > 2") = self.out_features();
        y.reshape(&shape)
    }
}

layer_parts!(Linear {
    tensors: [weight, bias],
    layers: [],
    plain: []
});
