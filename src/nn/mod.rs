//! Neural-network building blocks whose parameters live in a model scope: [`Linear`], activations,
//! [`Dropout`], [`Sequential`], losses and initialisers.
//!
//! A layer holds `Tensor<'m>` parameters, so a batch's activations, logits or loss (branded with the
//! shorter batch lifetime) cannot be stored in it: the compiler refuses. A whole model moves between
//! scopes with one [`Movable::move_into`](crate::Movable::move_into) (or `ret`) call.
//!
//! ```
//! use ndscope::nn::{self, Activation, Init, Mode, Module};
//! use ndscope::{Device, Tape, root};
//!
//! root(Device::Cpu, |model_scope| {
//!     let model = nn::mlp(model_scope, &[4, 8, 3], Activation::Relu, Init::KaimingUniform)?;
//!     let loss = model_scope.scope(|batch| {
//!         let tape = Tape::new(batch);
//!         let x = tape.constant(&batch.randn(&[2, 4])?);
//!         let labels = batch.from_slice(&[0i64, 2], &[2])?;
//!         let loss = model.forward(&x, Mode::Train)?.cross_entropy(&labels)?;
//!         loss.value().to_scalar::<f32>()
//!     })?;
//!     assert!(loss > 0.0);
//!     Ok::<_, ndscope::Error>(())
//! })?;
//! # Ok::<(), ndscope::Error>(())
//! ```

mod attention;
mod batch_norm;
mod conv;
mod embedding;
mod given;
mod grouped;
mod init;
mod layers;
mod linear;
mod model;
mod norm;
mod params;
mod recomputed;
mod rotary;
mod transformer;

pub use attention::{Attended, AttentionOptions, MultiHeadAttention, scaled_dot_product_attention};
pub use batch_norm::BatchNorm2d;
pub use conv::{Conv2d, Pool2d, PoolKind};
pub use embedding::{Embedding, PositionalEmbedding};
pub use grouped::{GatedMlp, GroupedQueryAttention};
pub use init::Init;
pub use layers::{Activation, Dropout, Layer, Sequential, mlp};
pub use linear::{Linear, WeightLayout};
pub use norm::{LayerNorm, RmsNorm};
pub use params::Parameters;
pub(crate) use params::layer_parts;
#[allow(deprecated)]
pub use recomputed::{Checkpointed, Recomputed};
pub use rotary::{RopeScaling, RotaryEmbedding, dynamic_theta, inverse_frequencies};
pub use transformer::{TransformerBlock, TransformerConfig};

pub use crate::autograd::{CrossEntropy, Reduction};

use crate::autograd::Var;
use crate::error::Result;

/// Whether a forward pass trains (dropout active) or evaluates (dropout off).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Training: dropout drops.
    Train,
    /// Evaluation: dropout passes values through.
    Eval,
}

/// A differentiable function with parameters in a scope `'m` that outlives every batch `'s` it is
/// applied in.
pub trait Module<'m> {
    /// Applies the module to `x`, recording on `x`'s tape.
    ///
    /// # Errors
    /// Shape or dtype mismatches between `x` and the parameters; allocation errors.
    fn forward<'t, 's>(&self, x: &Var<'t, 's>, mode: Mode) -> Result<Var<'t, 's>>
    where
        'm: 's;
}

/// Mean cross-entropy of `logits` (`[..., classes]`) against `i64` class labels (`[...]`); see
/// [`Var::cross_entropy_with`] for `ignore_index`, reductions and label smoothing.
///
/// # Errors
/// As for [`Var::cross_entropy`].
pub fn cross_entropy<'t, 's>(
    logits: &Var<'t, 's>,
    labels: &crate::Tensor<'s>,
) -> Result<Var<'t, 's>> {
    logits.cross_entropy(labels)
}

/// Mean squared error between `prediction` and `target` (broadcasting).
///
/// # Errors
/// Shape, dtype or tape mismatches.
pub fn mse<'t, 's>(prediction: &Var<'t, 's>, target: &Var<'t, 's>) -> Result<Var<'t, 's>> {
    // Under autocast the loss is computed in f32 (a 16-bit input is widened first).
    if let Some(p) = prediction.autocast_f32()? {
        return mse(&p, target);
    }
    if let Some(t) = target.autocast_f32()? {
        return mse(prediction, &t);
    }
    prediction.sub(target)?.square()?.mean_all()
}
