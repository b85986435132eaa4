//! The pre-norm transformer block (GPT-2's arrangement), configurable to match a checkpoint.

use super::params::layer_parts;
use super::{
    Activation, AttentionOptions, Dropout, Init, LayerNorm, Linear, Mode, Module,
    MultiHeadAttention, WeightLayout,
};
use crate::autograd::Var;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::kv::KvStep;
use crate::scope::Scope;
use crate::weights::Weights;

/// What a [`TransformerBlock`] computes: its widths, activation, normalisation and the layout of
/// its projections.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TransformerConfig {
    /// The model width.
    pub width: usize,
    /// Attention heads (dividing the width).
    pub heads: usize,
    /// The feed-forward layer's hidden width.
    pub hidden: usize,
    /// The feed-forward activation.
    pub activation: Activation,
    /// What the layer norms add to the variance.
    pub norm_eps: f64,
    /// Whether the projections and layer norms have biases.
    pub bias: bool,
    /// How the projections' weights are stored.
    pub layout: WeightLayout,
    /// Causal masking, and the dropout of the attention weights and of the residual branches.
    pub attention: AttentionOptions,
}

impl TransformerConfig {
    /// ndscope's default block of `width` and `heads`: hidden width `4 width`, exact GELU,
    /// eps `1e-5`, biases, PyTorch's `[out, in]` weights, no mask, no dropout.
    pub fn new(width: usize, heads: usize) -> TransformerConfig {
        TransformerConfig {
            width,
            heads,
            hidden: 4 * width,
            activation: Activation::GeluExact,
            norm_eps: 1e-5,
            bias: true,
            layout: WeightLayout::OutIn,
            attention: AttentionOptions {
                causal: false,
                dropout: 0.0,
            },
        }
    }

    /// GPT-2's block (Radford et al., 2019, as Hugging Face's `GPT2Block` computes it): causal
    /// attention, hidden width `4 width`, GELU's tanh approximation (`gelu_new`), eps `1e-5`,
    /// biases, and `Conv1D` projections stored `[in, out]`.
    pub fn gpt2(width: usize, heads: usize) -> TransformerConfig {
        TransformerConfig {
            activation: Activation::Gelu,
            layout: WeightLayout::InOut,
            attention: AttentionOptions {
                causal: true,
                dropout: 0.0,
            },
            ..TransformerConfig::new(width, heads)
        }
    }
}

/// `x + drop(attn(ln1(x)))`, then `y + drop(fc2(act(fc1(ln2(y)))))`: the pre-norm block. With
/// [`TransformerConfig::gpt2`] it is GPT-2's block; [`new`](Self::new) keeps ndscope's default
/// (exact GELU, `[out, in]` weights).
#[derive(Debug, Clone)]
pub struct TransformerBlock<'m> {
    /// Normalises the attention's input.
    pub ln1: LayerNorm<'m>,
    /// Self-attention.
    pub attn: MultiHeadAttention<'m>,
    /// Normalises the feed-forward input.
    pub ln2: LayerNorm<'m>,
    /// Width to the hidden width.
    pub fc1: Linear<'m>,
    /// Back to the width.
    pub fc2: Linear<'m>,
    activation: Activation,
    dropout: Dropout,
}

impl<'m> TransformerBlock<'m> {
    /// A block of `width` with `heads` heads, [`TransformerConfig::new`]'s defaults otherwise;
    /// `options.dropout` also drops the residual branches.
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
        let config = TransformerConfig {
            attention: options,
            ..TransformerConfig::new(width, heads)
        };
        TransformerBlock::with_config(scope, &config, init)
    }

    /// A block computing `config`, its weights drawn with `init`.
    ///
    /// # Errors
    /// As for [`MultiHeadAttention::new`]; [`Error::InvalidShape`] for a zero hidden width or a
    /// bad eps.
    #[track_caller]
    pub fn with_config(
        scope: &Scope<'m>,
        config: &TransformerConfig,
        init: Init,
    ) -> Result<TransformerBlock<'m>> {
        let c = config;
        let linear =
            |inputs, outputs| Linear::with_layout(scope, inputs, outputs, c.bias, c.layout, init);
        let norm = || LayerNorm::with_options(scope, c.width, c.norm_eps, c.bias);
        let attn = MultiHeadAttention::from_parts(
            linear(c.width, 3 * c.width)?,
            linear(c.width, c.width)?,
            c.heads,
            c.attention,
        )?;
        TransformerBlock::from_parts(
            config,
            [norm()?, norm()?],
            attn,
            [linear(c.width, c.hidden)?, linear(c.hidden, c.width)?],
        )
    }

    /// A block computing `config` loaded from `weights` under the block's own names (`ln1`,
    /// `attn.qkv`, `attn.proj`, `ln2`, `fc1`, `fc2`, each with `weight` and `bias`): give a
    /// checkpoint's names with [`Weights::renamed`].
    ///
    /// # Errors
    /// [`Error::MissingTensor`], [`Error::TensorMismatch`]; as for [`with_config`](Self::with_config).
    #[track_caller]
    pub fn load(
        scope: &Scope<'m>,
        weights: &Weights,
        config: &TransformerConfig,
        dtype: DType,
    ) -> Result<TransformerBlock<'m>> {
        TransformerBlock::load_keeping_blocks(scope, weights, config, dtype, false)
    }

    /// Whether some matrix of the block is block-quantized ([`Linear::from_quantized`]).
    pub(crate) fn holds_quantized_weights(&self) -> bool {
        [&self.attn.qkv, &self.attn.proj, &self.fc1, &self.fc2]
            .iter()
            .any(|l| l.quantized_weight().is_some())
    }

    /// [`load`](Self::load), keeping the matrices stored block-quantized in their blocks if
    /// `keep_blocks` (see [`Linear::from_quantized`]).
    #[track_caller]
    pub(crate) fn load_keeping_blocks(
        scope: &Scope<'m>,
        weights: &Weights,
        config: &TransformerConfig,
        dtype: DType,
        keep_blocks: bool,
    ) -> Result<TransformerBlock<'m>> {
        let c = config;
        let linear = |name: &str, inputs, outputs| {
            let w = weights.prefix(name);
            Linear::load_keeping_blocks(
                scope,
                &w,
                inputs,
                outputs,
                c.bias,
                c.layout,
                dtype,
                keep_blocks,
            )
        };
        let norm = |name: &str| {
            LayerNorm::load(
                scope,
                &weights.prefix(name),
                c.width,
                c.norm_eps,
                c.bias,
                dtype,
            )
        };
        let attn = MultiHeadAttention::from_parts(
            linear("attn.qkv", c.width, 3 * c.width)?,
            linear("attn.proj", c.width, c.width)?,
            c.heads,
            c.attention,
        )?;
        TransformerBlock::from_parts(
            config,
            [norm("ln1")?, norm("ln2")?],
            attn,
            [
                linear("fc1", c.width, c.hidden)?,
                linear("fc2", c.hidden, c.width)?,
            ],
        )
    }

    fn from_parts(
        config: &TransformerConfig,
        [ln1, ln2]: [LayerNorm<'m>; 2],
        attn: MultiHeadAttention<'m>,
        [fc1, fc2]: [Linear<'m>; 2],
    ) -> Result<TransformerBlock<'m>> {
        if config.hidden == 0 {
            return Err(Error::InvalidShape {
                op: "TransformerBlock",
                shape: vec![config.width, config.hidden],
                reason: "the feed-forward layer needs a hidden width of at least 1".into(),
            });
        }
        Ok(TransformerBlock {
            ln1,
            attn,
            ln2,
            fc1,
            fc2,
            activation: config.activation,
            dropout: Dropout::new(config.attention.dropout)?,
        })
    }

    /// The feed-forward activation.
    pub fn activation(&self) -> Activation {
        self.activation
    }
}

impl<'m> TransformerBlock<'m> {
    /// The block with its attention computed by `attend`, from the normalised input to the
    /// attention's output (before the residual dropout): decoding against a KV cache swaps in
    /// attention that reads the cache, and keeps the rest of the block.
    ///
    /// # Errors
    /// What `attend` returns; as for [`forward`](Module::forward).
    pub fn forward_with<'t, 's>(
        &self,
        x: &Var<'t, 's>,
        mode: Mode,
        attend: impl FnOnce(&Var<'t, 's>) -> Result<Var<'t, 's>>,
    ) -> Result<Var<'t, 's>>
    where
        'm: 's,
    {
        let drop = |v: Var<'t, 's>| <Dropout as Module<'m>>::forward(&self.dropout, &v, mode);
        let attended = attend(&self.ln1.forward(x, mode)?)?;
        let x = x.add(&drop(attended)?)?;
        let hidden = self.fc1.forward(&self.ln2.forward(&x, mode)?, mode)?;
        let hidden = <Activation as Module<'m>>::forward(&self.activation, &hidden, mode)?;
        x.add(&drop(self.fc2.forward(&hidden, mode)?)?)
    }
}

impl<'m> TransformerBlock<'m> {
    /// The cached path: the block over packed new tokens `x` (`[rows, width]`), its attention
    /// reading and filling layer `layer` of `kv`'s caches
    /// ([`MultiHeadAttention::forward_paged`]). Always evaluation.
    ///
    /// # Errors
    /// As for [`MultiHeadAttention::forward_paged`].
    #[track_caller]
    pub fn forward_paged<'t, 's>(
        &self,
        x: &Var<'t, 's>,
        kv: &mut KvStep<'_, '_>,
        layer: usize,
    ) -> Result<Var<'t, 's>>
    where
        'm: 's,
    {
        self.forward_with(x, Mode::Eval, |normed| {
            self.attn.forward_paged(normed, kv, layer)
        })
    }
}

impl<'m> Module<'m> for TransformerBlock<'m> {
    fn forward<'t, 's>(&self, x: &Var<'t, 's>, mode: Mode) -> Result<Var<'t, 's>>
    where
        'm: 's,
    {
        self.forward_with(x, mode, |normed| self.attn.forward(normed, mode))
    }
}

layer_parts!(TransformerBlock {
    tensors: [],
    layers: [ln1, attn, ln2, fc1, fc2],
    plain: [activation, dropout]
});
