//! The pre-norm transformer block (GPT-2's).

use super::params::layer_parts;
use super::{
    Activation, AttentionOptions, Dropout, Init, LayerNorm, Linear, Mode, Module,
    MultiHeadAttention,
};
use crate::autograd::Var;
use crate::error::Result;
use crate::scope::Scope;

/// `x + drop(attn(ln1(x)))`, then `y + drop(fc2(gelu(fc1(ln2(y)))))`, with a hidden width of four
/// times the model width and exact GELU (Radford et al., 2019).
#[derive(Debug)]
pub struct TransformerBlock<'m> {
    /// Normalises the attention's input.
    pub ln1: LayerNorm<'m>,
    /// Self-attention.
    pub attn: MultiHeadAttention<'m>,
    /// Normalises the feed-forward input.
    pub ln2: LayerNorm<'m>,
    /// Width to four times the width.
    pub fc1: Linear<'m>,
    /// Back to the width.
    pub fc2: Linear<'m>,
    dropout: Dropout,
}

impl<'m> TransformerBlock<'m> {
    /// A block of `width` with `heads` heads; `options.dropout` also drops the residual branches.
    ///
    /// # Errors
    /// As for [`MultiHeadAttention::new`].
    #[track_caller]
    pub fn new(
        scope: &Scope<'m>,
        width: usize,
        heads: usize,
        options: AttentionOptions,
        init: Init,
    ) -> Result<TransformerBlock<'m>> {
        Ok(TransformerBlock {
            ln1: LayerNorm::new(scope, width)?,
            attn: MultiHeadAttention::new(scope, width, heads, options, init)?,
            ln2: LayerNorm::new(scope, width)?,
            fc1: Linear::new(scope, width, 4 * width, init)?,
            fc2: Linear::new(scope, 4 * width, width, init)?,
            dropout: Dropout::new(options.dropout)?,
        })
    }
}

impl<'m> Module<'m> for TransformerBlock<'m> {
    fn forward<'t, 's>(&self, x: &Var<'t, 's>, mode: Mode) -> Result<Var<'t, 's>>
    where
        'm: 's,
    {
        let drop = |v: Var<'t, 's>| <Dropout as Module<'m>>::forward(&self.dropout, &v, mode);
        let attended = self.attn.forward(&self.ln1.forward(x, mode)?, mode)?;
        let x = x.add(&drop(attended)?)?;
        let hidden = self.fc1.forward(&self.ln2.forward(&x, mode)?, mode)?;
        let hidden = <Activation as Module<'m>>::forward(&Activation::GeluExact, &hidden, mode)?;
        x.add(&drop(self.fc2.forward(&hidden, mode)?)?)
    }
}

layer_parts!(TransformerBlock {
    tensors: [],
    layers: [ln1, attn, ln2, fc1, fc2],
    plain: [dropout]
});
