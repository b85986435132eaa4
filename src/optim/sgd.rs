//! Stochastic gradient descent with momentum.

use super::{Frozen, Optimizer, check_param_set, for_each_param, zeros_like_each};
use crate::autograd::Gradients;
use crate::error::{Error, Result};
use crate::nn::Parameters;
use crate::ops::fused::{FusedUpdate, update_in_place};
use crate::scope::Scope;
use crate::tensor::Tensor;

/// Settings of [`Sgd`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdConfig {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor (0 for plain SGD).
    pub momentum: f64,
    /// L2 penalty added to the gradient.
    pub weight_decay: f64,
    /// Nesterov momentum.
    pub nesterov: bool,
}

impl SgdConfig {
    /// Plain SGD with learning rate `lr`.
    pub fn new(lr: f64) -> SgdConfig {
        SgdConfig {
            lr,
            momentum: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        }
    }

    /// With momentum `momentum`.
    pub fn momentum(self, momentum: f64) -> SgdConfig {
        SgdConfig { momentum, ..self }
    }
}

/// SGD with momentum, as PyTorch defines it: `v = μ v + (g + λ p)`, `p -= lr v` (Nesterov:
/// `p -= lr (g + λ p + μ v)`). The velocity lives in the model scope.
#[derive(Debug)]
pub struct Sgd<'m> {
    config: SgdConfig,
    velocity: Vec<Tensor<'m>>,
    frozen: Frozen,
}

impl<'m> Sgd<'m> {
    /// An optimizer for `params`, with its velocity allocated in `scope` (the model scope).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a negative learning rate or momentum; allocation errors.
    #[track_caller]
    pub fn new(
        scope: &Scope<'m>,
        params: &(impl Parameters<'m> + ?Sized),
        config: SgdConfig,
    ) -> Result<Sgd<'m>> {
        if config.lr < 0.0 || config.momentum < 0.0 || config.weight_decay < 0.0 {
            return Err(Error::InvalidArgument {
                op: "Sgd::new",
                reason: format!(
                    "learning rate, momentum and weight decay must be >= 0, got {config:?}"
                ),
            });
        }
        Ok(Sgd {
            config,
            velocity: zeros_like_each(scope, params, "sgd.velocity")?,
            frozen: Frozen::default(),
        })
    }
}

impl<'m> Optimizer<'m> for Sgd<'m> {
    fn step<P: Parameters<'m> + ?Sized>(
        &mut self,
        params: &mut P,
        grads: &Gradients<'_>,
    ) -> Result<()> {
        let SgdConfig {
            lr,
            momentum,
            weight_decay,
            nesterov,
        } = self.config;
        check_param_set("Sgd::step", params, &self.velocity)?;
        self.frozen.check_gradients("Sgd::step", params, grads)?;
        let frozen = &self.frozen;
        let velocity = &mut self.velocity;
        for_each_param(params, |i, p| {
            if frozen.contains(i) {
                return Ok(());
            }
            let g = grads.get(p).expect("checked above");
            let update = FusedUpdate::Sgd {
                lr,
                momentum,
                weight_decay,
                nesterov,
            };
            update_in_place("Sgd::step", update, &mut [p, &mut velocity[i]], &g, None)
        })
    }

    fn freeze<P: Parameters<'m> + ?Sized>(
        &mut self,
        params: &P,
        name: &str,
        frozen: bool,
    ) -> Result<()> {
        self.frozen.set("Sgd::freeze", params, name, frozen)
    }

    fn learning_rate(&self) -> f64 {
        self.config.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.config.lr = lr;
    }
}
