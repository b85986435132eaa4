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

mod accumulate;
mod adam;
mod loss_scale;
mod schedule;
mod sgd;

pub use accumulate::GradientAccumulator;
pub use adam::{Adam, AdamConfig};
pub use loss_scale::LossScaler;
pub use schedule::{Constant, Schedule, WarmupCosine};
pub use sgd::{Sgd, SgdConfig};

use crate::autograd::Gradients;
use crate::error::{Error, Result};
use crate::nn::Parameters;
use crate::scope::Scope;
use crate::tensor::Tensor;

/// Updates parameters from gradients.
pub trait Optimizer<'m> {
    /// Applies one update to every parameter of `params` that is not frozen. `params` must be the set
    /// (same parameters, same order) the optimizer was created for, and `grads` must hold a gradient
    /// for every parameter that is not frozen: gradients of another model, or of a loss that does not
    /// use a parameter, are refused before anything is written. Freeze the parameters a step should
    /// leave alone with [`freeze`](Self::freeze).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `params` is not the set the optimizer was created for;
    /// [`Error::MissingGradient`] naming the first parameter without a gradient; shape or dtype
    /// mismatches between a parameter and its gradient.
    fn step<P: Parameters<'m> + ?Sized>(
        &mut self,
        params: &mut P,
        grads: &Gradients<'_>,
    ) -> Result<()>;

    /// Leaves the parameter named `name` (its [`Parameters::visit`] path, e.g. `0.weight`) unchanged
    /// by later steps, which then need no gradient for it; `frozen = false` updates it again.
    ///
    /// ```
    /// use ndscope::nn::{self, Activation, Init, Mode, Module, Parameters};
    /// use ndscope::optim::{Optimizer, Sgd, SgdConfig};
    /// use ndscope::{Device, Tape, root};
    ///
    /// root(Device::Cpu, |m| {
    ///     let mut model = nn::mlp(m, &[2, 4, 2], Activation::Relu, Init::XavierUniform)?;
    ///     let weight = |model: &nn::Sequential<'_>| {
    ///         let mut w = Vec::new();
    ///         model.visit("", &mut |name, p| if name == "0.weight" { w = p.to_vec_f64().unwrap() });
    ///         w
    ///     };
    ///     let mut opt = Sgd::new(m, &model, SgdConfig::new(0.1))?;
    ///     opt.freeze(&model, "0.weight", true)?;
    ///     let before = weight(&model);
    ///     m.scope(|b| {
    ///         let tape = Tape::new(b);
    ///         let x = tape.constant(&b.randn(&[3, 2])?);
    ///         let labels = b.from_slice(&[0i64, 1, 0], &[3])?;
    ///         let loss = model.forward(&x, Mode::Train)?.cross_entropy(&labels)?;
    ///         opt.step(&mut model, &tape.backward(&loss)?)
    ///     })?;
    ///     assert_eq!(weight(&model), before); // the frozen weight did not move
    ///     assert!(opt.freeze(&model, "9.weight", true).is_err()); // no such parameter
    ///     Ok::<_, ndscope::Error>(())
    /// })?;
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `params` has no parameter of that name.
    fn freeze<P: Parameters<'m> + ?Sized>(
        &mut self,
        params: &P,
        name: &str,
        frozen: bool,
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
    params.visit("", &mut |path, p| {
        shapes.push((p.shape().to_vec(), p.dtype(), path.to_string()))
    });
    let mut state = Vec::with_capacity(shapes.len());
    // A loop, not a closure, so the creation site recorded for dumps is the optimizer's caller.
    for (shape, dtype, path) in &shapes {
        // "adam.m of 0.weight": which parameter a state tensor serves (a path per parameter, kept
        // once for the process); a nameless parameter leaves the optimizer's own name.
        let t = scope.full_dtype(shape, 0.0, *dtype)?;
        state.push(if path.is_empty() {
            t.named(name)
        } else {
            t.named_path(&format!("{name} of {path}"))
        });
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
        return Err(Error::InvalidArgument {
            op,
            reason: format!(
                "the optimizer was created for {} parameters and got a different set ({count} \
                 parameters, or other shapes); step it with the model it was created for",
                states.len()
            ),
        });
    }
    Ok(())
}

/// Which parameters (by index in visit order) an optimizer leaves alone.
#[derive(Debug, Clone, Default)]
pub(crate) struct Frozen(Vec<bool>);

impl Frozen {
    /// Sets whether the parameter named `name` is frozen.
    pub(crate) fn set<'m, P: Parameters<'m> + ?Sized>(
        &mut self,
        op: &'static str,
        params: &P,
        name: &str,
        frozen: bool,
    ) -> Result<()> {
        let (mut found, mut count) = (None, 0);
        params.visit("", &mut |path, _| {
            if path == name {
                found = Some(count);
            }
            count += 1;
        });
        let index = found.ok_or_else(|| Error::InvalidArgument {
            op,
            reason: format!(
                "the model has no parameter named `{name}`; names are `Parameters::visit` paths \
                 such as `0.weight`"
            ),
        })?;
        if self.0.len() < count {
            self.0.resize(count, false);
        }
        self.0[index] = frozen;
        Ok(())
    }

    /// Whether parameter `i` is frozen.
    pub(crate) fn contains(&self, i: usize) -> bool {
        self.0.get(i).copied().unwrap_or(false)
    }

    /// Checks, before anything is written, that `grads` holds a gradient for every parameter that is
    /// not frozen; the error names the first that has none. Names are built only for the error: the
    /// check itself goes through the unnamed visit, which allocates nothing.
    pub(crate) fn check_gradients<'m, P: Parameters<'m> + ?Sized>(
        &self,
        op: &'static str,
        params: &mut P,
        grads: &Gradients<'_>,
    ) -> Result<()> {
        let mut missing = None;
        for_each_param(params, |i, p| {
            if missing.is_none() && !self.contains(i) && grads.get(p).is_none() {
                missing = Some(i);
            }
            Ok(())
        })?;
        let Some(index) = missing else {
            return Ok(());
        };
        let (mut parameter, mut i) = (String::new(), 0);
        params.visit("", &mut |path, _| {
            if i == index {
                parameter = path.to_string();
            }
            i += 1;
        });
        Err(Error::MissingGradient { op, parameter })
    }
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
