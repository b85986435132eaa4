//! Scaled dot-product attention and multi-head self-attention.

use std::panic::Location;

use super::params::layer_parts;
use super::{Dropout, Init, Linear, Mode, Module};
use crate::autograd::Var;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::kv::KvStep;
use crate::ops::{AttentionSpec, Causal, Triangle};
use crate::scope::Scope;

/// What attention computed: the output and the attention weights (after the softmax, before
/// dropout). Both are branded with the batch scope: the weights can be plotted or copied to the host,
/// not kept in a model.
#[derive(Debug, Clone)]
pub struct Attended<'t, 's> {
    /// `[..., queries, value width]`.
    pub output: Var<'t, 's>,
    /// `[..., queries, keys]`; each row sums to 1.
    pub weights: Var<'t, 's>,
}

/// How attention masks and drops.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionOptions {
    /// Query `i` attends only to keys `j <= i` (a decoder; PyTorch's `is_causal`, aligned at the
    /// top left).
    pub causal: bool,
    /// Drop probability for the attention weights in training.
    pub dropout: f64,
}

/// `softmax(q kᵀ / sqrt(d)) v` over the last two dimensions, the leading ones broadcast as batches
/// (Vaswani et al., 2017). `q` is `[..., queries, d]`, `k` `[..., keys, d]`, `v` `[..., keys, dv]`.
/// The softmax subtracts each row's maximum, so large scores do not overflow; a causal mask sets
/// the scores of later keys to `-inf` before it (their weights are exactly 0).
///
/// ```
/// use ndscope::nn::{AttentionOptions, Mode, scaled_dot_product_attention};
/// use ndscope::{Device, Tape, root};
///
/// root(Device::Cpu, |s| {
///     let tape = Tape::no_grad(s);
///     let x = tape.constant(&s.randn(&[2, 5, 8])?); // batch 2, 5 positions, width 8
///     let causal = AttentionOptions { causal: true, dropout: 0.0 };
///     let a = scaled_dot_product_attention(&x, &x, &x, causal, Mode::Eval)?;
///     assert_eq!(a.output.shape(), &[2, 5, 8]);
///     let w = a.weights.value().to_vec::<f32>()?;
///     assert_eq!(w[0], 1.0); // the first position sees only itself
///     assert_eq!(w[1], 0.0);
///     Ok::<_, ndscope::Error>(())
/// })?;
/// # Ok::<(), ndscope::Error>(())
/// ```
///
/// # Errors
/// [`Error::ShapeMismatch`] when the widths of `q` and `k` or the key counts of `k` and `v` differ;
/// [`Error::InvalidShape`] for operands of rank below 2 or a drop probability outside `[0, 1)`.
#[track_caller]
pub fn scaled_dot_product_attention<'t, 's>(
    q: &Var<'t, 's>,
    k: &Var<'t, 's>,
    v: &Var<'t, 's>,
    options: AttentionOptions,
    mode: Mode,
) -> Result<Attended<'t, 's>> {
    const OP: &str = "scaled_dot_product_attention";
    let at = Location::caller();
    let dims = |x: &Var<'t, 's>| match *x.shape() {
        [.., rows, cols] => Ok((rows, cols)),
        _ => Err(Error::InvalidShape {
            op: OP,
            shape: x.shape().to_vec(),
            reason: "queries, keys and values need at least two dimensions".into(),
        }),
    };
    let ((queries, d), (keys, dk), (values, _)) = (dims(q)?, dims(k)?, dims(v)?);
    if d != dk || keys != values {
        return Err(Error::ShapeMismatch {
            op: OP,
            lhs: k.shape().to_vec(),
            rhs: if d != dk { q.shape() } else { v.shape() }.to_vec(),
            hint: "queries and keys need the same width, keys and values the same count",
        });
    }
    let dropout = Dropout::new(options.dropout)?;
    let mut scores = q
        .matmul(&k.transpose(-1, -2)?)?
        .mul_scalar(1.0 / (d.max(1) as f64).sqrt())?;
    if options.causal {
        let later =
            scores
                .value()
                .triangle_mask(queries, keys, Triangle::Upper, 1, DType::F32, at)?;
        scores = scores.masked_fill(&later, f64::NEG_INFINITY)?;
    }
    let weights = scores.softmax(-1)?;
    let dropped = <Dropout as Module<'s>>::forward(&dropout, &weights, mode)?;
    Ok(Attended {
        output: dropped.matmul(v)?,
        weights,
    })
}

fn check(width: usize, heads: usize, options: AttentionOptions) -> Result<()> {
    if heads == 0 || width == 0 || !width.is_multiple_of(heads) {
        return Err(Error::InvalidShape {
            op: "MultiHeadAttention",
            shape: vec![width, heads],
            reason: format!(
                "the width ({width}) must be a positive multiple of the heads ({heads})"
            ),
        });
    }
    Dropout::new(options.dropout)?;
    Ok(())
}

/// Multi-head self-attention: one projection to queries, keys and values for every head
/// (`qkv`, `[3 width, width]`), attention per head, and an output projection (`proj`).
#[derive(Debug, Clone)]
pub struct MultiHeadAttention<'m> {
    /// Queries, keys and values of all heads: `[3 width, width]`.
    pub qkv: Linear<'m>,
    /// The heads' outputs back to the model width.
    pub proj: Linear<'m>,
    heads: usize,
    options: AttentionOptions,
}

impl<'m> MultiHeadAttention<'m> {
    /// Attention of `heads` heads over vectors of `width` (a multiple of `heads`).
    ///
    /// # Errors
    /// [`Error::InvalidShape`] when `width` is not a positive multiple of `heads`, or for a drop
    /// probability outside `[0, 1)`; allocation errors.
    #[track_caller]
    pub fn new(
        scope: &Scope<'m>,
        width: usize,
        heads: usize,
        options: AttentionOptions,
        init: Init,
    ) -> Result<MultiHeadAttention<'m>> {
        check(width, heads, options)?;
        MultiHeadAttention::from_parts(
            Linear::new(scope, width, 3 * width, init)?,
            Linear::new(scope, width, width, init)?,
            heads,
            options,
        )
    }

    /// Attention from its two projections: `qkv` maps the width to queries, keys and values (in
    /// that order, each head's columns together, as GPT-2's `c_attn`), `proj` maps the heads'
    /// outputs back to the width.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] unless `qkv` maps `width` to `3 width` and `proj` `width` to
    /// `width` with `width` a positive multiple of `heads`; for a drop probability outside `[0, 1)`.
    pub fn from_parts(
        qkv: Linear<'m>,
        proj: Linear<'m>,
        heads: usize,
        options: AttentionOptions,
    ) -> Result<MultiHeadAttention<'m>> {
        let width = proj.out_features();
        check(width, heads, options)?;
        if qkv.in_features() != width
            || qkv.out_features() != 3 * width
            || proj.in_features() != width
        {
            return Err(Error::InvalidShape {
                op: "MultiHeadAttention::from_parts",
                shape: vec![
                    qkv.in_features(),
                    qkv.out_features(),
                    proj.in_features(),
                    width,
                ],
                reason: format!(
                    "qkv must map {width} features to {} and proj {width} to {width}",
                    3 * width
                ),
            });
        }
        Ok(MultiHeadAttention {
            qkv,
            proj,
            heads,
            options,
        })
    }

    /// The number of heads.
    pub fn heads(&self) -> usize {
        self.heads
    }

    /// Attention of `x` (`[batch, len, width]`) to itself, with the weights of every head
    /// (`[batch, heads, len, len]`): the unfused computation, which makes and keeps those weights.
    /// [`forward`](Module::forward) computes the same output with fused attention.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] unless `x` is `[batch, len, width]`.
    #[track_caller]
    pub fn attend<'t, 's>(&self, x: &Var<'t, 's>, mode: Mode) -> Result<Attended<'t, 's>>
    where
        'm: 's,
    {
        let [q, k, v] = self.split_heads(x, mode)?;
        let attended = scaled_dot_product_attention(&q, &k, &v, self.options, mode)?;
        Ok(Attended {
            output: self.merge_heads(&attended.output, mode)?,
            weights: attended.weights,
        })
    }

    /// The cached path: attention of packed new tokens `x` (`[rows, width]`, sequence after
    /// sequence as `kv` counts them) to their sequences' cached tokens and to themselves, storing
    /// their keys and values as layer `layer` of `kv`'s caches. Equal to [`forward`](Module::forward)
    /// on each whole sequence, at the new rows. Always evaluation: no dropout, no gradient.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a non-causal attention (a cached token cannot see later
    /// ones); [`Error::InvalidShape`] unless `x` is `[rows, width]` with the rows `kv` expects;
    /// as for [`KvStep::attend`].
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
        if !self.options.causal {
            return Err(Error::InvalidArgument {
                op: "MultiHeadAttention::forward_paged",
                reason: "this attention is not causal, and a token decoded against a cache sees \
                         only the tokens before it; build the layer with causal: true"
                    .into(),
            });
        }
        let width = self.proj.out_features();
        let &[rows, w] = x.shape() else {
            return Err(self.wrong_rows(x));
        };
        if w != width {
            return Err(self.wrong_rows(x));
        }
        let head = width / self.heads;
        let qkv = self
            .qkv
            .forward(x, Mode::Eval)?
            .value()
            .reshape(&[rows, 3, self.heads, head])?;
        let attended = kv
            .attend(layer, &qkv, 1.0 / (head as f64).sqrt())?
            .reshape(&[rows, width])?;
        self.proj.forward(&x.tape().constant(&attended), Mode::Eval)
    }

    fn wrong_rows(&self, x: &Var<'_, '_>) -> Error {
        Error::InvalidShape {
            op: "MultiHeadAttention::forward_paged",
            shape: x.shape().to_vec(),
            reason: format!("needs packed rows [rows, {}]", self.proj.out_features()),
        }
    }

    /// Queries, keys and values of every head, `[batch, heads, len, head width]` each: views of one
    /// projection, no copy.
    fn split_heads<'t, 's>(&self, x: &Var<'t, 's>, mode: Mode) -> Result<[Var<'t, 's>; 3]>
    where
        'm: 's,
    {
        let width = self.proj.out_features();
        let [batch, len, w] = *x.shape() else {
            return Err(self.wrong_input(x));
        };
        if w != width {
            return Err(self.wrong_input(x));
        }
        let head = width / self.heads;
        // [batch, len, 3, heads, head] -> [3, batch, heads, len, head]: views, no copy.
        let qkv = self
            .qkv
            .forward(x, mode)?
            .reshape(&[batch, len, 3, self.heads, head])?
            .permute(&[2, 0, 3, 1, 4])?;
        let part = |i: usize| qkv.narrow(0, i, 1)?.squeeze(0);
        Ok([part(0)?, part(1)?, part(2)?])
    }

    /// The heads' outputs (`[batch, heads, len, head width]`) side by side, through the output
    /// projection.
    fn merge_heads<'t, 's>(&self, heads: &Var<'t, 's>, mode: Mode) -> Result<Var<'t, 's>>
    where
        'm: 's,
    {
        let [batch, _, len, _] = *heads.shape() else {
            unreachable!("attention keeps the heads' rank")
        };
        let merged =
            heads
                .permute(&[0, 2, 1, 3])?
                .reshape(&[batch, len, self.proj.out_features()])?;
        self.proj.forward(&merged, mode)
    }

    fn wrong_input(&self, x: &Var<'_, '_>) -> Error {
        Error::InvalidShape {
            op: "MultiHeadAttention::forward",
            shape: x.shape().to_vec(),
            reason: format!("needs [batch, len, {}]", self.proj.out_features()),
        }
    }
}

impl<'m> Module<'m> for MultiHeadAttention<'m> {
    fn forward<'t, 's>(&self, x: &Var<'t, 's>, mode: Mode) -> Result<Var<'t, 's>>
    where
        'm: 's,
    {
        let dropping = self.options.dropout > 0.0 && mode == Mode::Train;
        if dropping {
            // Dropout acts on the weights, which only the unfused computation makes.
            return Ok(self.attend(x, mode)?.output);
        }
        let [q, k, v] = self.split_heads(x, mode)?;
        let spec = AttentionSpec {
            causal: if self.options.causal {
                Causal::TopLeft
            } else {
                Causal::None
            },
            scale: None,
            window: None,
        };
        self.merge_heads(&q.attention(&k, &v, spec, None)?, mode)
    }
}

layer_parts!(MultiHeadAttention {
    tensors: [],
    layers: [qkv, proj],
    plain: [heads, options]
});
