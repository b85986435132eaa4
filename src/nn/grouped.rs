//! The Llama family's two sublayers: grouped-query self-attention with rotary positions, and the
//! gated (SwiGLU) MLP. Both name their projections as transformers does (`q_proj`, ..., `down_proj`),
//! so a model's parameter paths are the checkpoint's.

use super::params::layer_parts;
use super::{Linear, Mode, Module, RotaryEmbedding};
use crate::autograd::Var;
use crate::error::{Error, Result};
use crate::kv::KvStep;
use crate::ops::{AttentionSpec, Causal};
use crate::tensor::Tensor;

/// Causal self-attention where `heads` query heads share `kv_heads` key and value heads (query
/// head `h` reads key and value head `h / (heads / kv_heads)`: Ainslie et al., 2023), queries and
/// keys turned by a [`RotaryEmbedding`] at each token's position, optionally within a sliding
/// window ([`with_window`](Self::with_window)). `kv_heads == heads` is plain
/// multi-head attention, `kv_heads == 1` multi-query attention. No key or value head is copied per
/// query head, in the fused and in the cached path alike.
///
/// ```
/// use ndscope::nn::{GroupedQueryAttention, Init, Linear, Mode, RopeScaling, RotaryEmbedding};
/// use ndscope::{DType, Device, Tape, root};
///
/// root(Device::Cpu, |m| {
///     let (width, heads, kv_heads, d) = (16, 4, 2, 4);
///     let linear = |i, o| Linear::new(m, i, o, Init::XavierUniform);
///     let attn = GroupedQueryAttention::from_parts(
///         linear(width, heads * d)?,
///         linear(width, kv_heads * d)?,
///         linear(width, kv_heads * d)?,
///         linear(heads * d, width)?,
///         heads,
///         kv_heads,
///     )?;
///     let rope = RotaryEmbedding::new(m, d, 32, 10_000.0, &RopeScaling::None, DType::F32)?;
///     m.scope(|b| {
///         let tape = Tape::new(b);
///         let x = tape.constant(&b.randn(&[2, 5, width])?); // [batch, len, width]
///         let positions = b.from_slice(&[0i64, 1, 2, 3, 4, 0, 1, 2, 3, 4], &[10])?;
///         let y = attn.forward(&x, &rope, &positions, Mode::Train)?;
///         assert_eq!(y.shape(), &[2, 5, width]);
///         Ok::<_, ndscope::Error>(())
///     })
/// })?;
/// # Ok::<(), ndscope::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct GroupedQueryAttention<'m> {
    /// The width to the query heads, `heads · head_dim`.
    pub q_proj: Linear<'m>,
    /// The width to the key heads, `kv_heads · head_dim`.
    pub k_proj: Linear<'m>,
    /// The width to the value heads, `kv_heads · head_dim`.
    pub v_proj: Linear<'m>,
    /// The heads' outputs back to the width.
    pub o_proj: Linear<'m>,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    window: Option<usize>,
}

impl<'m> GroupedQueryAttention<'m> {
    /// The attention of its four projections, `heads` query heads over `kv_heads` key and value
    /// heads; the head width is `q_proj`'s outputs over `heads`.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] unless `heads` is a positive multiple of `kv_heads`, `q_proj` maps
    /// the width to `heads · head_dim`, `k_proj` and `v_proj` to `kv_heads · head_dim`, and `o_proj`
    /// `heads · head_dim` back to the width.
    pub fn from_parts(
        q_proj: Linear<'m>,
        k_proj: Linear<'m>,
        v_proj: Linear<'m>,
        o_proj: Linear<'m>,
        heads: usize,
        kv_heads: usize,
    ) -> Result<GroupedQueryAttention<'m>> {
        let width = q_proj.in_features();
        let grouped = heads > 0 && kv_heads > 0 && heads.is_multiple_of(kv_heads);
        let head_dim = q_proj.out_features().checked_div(heads).unwrap_or(0);
        let fits = grouped
            && head_dim > 0
            && q_proj.out_features() == heads * head_dim
            && [&k_proj, &v_proj]
                .iter()
                .all(|l| l.in_features() == width && l.out_features() == kv_heads * head_dim)
            && o_proj.in_features() == heads * head_dim
            && o_proj.out_features() == width;
        if !fits {
            return Err(Error::InvalidShape {
                op: "GroupedQueryAttention::from_parts",
                shape: [&q_proj, &k_proj, &v_proj, &o_proj]
                    .iter()
                    .flat_map(|l| [l.in_features(), l.out_features()])
                    .collect(),
                reason: format!(
                    "needs {heads} query heads a positive multiple of {kv_heads} key and value \
                     heads, q_proj mapping the width to heads · head_dim, k_proj and v_proj to \
                     kv_heads · head_dim, o_proj heads · head_dim back to the width"
                ),
            });
        }
        Ok(GroupedQueryAttention {
            q_proj,
            k_proj,
            v_proj,
            o_proj,
            heads,
            kv_heads,
            head_dim,
            window: None,
        })
    }

    /// The same attention with each query seeing at most the last `window` positions, itself
    /// included (Mistral's sliding window; `None`: every earlier position).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a window of 0.
    pub fn with_window(mut self, window: Option<usize>) -> Result<GroupedQueryAttention<'m>> {
        if window == Some(0) {
            return Err(Error::InvalidArgument {
                op: "GroupedQueryAttention::with_window",
                reason: "a sliding window of 0 positions leaves every query nothing to see; give \
                         at least 1, or None for no window"
                    .into(),
            });
        }
        self.window = window;
        Ok(self)
    }

    /// The sliding window, if any.
    pub fn window(&self) -> Option<usize> {
        self.window
    }

    /// The query heads.
    pub fn heads(&self) -> usize {
        self.heads
    }

    /// The key and value heads.
    pub fn kv_heads(&self) -> usize {
        self.kv_heads
    }

    /// The width of one head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Causal attention of `x` (`[batch, len, width]`) to itself, the token at `[b, i]` turned to
    /// `positions[b · len + i]` (`[batch · len]`, `i64`), scores scaled by `1 / sqrt(head_dim)`.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] unless `x` is `[batch, len, width]` and `positions` `[batch · len]`;
    /// as for [`RotaryEmbedding::apply`].
    #[track_caller]
    pub fn forward<'t, 's, 'r>(
        &self,
        x: &Var<'t, 's>,
        rope: &RotaryEmbedding<'r>,
        positions: &Tensor<'s>,
        mode: Mode,
    ) -> Result<Var<'t, 's>>
    where
        'm: 's,
        'r: 's,
    {
        let &[batch, len, _] = x.shape() else {
            return Err(self.wrong_input(
                "GroupedQueryAttention::forward",
                x,
                "[batch, len, width]",
            ));
        };
        self.check_width("GroupedQueryAttention::forward", x)?;
        let d = self.head_dim;
        // [batch, len, n · d] -> rotated [batch · len, n, d] -> [batch, n, len, d].
        let heads_of = |y: Var<'t, 's>, n: usize, rotate: bool| -> Result<Var<'t, 's>> {
            let y = y.reshape(&[batch * len, n, d])?;
            let y = if rotate {
                rope.apply(&y, positions)?
            } else {
                y
            };
            y.reshape(&[batch, len, n, d])?.permute(&[0, 2, 1, 3])
        };
        let q = heads_of(self.q_proj.forward(x, mode)?, self.heads, true)?;
        let k = heads_of(self.k_proj.forward(x, mode)?, self.kv_heads, true)?;
        let v = heads_of(self.v_proj.forward(x, mode)?, self.kv_heads, false)?;
        let spec = AttentionSpec {
            causal: Causal::TopLeft,
            scale: None,
            window: self.window,
        };
        let attended = q
            .attention(&k, &v, spec, None)?
            .permute(&[0, 2, 1, 3])?
            .reshape(&[batch, len, self.heads * d])?;
        self.o_proj.forward(&attended, mode)
    }

    /// The cached path: attention of packed new tokens `x` (`[rows, width]`, sequence after
    /// sequence as `kv` counts them) at `positions` (`[rows]`) to their sequences' cached tokens
    /// and to themselves, storing their rotated keys and their values — the key and value heads
    /// only — as layer `layer` of `kv`'s caches. Equal to [`forward`](Self::forward) on each whole
    /// sequence, at the new rows. Always evaluation.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] unless `x` is `[rows, width]` with the rows `kv` expects and the
    /// pool holds `kv_heads` heads of `head_dim`; as for [`KvStep::attend_grouped`].
    #[track_caller]
    pub fn forward_paged<'t, 's, 'r>(
        &self,
        x: &Var<'t, 's>,
        rope: &RotaryEmbedding<'r>,
        positions: &Tensor<'s>,
        kv: &mut KvStep<'_, '_>,
        layer: usize,
    ) -> Result<Var<'t, 's>>
    where
        'm: 's,
        'r: 's,
    {
        let &[rows, _] = x.shape() else {
            return Err(self.wrong_input(
                "GroupedQueryAttention::forward_paged",
                x,
                "packed rows [rows, width]",
            ));
        };
        self.check_width("GroupedQueryAttention::forward_paged", x)?;
        let d = self.head_dim;
        let project = |l: &Linear<'m>, n: usize| -> Result<Tensor<'s>> {
            l.forward(x, Mode::Eval)?.value().reshape(&[rows, n, d])
        };
        let (cos, sin) = (rope.cos(), rope.sin());
        let q = project(&self.q_proj, self.heads)?.rotary(cos, sin, positions)?;
        let k = project(&self.k_proj, self.kv_heads)?.rotary(cos, sin, positions)?;
        let v = project(&self.v_proj, self.kv_heads)?;
        let keys_values = Tensor::concat(&[&k.unsqueeze(1)?, &v.unsqueeze(1)?], 1)?;
        let attended = kv
            .attend_in_window(
                layer,
                &q,
                &keys_values,
                1.0 / (d as f64).sqrt(),
                self.window,
            )?
            .reshape(&[rows, self.heads * d])?;
        self.o_proj
            .forward(&x.tape().constant(&attended), Mode::Eval)
    }

    fn check_width(&self, op: &'static str, x: &Var<'_, '_>) -> Result<()> {
        let width = self.q_proj.in_features();
        if x.shape().last() != Some(&width) {
            return Err(self.wrong_input(op, x, "a last dimension of the model width"));
        }
        Ok(())
    }

    fn wrong_input(&self, op: &'static str, x: &Var<'_, '_>, needs: &str) -> Error {
        Error::InvalidShape {
            op,
            shape: x.shape().to_vec(),
            reason: format!("needs {needs} (width {})", self.q_proj.in_features()),
        }
    }
}

layer_parts!(GroupedQueryAttention {
    tensors: [],
    layers: [q_proj, k_proj, v_proj, o_proj],
    plain: [heads, kv_heads, head_dim, window]
});

/// The gated MLP of the Llama family (SwiGLU, Shazeer 2020): `down(silu(gate(x)) · up(x))`, on the
/// last dimension of `x`.
#[derive(Debug, Clone)]
pub struct GatedMlp<'m> {
    /// The width to the hidden width: the gate.
    pub gate_proj: Linear<'m>,
    /// The width to the hidden width: the gated values.
    pub up_proj: Linear<'m>,
    /// The hidden width back to the width.
    pub down_proj: Linear<'m>,
}

impl<'m> GatedMlp<'m> {
    /// The MLP of its three projections.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] unless `gate_proj` and `up_proj` map the width to one hidden width
    /// and `down_proj` maps it back.
    pub fn from_parts(
        gate_proj: Linear<'m>,
        up_proj: Linear<'m>,
        down_proj: Linear<'m>,
    ) -> Result<GatedMlp<'m>> {
        let (width, hidden) = (gate_proj.in_features(), gate_proj.out_features());
        if up_proj.in_features() != width
            || up_proj.out_features() != hidden
            || down_proj.in_features() != hidden
            || down_proj.out_features() != width
        {
            return Err(Error::InvalidShape {
                op: "GatedMlp::from_parts",
                shape: [&gate_proj, &up_proj, &down_proj]
                    .iter()
                    .flat_map(|l| [l.in_features(), l.out_features()])
                    .collect(),
                reason: format!(
                    "gate_proj and up_proj must map {width} features to {hidden}, down_proj \
                     {hidden} back to {width}"
                ),
            });
        }
        Ok(GatedMlp {
            gate_proj,
            up_proj,
            down_proj,
        })
    }
}

impl<'m> Module<'m> for GatedMlp<'m> {
    fn forward<'t, 's>(&self, x: &Var<'t, 's>, mode: Mode) -> Result<Var<'t, 's>>
    where
        'm: 's,
    {
        let gated = self
            .gate_proj
            .forward(x, mode)?
            .silu()?
            .mul(&self.up_proj.forward(x, mode)?)?;
        self.down_proj.forward(&gated, mode)
    }
}

layer_parts!(GatedMlp {
    tensors: [],
    layers: [gate_proj, up_proj, down_proj],
    plain: []
});
