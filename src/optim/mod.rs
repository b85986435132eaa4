//! Optimizers whose state lives in the model scope and is updated in place.
//!
//! An optimizer allocates its state (momentum, moment estimates) once, in the model scope, when it is
//! created. [`Optimizer::step`] then rewrites parameters and state in one fused pass per parameter,
//! reading the batch scope's [`Gradients`]: a steady-state step allocates nothing in the model scope.
//! The state is typed `Tensor<'m>`, so a gradient (`Tensor<'batch>`) cannot be stored into it.
//!
//! ```
//! use ndscope::nn::{self, Activation, Init, Mode, Module};
//! use ndscope::optim::{Adam, AdamConfig, Optimizer};
//! use ndscope::{Device, Tape, root};
//!
//! root(Device::Cpu, |m| {
//!     let mut model = nn::mlp(m, &[2, 8, 2], Activation::Tanh, Init::XavierUniform)?;
//!     let mut opt = Adam::new(m, &model, AdamConfig::adamw(1e-2, 1e-4))?;
//!     for _ in 0..3 {
//!         m.scope(|batch| {
//!             let tape = Tape::new(batch);
//!             let x = tape.constant(&batch.randn(&[4, 2])?);
//!             let y = batch.from_slice(&[0i64, 1, 1, 0], &[4])?;
//!             let loss = model.forward(&x, Mode::Train)?.cross_entropy(&y)?;
//!             let grads = tape.backward(&loss)?;
//!             opt.step(&mut model, &grads)
//!         })?;
//!     }
//!     assert_eq!(opt.steps(), 3);
//!     Ok::<_, ndscope::Error>(())
//! })?;
//! # Ok::<(), ndscope::Error>(())
//! ```

mod adam;
mod sgd;

pub use adam::{Adam, AdamConfig};
pub use sgd::{Sgd, SgdConfig};

use crate::autograd::Gradients;
use crate::error::{Error, Result};
use crate::nn::Parameters;
use crate::scope::Scope;
use crate::tensor::Tensor;

/// Updates parameters from gradients.
pub trait Optimizer<'m> {
    /// Applies one update to every parameter of `params` that has a gradient in `grads`; parameters
    /// without one (unused in the loss) are left as they are. `params` must be the set (same
    /// parameters, same order) the optimizer was created for.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] when `params` is not the set the optimizer was created for; shape or
    /// dtype mismatches between a parameter and its gradient.
    fn step<P: Parameters<'m> + ?Sized>(
        &mut self,
        params: &mut P,
        grads: &Gradients<'_>,
    ) -> Result<()>;

    /// The learning rate.
    fn learning_rate(&self) -> f64;

    /// Sets the learning rate (for schedules).
    fn set_learning_rate(&mut self, lr: f64);
}

/// One zeroed state tensor per parameter, in `scope`.
#[track_caller]
pub(crate) fn zeros_like_each<'m>(
    scope: &Scope<'m>,
    params: &(impl Parameters<'m> + ?Sized),
    name: &'static str,
) -> Result<Vec<Tensor<'m>>> {
    let mut shapes = Vec::new();
    params.visit("", &mut |_, p| shapes.push((p.shape().to_vec(), p.dtype())));
    let mut state = Vec::with_capacity(shapes.len());
    // A loop, not a closure, so the creation site recorded for dumps is the optimizer's caller.
    for (shape, dtype) in &shapes {
        state.push(scope.full_dtype(shape, 0.0, *dtype)?.named(name));
    }
    Ok(state)
}

/// Checks that `params` is the set `states` was made for (same count, shapes and dtypes), so that a
/// wrong set is refused before anything is written. It reads through the unnamed visit: building
/// parameter names on every step would allocate for nothing.
pub(crate) fn check_param_set<'m, P: Parameters<'m> + ?Sized>(
    op: &'static str,
    params: &mut P,
    states: &[Tensor<'m>],
) -> Result<()> {
    let (mut count, mut matching) = (0, true);
    for_each_param(params, |i, p| {
        matching &= states
            .get(i)
            .is_some_and(|s| s.shape() == p.shape() && s.dtype() == p.dtype());
        count = i + 1;
        Ok(())
    })?;
    if !matching || count != states.len() {
        return Err(Error::InvalidShape {
            op,
            shape: Vec::new(),
            reason: format!(
                "the optimizer was created for {} parameters and got a different set ({count} \
                 parameters, or other shapes); step it with the model it was created for",
                states.len()
            ),
        });
    }
    Ok(())
}

/// Visits `params` mutably with each one's index.
pub(crate) fn for_each_param<'m, P: Parameters<'m> + ?Sized>(
    params: &mut P,
    mut f: impl FnMut(usize, &mut Tensor<'m>) -> Result<()>,
) -> Result<()> {
    let mut i = 0;
    params.visit_mut(&mut |p| {
        f(i, p)?;
        i += 1;
        Ok(())
    })
}
