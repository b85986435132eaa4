//! Adam and AdamW.

use super::{Frozen, Optimizer, check_param_set, for_each_param, zeros_like_each};
use crate::autograd::Gradients;
use crate::error::{Error, Result};
use crate::nn::Parameters;
use crate::ops::fused::{FusedUpdate, update_in_place};
use crate::scope::Scope;
use crate::tensor::Tensor;

/// Settings of [`Adam`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamConfig {
    /// Learning rate.
    pub lr: f64,
    /// Decay rates of the first and second moment estimates.
    pub betas: (f64, f64),
    /// Added to the denominator for numerical stability.
    pub eps: f64,
    /// Weight decay: an L2 penalty added to the gradient (Adam), or decoupled from it (AdamW).
    pub weight_decay: f64,
    /// AdamW (Loshchilov & Hutter, 2019): decay the weights directly instead of through the gradient.
    pub decoupled_weight_decay: bool,
}

impl AdamConfig {
    /// Adam with learning rate `lr` and the usual `betas = (0.9, 0.999)`, `eps = 1e-8`.
    pub fn adam(lr: f64) -> AdamConfig {
        AdamConfig {
            lr,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
            decoupled_weight_decay: false,
        }
    }

    /// AdamW with learning rate `lr` and decoupled weight decay `weight_decay`.
    pub fn adamw(lr: f64, weight_decay: f64) -> AdamConfig {
        AdamConfig {
            weight_decay,
            decoupled_weight_decay: true,
            ..AdamConfig::adam(lr)
        }
    }
}

/// Adam / AdamW, as PyTorch defines them. Both moment estimates live in the model scope, and so do
/// the bias corrections' powers `[b1^t, b2^t]` (an `f64` pair on the model scope's device, advanced by
/// each step), so that a step captured as a CUDA graph ([`StepGraph`](crate::StepGraph)) corrects
/// each replayed step by its own `t`, as PyTorch's `capturable` Adam does.
#[derive(Debug)]
pub struct Adam<'m> {
    config: AdamConfig,
    steps: u64,
    first_moment: Vec<Tensor<'m>>,
    second_moment: Vec<Tensor<'m>>,
    /// `[b1^t, b2^t]` after `t` steps.
    powers: Tensor<'m>,
    /// `[b1, b2]`, what `powers` is multiplied by at each step.
    betas: Tensor<'m>,
    frozen: Frozen,
}

impl<'m> Adam<'m> {
    /// An optimizer for `params`, with its state allocated in `scope` (the model scope).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a negative learning rate, weight decay or eps, or betas outside
    /// `[0, 1)`; allocation errors.
    #[track_caller]
    pub fn new(
        scope: &Scope<'m>,
        params: &(impl Parameters<'m> + ?Sized),
        config: AdamConfig,
    ) -> Result<Adam<'m>> {
        let (b1, b2) = config.betas;
        let valid = config.lr >= 0.0
            && config.weight_decay >= 0.0
            && config.eps >= 0.0
            && (0.0..1.0).contains(&b1)
            && (0.0..1.0).contains(&b2);
        if !valid {
            return Err(Error::InvalidArgument {
                op: "Adam::new",
                reason: format!(
                    "needs lr, weight decay and eps >= 0 and betas in [0, 1), got {config:?}"
                ),
            });
        }
        Ok(Adam {
            config,
            steps: 0,
            first_moment: zeros_like_each(scope, params, "adam.m")?,
            second_moment: zeros_like_each(scope, params, "adam.v")?,
            // Direct calls, so the creation site dumps show is the optimizer's caller.
            powers: scope.from_slice(&[1.0f64, 1.0], &[2])?.named("adam.powers"),
            betas: scope.from_slice(&[b1, b2], &[2])?.named("adam.betas"),
            frozen: Frozen::default(),
        })
    }

    /// Steps taken so far.
    pub fn steps(&self) -> u64 {
        self.steps
    }
}

impl<'m> Optimizer<'m> for Adam<'m> {
    fn step<P: Parameters<'m> + ?Sized>(
        &mut self,
        params: &mut P,
        grads: &Gradients<'_>,
    ) -> Result<()> {
        let c = self.config;
        let (b1, b2) = c.betas;
        let (l2, decay) = if c.decoupled_weight_decay {
            (0.0, 1.0 - c.lr * c.weight_decay)
        } else {
            (c.weight_decay, 1.0)
        };
        let update = FusedUpdate::Adam {
            b1,
            b2,
            eps: c.eps,
            lr: c.lr,
            l2,
            decay,
        };
        check_param_set("Adam::step", params, &self.first_moment)?;
        self.frozen.check_gradients("Adam::step", params, grads)?;
        // `[b1^t, b2^t]` for this step's `t`, advanced on the device.
        self.powers.mul_(&self.betas)?;
        let frozen = &self.frozen;
        let (ms, vs, powers) = (
            &mut self.first_moment,
            &mut self.second_moment,
            &self.powers,
        );
        for_each_param(params, |i, p| {
            if frozen.contains(i) {
                return Ok(());
            }
            let g = grads.get(p).expect("checked above");
            update_in_place(
                "Adam::step",
                update,
                &mut [p, &mut ms[i], &mut vs[i]],
                &g,
                Some(powers),
            )
        })?;
        self.steps += 1;
        Ok(())
    }

    fn freeze<P: Parameters<'m> + ?Sized>(
        &mut self,
        params: &P,
        name: &str,
        frozen: bool,
    ) -> Result<()> {
        self.frozen.set("Adam::freeze", params, name, frozen)
    }

    fn learning_rate(&self) -> f64 {
        self.config.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.config.lr = lr;
    }
}
