//! [`Recomputed`]: any layer, with its intermediates recomputed during the backward pass instead
//! of kept (see [`Var::recompute`]).

use super::{Mode, Module, Parameters};
use crate::autograd::{Segment, Var};
use crate::error::Result;
use crate::scope::{Movable, Scope};
use crate::tensor::Tensor;

/// A layer whose forward pass is recomputed (activation checkpointing, in PyTorch's words): what it computes is the layer's, but the tape keeps
/// only its input, and the backward pass runs it again (one more forward pass of the layer) to get
/// the gradients. Wrap the blocks of a deep model to trade that compute for the memory of their
/// activations. Parameters are the layer's own, under the same names, so optimizers and checkpoint
/// files see no difference.
///
/// ```
/// use ndscope::nn::{AttentionOptions, Recomputed, Init, Mode, Module, TransformerBlock};
/// use ndscope::{Device, Tape, root};
///
/// root(Device::Cpu, |model| {
///     let opts = AttentionOptions { causal: true, dropout: 0.1 };
///     let block = Recomputed::new(TransformerBlock::new(model, 16, 2, opts, Init::Normal(0.02))?);
///     model.scope(|batch| {
///         let tape = Tape::new(batch);
///         let x = tape.constant(&batch.randn(&[1, 8, 16])?);
///         let loss = block.forward(&x, Mode::Train)?.square()?.mean_all()?;
///         let grads = tape.backward(&loss)?; // the block runs again here, same dropout masks
///         assert_eq!(grads.len(), 12);
///         Ok::<_, ndscope::Error>(())
///     })
/// })?;
/// # Ok::<(), ndscope::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct Recomputed<L> {
    layer: L,
}

/// The former name of [`Recomputed`].
#[deprecated(note = "renamed `Recomputed`: \"checkpoint\" names checkpoint files")]
pub type Checkpointed<L> = Recomputed<L>;

impl<L> Recomputed<L> {
    /// `layer`, recomputed in the backward pass.
    pub fn new(layer: L) -> Recomputed<L> {
        Recomputed { layer }
    }

    /// The layer.
    pub fn inner(&self) -> &L {
        &self.layer
    }

    /// The layer, mutably (to load or update its parameters).
    pub fn inner_mut(&mut self) -> &mut L {
        &mut self.layer
    }

    /// The layer, no longer recomputed.
    pub fn into_inner(self) -> L {
        self.layer
    }
}

/// A layer and the mode it runs in: the segment a `Recomputed` layer runs again.
struct InMode<L> {
    layer: L,
    mode: Mode,
}

impl<'m, L: Module<'m>> Segment<'m> for InMode<L> {
    fn forward<'t, 's>(&self, x: &Var<'t, 's>) -> Result<Var<'t, 's>>
    where
        'm: 's,
    {
        self.layer.forward(x, self.mode)
    }
}

impl<'m, L: Module<'m> + Clone + 'm> Module<'m> for Recomputed<L> {
    fn forward<'t, 's>(&self, x: &Var<'t, 's>, mode: Mode) -> Result<Var<'t, 's>>
    where
        'm: 's,
    {
        // A clone of a layer is a set of counted handles to the same parameters: the backward pass
        // owns one until it has recomputed the layer.
        x.recompute(InMode {
            layer: self.layer.clone(),
            mode,
        })
    }
}

impl<'m, L: Parameters<'m>> Parameters<'m> for Recomputed<L> {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor<'m>)) {
        self.layer.visit(prefix, f);
    }

    fn visit_mut(&mut self, f: &mut dyn FnMut(&mut Tensor<'m>) -> Result<()>) -> Result<()> {
        self.layer.visit_mut(f)
    }
}

impl<'m, L: Movable<'m>> Movable<'m> for Recomputed<L> {
    type Moved<'b> = Recomputed<L::Moved<'b>>;
    fn move_into<'b>(self, target: &Scope<'b>) -> Result<Recomputed<L::Moved<'b>>> {
        Ok(Recomputed {
            layer: self.layer.move_into(target)?,
        })
    }
}
