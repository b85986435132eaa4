//! Batch normalisation over the channels of `[batch, channels, rows, cols]`, with running
//! statistics kept in the model scope.

use std::cell::RefCell;

use super::{Mode, Module, Parameters};
use crate::autograd::Var;
use crate::error::{Error, Result};
use crate::scope::{Movable, Scope};
use crate::tensor::Tensor;

/// Batch normalisation (Ioffe and Szegedy, 2015), PyTorch's `BatchNorm2d`: in training, each channel
/// is normalised with the batch's mean and biased variance over batch, rows and columns, and the
/// running statistics move towards them (`running = (1 - momentum) running + momentum batch`, the
/// variance unbiased); in evaluation the running statistics normalise. Then `· weight + bias`.
///
/// The running statistics are model-scope tensors updated in place during `forward`, so a training
/// step allocates nothing in the model scope. They sit in a `RefCell` because `forward` takes
/// `&self`; assigning a batch tensor to them does not compile (its scope is shorter), the in-place
/// update does.
#[derive(Debug)]
pub struct BatchNorm2d<'m> {
    /// `[channels]`, starts at 1.
    pub weight: Tensor<'m>,
    /// `[channels]`, starts at 0.
    pub bias: Tensor<'m>,
    /// `[channels]`, starts at 0.
    pub running_mean: RefCell<Tensor<'m>>,
    /// `[channels]`, starts at 1.
    pub running_var: RefCell<Tensor<'m>>,
    momentum: f64,
    eps: f64,
}

impl<'m> BatchNorm2d<'m> {
    /// A layer over `channels` channels with PyTorch's momentum 0.1 and `eps = 1e-5`.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] for zero channels; allocation errors.
    #[track_caller]
    pub fn new(scope: &Scope<'m>, channels: usize) -> Result<BatchNorm2d<'m>> {
        if channels == 0 {
            return Err(Error::InvalidShape {
                op: "BatchNorm2d::new",
                shape: vec![0],
                reason: "needs at least one channel".into(),
            });
        }
        Ok(BatchNorm2d {
            weight: scope.ones(&[channels])?.named("weight"),
            bias: scope.zeros(&[channels])?.named("bias"),
            running_mean: RefCell::new(scope.zeros(&[channels])?.named("running_mean")),
            running_var: RefCell::new(scope.ones(&[channels])?.named("running_var")),
            momentum: 0.1,
            eps: 1e-5,
        })
    }

    fn channels(&self) -> usize {
        self.weight.shape()[0]
    }
}

impl<'m> Module<'m> for BatchNorm2d<'m> {
    fn forward<'t, 's>(&self, x: &Var<'t, 's>, mode: Mode) -> Result<Var<'t, 's>>
    where
        'm: 's,
    {
        let c = self.channels();
        let &[batch, channels, rows, cols] = x.shape() else {
            return Err(Error::InvalidShape {
                op: "BatchNorm2d::forward",
                shape: x.shape().to_vec(),
                reason: format!("needs [batch, {c}, rows, cols]"),
            });
        };
        let count = batch * rows * cols;
        if channels != c || (mode == Mode::Train && count < 2) {
            return Err(Error::InvalidShape {
                op: "BatchNorm2d::forward",
                shape: x.shape().to_vec(),
                reason: format!(
                    "needs [batch, {c}, rows, cols] with more than one value per channel in training"
                ),
            });
        }
        let tape = x.tape();
        let per_channel = [1, c, 1, 1];
        let (centred, var) = match mode {
            Mode::Train => {
                let mean = x.mean(&[0, 2, 3], true)?;
                let centred = x.sub(&mean)?;
                let var = centred.square()?.mean(&[0, 2, 3], true)?;
                // The running statistics move in place: no allocation in the model scope.
                let unbiased = count as f64 / (count - 1) as f64;
                let m = self.momentum;
                let mut rm = self.running_mean.borrow_mut();
                let batch_mean = mean.value().reshape(&[c])?.to_dtype(rm.dtype())?;
                rm.mul_scalar_(1.0 - m)?;
                rm.axpy_(m, &batch_mean)?;
                let mut rv = self.running_var.borrow_mut();
                let batch_var = var.value().reshape(&[c])?.to_dtype(rv.dtype())?;
                rv.mul_scalar_(1.0 - m)?;
                rv.axpy_(m * unbiased, &batch_var)?;
                (centred, var)
            }
            Mode::Eval => {
                let running = |t: &RefCell<Tensor<'m>>| -> Result<Var<'t, 's>> {
                    let t = t
                        .borrow()
                        .reshape(&per_channel)?
                        .to_dtype(x.value().dtype())?;
                    Ok(tape.constant(&t))
                };
                (
                    x.sub(&running(&self.running_mean)?)?,
                    running(&self.running_var)?,
                )
            }
        };
        let normalised = centred.mul(&var.add_scalar(self.eps)?.sqrt()?.recip()?)?;
        normalised
            .mul(&tape.param(&self.weight).reshape(&per_channel)?)?
            .add(&tape.param(&self.bias).reshape(&per_channel)?)
    }
}

/// The learned scale and shift; the running statistics are buffers, not parameters (no gradient,
/// no optimizer state).
impl<'m> Parameters<'m> for BatchNorm2d<'m> {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor<'m>)) {
        f(&format!("{prefix}weight"), &self.weight);
        f(&format!("{prefix}bias"), &self.bias);
    }

    fn visit_mut(&mut self, f: &mut dyn FnMut(&mut Tensor<'m>) -> Result<()>) -> Result<()> {
        f(&mut self.weight)?;
        f(&mut self.bias)
    }
}

impl<'m> Movable<'m> for BatchNorm2d<'m> {
    type Moved<'b> = BatchNorm2d<'b>;
    fn move_into<'b>(self, target: &Scope<'b>) -> Result<BatchNorm2d<'b>> {
        Ok(BatchNorm2d {
            weight: self.weight.move_into(target)?,
            bias: self.bias.move_into(target)?,
            running_mean: RefCell::new(self.running_mean.into_inner().move_into(target)?),
            running_var: RefCell::new(self.running_var.into_inner().move_into(target)?),
            momentum: self.momentum,
            eps: self.eps,
        })
    }
}
