//! Gradient accumulation: one optimizer step from the gradients of several micro-batches.

use super::Optimizer;
use crate::autograd::Gradients;
use crate::error::{Error, Result};
use crate::nn::Parameters;
use crate::scope::Scope;
use crate::tensor::Tensor;

/// Sums of gradients over micro-batches, kept in the model scope and updated in place, so a large
/// batch can be trained in pieces that each fit in memory: [`add`](Self::add) each micro-batch's
/// gradients, then [`step`](Self::step) applies their mean with an optimizer and starts a new sum.
///
/// ```
/// use ndscope::nn::{self, Activation, Init, Mode, Module};
/// use ndscope::optim::{Adam, AdamConfig, GradientAccumulator};
/// use ndscope::{Device, Tape, root};
///
/// root(Device::Cpu, |m| {
///     let mut model = nn::mlp(m, &[4, 8, 3], Activation::Relu, Init::KaimingUniform)?;
///     let mut opt = Adam::new(m, &model, AdamConfig::adamw(1e-3, 1e-2))?;
///     let mut sums = GradientAccumulator::new(m, &model)?; // in the model scope, allocated once
///     for _micro_batch in 0..4 {
///         m.scope(|b| {
///             let tape = Tape::new(b);
///             let x = tape.constant(&b.randn(&[8, 4])?);
///             let labels = b.from_slice(&[0i64, 1, 2, 0, 1, 2, 0, 1], &[8])?;
///             let loss = model.forward(&x, Mode::Train)?.cross_entropy(&labels)?;
///             sums.add(&tape.backward(&loss)?) // added in place; the batch's gradients die here
///         })?;
///     }
///     assert_eq!(sums.micro_batches(), 4);
///     sums.step(&mut opt, &mut model)?; // the mean of the four, then a fresh sum
///     assert_eq!(sums.micro_batches(), 0);
///     Ok::<_, ndscope::Error>(())
/// })?;
/// # Ok::<(), ndscope::Error>(())
/// ```
#[derive(Debug)]
pub struct GradientAccumulator<'m> {
    sums: Gradients<'m>,
    micro_batches: usize,
}

impl<'m> GradientAccumulator<'m> {
    /// Zero sums for every parameter of `params`, in `scope` (the model scope).
    ///
    /// # Errors
    /// Allocation errors.
    #[track_caller]
    pub fn new<P: Parameters<'m> + ?Sized>(
        scope: &Scope<'m>,
        params: &P,
    ) -> Result<GradientAccumulator<'m>> {
        let mut list: Vec<Tensor<'m>> = Vec::new();
        params.visit("", &mut |_, p| list.push(p.clone()));
        Ok(GradientAccumulator {
            sums: Gradients::zeros_for(scope, list.iter())?,
            micro_batches: 0,
        })
    }

    /// Adds one micro-batch's gradients to the sums, in place (no allocation in the model scope).
    ///
    /// # Errors
    /// [`Error::InvalidShape`] when `grads` holds a parameter the accumulator was not created for;
    /// dtype or device mismatches.
    pub fn add(&mut self, grads: &Gradients<'_>) -> Result<()> {
        self.sums.add_in_place("GradientAccumulator::add", grads)?;
        self.micro_batches += 1;
        Ok(())
    }

    /// Micro-batches added since the last step.
    pub fn micro_batches(&self) -> usize {
        self.micro_batches
    }

    /// The current sums (not yet divided by the number of micro-batches).
    pub fn sums(&self) -> &Gradients<'m> {
        &self.sums
    }

    /// The current sums, writable: for averaging them across data-parallel ranks
    /// ([`DataParallel::average`](crate::dist::DataParallel::average)) before [`step`](Self::step),
    /// so that the micro-batches before the last need no communication.
    pub fn sums_mut(&mut self) -> &mut Gradients<'m> {
        &mut self.sums
    }

    /// Divides the sums by the number of micro-batches, applies them with `opt` to `params`, and
    /// zeroes the sums for the next accumulation.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when no micro-batch was added; the optimizer's errors.
    pub fn step<P: Parameters<'m> + ?Sized>(
        &mut self,
        opt: &mut impl Optimizer<'m>,
        params: &mut P,
    ) -> Result<()> {
        if self.micro_batches == 0 {
            return Err(Error::InvalidArgument {
                op: "GradientAccumulator::step",
                reason: "no micro-batch was added since the last step; call `add` first".into(),
            });
        }
        self.sums.scale_in_place(1.0 / self.micro_batches as f64)?;
        opt.step(params, &self.sums)?;
        self.sums.zero_in_place()?;
        self.micro_batches = 0;
        Ok(())
    }
}
