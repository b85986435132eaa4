//! Dynamic loss scaling for `f16` training.

use super::Optimizer;
use crate::autograd::{Gradients, Var};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::nn::Parameters;

/// Dynamic loss scaling, as PyTorch's `GradScaler` does it: `f16` keeps 11 significant bits down to
/// `6e-5` (`6e-8` subnormal), so the small gradients of a 16-bit backward pass flush to zero unless
/// the loss is multiplied by a large scale first. [`scale_loss`](Self::scale_loss) multiplies it;
/// [`step`](Self::step) checks the gradients for inf/NaN, and then either divides them by the scale
/// and steps the optimizer, or skips the step and lowers the scale (by `backoff`, 0.5); after
/// `growth_interval` (2000) good steps in a row it raises the scale (by `growth`, 2).
///
/// The check costs one host read per step, not one per gradient: each gradient contributes
/// `sum(g * 0)` (0 when finite, NaN otherwise) to one device scalar, which is read once.
///
/// ```
/// use ndscope::nn::{self, Activation, Init, Mode, Module};
/// use ndscope::optim::{LossScaler, Optimizer, Sgd, SgdConfig};
/// use ndscope::{DType, Device, Tape, root};
///
/// root(Device::Cpu, |m| {
///     let mut model = nn::mlp(m, &[4, 8, 3], Activation::Relu, Init::KaimingUniform)?;
///     let mut opt = Sgd::new(m, &model, SgdConfig::new(0.1))?;
///     let mut scaler = LossScaler::new(); // 2^16 to start
///     m.scope(|b| {
///         b.autocast(DType::F16)?;
///         let tape = Tape::new(b);
///         let x = tape.constant(&b.randn(&[2, 4])?);
///         let loss = model.forward(&x, Mode::Train)?.cross_entropy(&b.from_slice(&[0i64, 2], &[2])?)?;
///         let mut grads = tape.backward(&scaler.scale_loss(&loss)?)?;
///         let stepped = scaler.step(&mut opt, &mut model, &mut grads)?;
///         assert!(stepped); // finite gradients: unscaled and applied
///         Ok(())
///     })?;
///     assert_eq!(scaler.skipped_steps(), 0);
///     Ok::<_, ndscope::Error>(())
/// })?;
/// # Ok::<(), ndscope::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct LossScaler {
    scale: f64,
    growth: f64,
    backoff: f64,
    growth_interval: usize,
    good_steps: usize,
    skipped: u64,
}

impl Default for LossScaler {
    fn default() -> LossScaler {
        LossScaler::new()
    }
}

impl LossScaler {
    /// A scaler starting at `2^16`, doubling after 2000 good steps and halving on overflow.
    pub fn new() -> LossScaler {
        LossScaler {
            scale: 65536.0,
            growth: 2.0,
            backoff: 0.5,
            growth_interval: 2000,
            good_steps: 0,
            skipped: 0,
        }
    }

    /// Sets the starting scale, the growth and backoff factors, and the good steps between raises.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] unless `scale` is positive
    /// and finite, `growth > 1`, `0 < backoff < 1` and `growth_interval > 0`.
    pub fn with(
        scale: f64,
        growth: f64,
        backoff: f64,
        growth_interval: usize,
    ) -> Result<LossScaler> {
        let valid = scale.is_finite()
            && scale > 0.0
            && growth > 1.0
            && growth.is_finite()
            && backoff > 0.0
            && backoff < 1.0
            && growth_interval > 0;
        if !valid {
            return Err(Error::InvalidArgument {
                op: "LossScaler::with",
                reason: format!(
                    "got scale {scale}, growth {growth}, backoff {backoff}, growth interval \
                     {growth_interval}; the scale must be positive and finite, growth above 1, \
                     backoff between 0 and 1 and the interval at least 1"
                ),
            });
        }
        Ok(LossScaler {
            scale,
            growth,
            backoff,
            growth_interval,
            ..LossScaler::new()
        })
    }

    /// The current scale.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// Steps skipped because a gradient was inf or NaN.
    pub fn skipped_steps(&self) -> u64 {
        self.skipped
    }

    /// `loss * scale`, in `f32` (a 16-bit loss is widened first, so the product cannot overflow
    /// `f16`); run the backward pass from it.
    ///
    /// # Errors
    /// As for [`Var::mul_scalar`].
    #[track_caller]
    pub fn scale_loss<'t, 's>(&self, loss: &Var<'t, 's>) -> Result<Var<'t, 's>> {
        let loss = if loss.value().dtype().is_half() {
            loss.to_dtype(DType::F32)?
        } else {
            loss.clone()
        };
        loss.mul_scalar(self.scale)
    }

    /// Divides the gradients of a scaled loss by the scale and returns `true`; or, when any of them
    /// holds inf or NaN, leaves them, lowers the scale and returns `false` (skip the step). For an
    /// optimizer that is not an [`Optimizer`] value, or code that clips the unscaled gradients before
    /// stepping; [`step`](Self::step) does both.
    ///
    /// # Errors
    /// Allocation errors.
    pub fn unscale(&mut self, grads: &mut Gradients<'_>) -> Result<bool> {
        if !grads.all_finite()? {
            self.scale *= self.backoff;
            self.good_steps = 0;
            self.skipped += 1;
            return Ok(false);
        }
        grads.scale_in_place(1.0 / self.scale)?;
        self.good_steps += 1;
        if self.good_steps == self.growth_interval {
            self.scale *= self.growth;
            self.good_steps = 0;
        }
        Ok(true)
    }

    /// Steps `optimizer` with the gradients of a scaled loss divided by the scale, and returns
    /// `true`; or, when any gradient holds inf or NaN, leaves the parameters alone, lowers the scale
    /// and returns `false`.
    ///
    /// # Errors
    /// As for [`Optimizer::step`], and allocation errors.
    pub fn step<'m, O, P>(
        &mut self,
        optimizer: &mut O,
        params: &mut P,
        grads: &mut Gradients<'_>,
    ) -> Result<bool>
    where
        O: Optimizer<'m> + ?Sized,
        P: Parameters<'m> + ?Sized,
    {
        if !self.unscale(grads)? {
            return Ok(false);
        }
        optimizer.step(params, grads)?;
        Ok(true)
    }
}
