//! Fused scaled dot-product attention: `softmax(scale · q kᵀ) v` with its mask applied inside the
//! kernel, computed tile by tile so that no `[queries, keys]` tensor is made (the math is stated once,
//! in `backend::op::Attention`).

use std::panic::Location;

use super::{same_device, same_dtype};
use crate::backend::AttentionInputs;
use crate::backend::op::Attention;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::ops::require_float;
use crate::tensor::Tensor;

/// Which keys each query sees in [`Tensor::attention`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Causal {
    /// Every query sees every key.
    #[default]
    None,
    /// Query `i` sees keys `j <= i`: a decoder over one sequence (PyTorch's `is_causal`, aligned at
    /// the top left).
    TopLeft,
    /// The queries are the last of the keys' positions: query `i` sees keys `j <= i + keys -
    /// queries` (decoding new tokens against a cache of earlier ones). The same as `TopLeft` when
    /// there are as many queries as keys.
    BottomRight,
}

/// What [`Tensor::attention`] computes beyond `softmax(q kᵀ / sqrt(width)) v`.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct AttentionSpec {
    /// The causal mask, if any.
    pub causal: Causal,
    /// Multiplies every score; `None` is `1 / sqrt(width)`.
    pub scale: Option<f64>,
    /// With a causal mask, the most keys a query sees, itself included: a sliding window
    /// (Mistral's `sliding_window`; transformers' mask keeps keys `j > i - window`). `None`: every
    /// key the causal mask allows.
    pub window: Option<usize>,
}

impl AttentionSpec {
    /// Causal attention over one sequence (queries and keys at the same positions).
    pub const CAUSAL: AttentionSpec = AttentionSpec {
        causal: Causal::TopLeft,
        scale: None,
        window: None,
    };
}

/// The operands' shapes as `[batch, heads, len, width]`, from rank 2 (`[len, width]`), rank 3
/// (`[batch, len, width]`) or rank 4.
fn as_heads<'s>(op: &'static str, x: &Tensor<'s>) -> Result<Tensor<'s>> {
    let x = match x.rank() {
        2 => x.unsqueeze(0)?.unsqueeze(0)?,
        3 => x.unsqueeze(1)?,
        4 => x.clone(),
        _ => {
            return Err(Error::InvalidShape {
                op,
                shape: x.shape().to_vec(),
                reason:
                    "queries, keys and values are [len, width], [batch, len, width] or [batch, \
                         heads, len, width]; reshape other leading dimensions into these"
                        .into(),
            });
        }
    };
    // The kernels read each row's elements one after another.
    if x.layout().strides()[3] != 1 && x.shape()[3] > 1 {
        return x.contiguous();
    }
    Ok(x)
}

/// A fresh `[batch, len, heads, width]` tensor of `dtype` near `operands`, and the layout through which
/// the kernels write it as `[batch, heads, len, width]`: the heads of a row side by side, so merging
/// them back into a model width is a view.
fn heads_output<'s>(
    operands: &[&Tensor<'s>],
    dtype: DType,
    [batch, heads, len, width]: [usize; 4],
    at: &'static Location<'static>,
) -> Result<(Tensor<'s>, crate::layout::Layout)> {
    let out = Tensor::output_of(operands, dtype, &[batch, len, heads, width], at)?;
    let layout = out.layout().permuted("attention", &[0, 2, 1, 3])?;
    Ok((out, layout))
}

/// Back to the rank the caller gave.
fn with_rank<'s>(x: Tensor<'s>, rank: usize) -> Result<Tensor<'s>> {
    match rank {
        2 => x.squeeze(0)?.squeeze(0),
        3 => x.squeeze(1),
        _ => Ok(x),
    }
}

fn dims(x: &Tensor<'_>) -> [usize; 4] {
    let s = x.shape();
    [s[0], s[1], s[2], s[3]]
}

/// The checked operands of one attention call.
struct Operands<'s> {
    q: Tensor<'s>,
    k: Tensor<'s>,
    v: Tensor<'s>,
    key_lengths: Option<Tensor<'s>>,
    math: Attention,
    rank: usize,
}

impl<'s> Operands<'s> {
    fn inputs(&self) -> AttentionInputs<'_> {
        AttentionInputs {
            q: self.q.src(),
            k: self.k.src(),
            v: self.v.src(),
            key_lengths: self.key_lengths.as_ref().map(Tensor::src),
        }
    }
}

fn check<'s>(
    q: &Tensor<'s>,
    k: &Tensor<'s>,
    v: &Tensor<'s>,
    spec: AttentionSpec,
    key_lengths: Option<&Tensor<'s>>,
) -> Result<Operands<'s>> {
    const OP: &str = "attention";
    require_float(OP, q)?;
    for x in [k, v] {
        same_dtype(OP, q, x)?;
        same_device(OP, q, x)?;
    }
    let rank = q.rank();
    if k.rank() != rank || v.rank() != rank {
        return Err(Error::ShapeMismatch {
            op: OP,
            lhs: q.shape().to_vec(),
            rhs: if k.rank() != rank { k } else { v }.shape().to_vec(),
            hint: "queries, keys and values need the same rank",
        });
    }
    let (q4, k4, v4) = (as_heads(OP, q)?, as_heads(OP, k)?, as_heads(OP, v)?);
    let ([b, h, queries, d], [kb, kh, keys, kd], [vb, vh, values, _]) =
        (dims(&q4), dims(&k4), dims(&v4));
    // Grouped-query attention: `kh` key heads, each shared by `h / kh` consecutive query heads.
    if [kb, kd] != [b, d] || kh == 0 || !h.is_multiple_of(kh) {
        return Err(Error::ShapeMismatch {
            op: OP,
            lhs: q.shape().to_vec(),
            rhs: k.shape().to_vec(),
            hint: "keys need the queries' batch dimension and width, and a head count that \
                   divides the queries' (grouped-query attention)",
        });
    }
    if [vb, vh, values] != [b, kh, keys] {
        return Err(Error::ShapeMismatch {
            op: OP,
            lhs: k.shape().to_vec(),
            rhs: v.shape().to_vec(),
            hint: "values need the keys' batch and head dimensions and count",
        });
    }
    let scale = spec.scale.unwrap_or(1.0 / (d.max(1) as f64).sqrt());
    if !scale.is_finite() {
        return Err(Error::InvalidShape {
            op: OP,
            shape: q.shape().to_vec(),
            reason: format!("the scale must be finite, got {scale}"),
        });
    }
    let key_lengths = match key_lengths {
        None => None,
        Some(l) => {
            same_device(OP, q, l)?;
            if l.dtype() != DType::I64 || l.shape() != [b] || rank == 2 {
                return Err(Error::InvalidShape {
                    op: OP,
                    shape: l.shape().to_vec(),
                    reason: format!(
                        "key lengths are one i64 per batch ([{b}] of i64), for queries of rank 3 \
                         or 4; got {} {:?}",
                        l.dtype(),
                        l.shape()
                    ),
                });
            }
            Some(l.contiguous()?)
        }
    };
    let causal = match spec.causal {
        Causal::None => None,
        Causal::TopLeft => Some(0),
        Causal::BottomRight => Some(keys as i64 - queries as i64),
    };
    match (spec.window, causal) {
        (Some(0), _) => {
            return Err(Error::InvalidArgument {
                op: OP,
                reason: "a sliding window of 0 keys leaves every query nothing to see; give at \
                         least 1, or None for no window"
                    .into(),
            });
        }
        (Some(window), None) => {
            return Err(Error::InvalidArgument {
                op: OP,
                reason: format!(
                    "a sliding window ({window}) counts back from each query's position, which \
                     only a causal mask gives; use Causal::TopLeft or BottomRight"
                ),
            });
        }
        _ => {}
    }
    Ok(Operands {
        q: q4,
        k: k4,
        v: v4,
        key_lengths,
        math: Attention {
            scale,
            causal,
            group: h / kh,
            window: spec.window,
        },
        rank,
    })
}

impl<'s> Tensor<'s> {
    /// Scaled dot-product attention of these queries over `k` and `v`, fused: for each query `i`,
    /// `out_i = Σ_j softmax(s)_j v_j` with `s_j = scale · q_i · k_j` over the keys it sees, computed in
    /// tiles with a running maximum (FlashAttention's schedule: Dao et al., 2022) so that no
    /// `[queries, keys]` tensor is made and large scores do not overflow. 16-bit operands are computed
    /// in `f32` and rounded once.
    ///
    /// Shapes: `q` `[..., queries, width]`, `k` `[..., keys, width]`, `v` `[..., keys, value width]`
    /// with the same leading dimensions: none, `[batch]` or `[batch, heads]`. The output is `[...,
    /// queries, value width]`; a rank-4 output is laid out as `[batch, queries, heads, width]`, so
    /// merging its heads (`permute(&[0, 2, 1, 3])` then `reshape`) is a view.
    ///
    /// Masks: `spec.causal` (see [`Causal`]) and, with it, `spec.window` (a sliding window: query `i`
    /// of a top-left mask sees keys `i - window < j <= i`); `key_lengths`, one `i64` per batch, hides the keys at
    /// and after each batch's length (padding; lengths are clamped to `[0, keys]`). A query that
    /// sees no key gets zeros.
    ///
    /// ```
    /// use ndscope::AttentionSpec;
    /// # ndscope::root(ndscope::Device::Cpu, |s| {
    /// let q = s.randn(&[2, 4, 16, 8])?; // batch 2, 4 heads, 16 positions, width 8
    /// let out = q.attention(&q, &q, AttentionSpec::CAUSAL, None)?;
    /// assert_eq!(out.shape(), &[2, 4, 16, 8]);
    /// // The first position sees only itself: its output is its own value.
    /// let first = out.narrow(2, 0, 1)?.to_vec::<f32>()?;
    /// assert_eq!(first, q.narrow(2, 0, 1)?.to_vec::<f32>()?);
    /// # Ok::<_, ndscope::Error>(()) })?; Ok::<(), ndscope::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] for operands whose ranks, leading dimensions, widths or key counts
    /// disagree; [`Error::InvalidShape`] for ranks other than 2 to 4, a scale that is not finite, or
    /// key lengths that are not `i64 [batch]`; [`Error::UnsupportedDType`] for integers;
    /// [`Error::DTypeMismatch`], [`Error::DeviceMismatch`]; allocation errors.
    #[track_caller]
    pub fn attention(
        &self,
        k: &Tensor<'s>,
        v: &Tensor<'s>,
        spec: AttentionSpec,
        key_lengths: Option<&Tensor<'s>>,
    ) -> Result<Tensor<'s>> {
        Ok(self.attention_with_lse(k, v, spec, key_lengths)?.0)
    }

    /// [`attention`](Self::attention) and each query's `ln Σ_j e^(s_j)` (`[batch, heads, queries]`,
    /// `f32`, or `f64` for `f64` operands): what the backward pass recomputes the weights from.
    #[track_caller]
    pub(crate) fn attention_with_lse(
        &self,
        k: &Tensor<'s>,
        v: &Tensor<'s>,
        spec: AttentionSpec,
        key_lengths: Option<&Tensor<'s>>,
    ) -> Result<(Tensor<'s>, Tensor<'s>)> {
        let at = Location::caller();
        let ops = check(self, k, v, spec, key_lengths)?;
        let ([b, h, queries, _], dv) = (dims(&ops.q), ops.v.shape()[3]);
        let dtype = self.dtype();
        let operands = [&ops.q, &ops.k, &ops.v];
        let (mut out, out_layout) = heads_output(&operands, dtype, [b, h, queries, dv], at)?;
        let mut lse = Tensor::output_of(&operands, dtype.compute(), &[b, h, queries], at)?;
        self.backend()?.attention(
            dtype,
            &ops.math,
            ops.inputs(),
            out.dst_as(&out_layout),
            lse.dst(),
        )?;
        let out = with_rank(out.with_layout(out_layout), ops.rank)?;
        Ok((out, lse))
    }

    /// The gradients `[dq, dk, dv]` of [`attention`](Self::attention) (these queries over `k` and
    /// `v`, which gave `out` and `lse`) for the output's gradient `dout`.
    #[track_caller]
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attention_backward(
        &self,
        k: &Tensor<'s>,
        v: &Tensor<'s>,
        out: &Tensor<'s>,
        lse: &Tensor<'s>,
        dout: &Tensor<'s>,
        spec: AttentionSpec,
        key_lengths: Option<&Tensor<'s>>,
    ) -> Result<[Tensor<'s>; 3]> {
        const OP: &str = "attention (backward)";
        let at = Location::caller();
        let ops = check(self, k, v, spec, key_lengths)?;
        let dout = if dout.dtype() == self.dtype() {
            as_heads(OP, dout)?
        } else {
            as_heads(OP, &dout.to_dtype(self.dtype())?)?
        };
        let out = as_heads(OP, out)?;
        let dtype = self.dtype();
        let operands = [&ops.q, &ops.k, &ops.v];
        let (mut dq, dq_layout) = heads_output(&operands, dtype, dims(&ops.q), at)?;
        // With grouped heads every query head gets its own key and value gradients first (the
        // kernels write each once, without atomics); the group's are summed below.
        let group = ops.math.group;
        let per_query_head = |x: &Tensor<'s>| {
            let [b, kh, len, w] = dims(x);
            [b, kh * group, len, w]
        };
        let (mut dk, dk_layout) = heads_output(&operands, dtype, per_query_head(&ops.k), at)?;
        let (mut dv, dv_layout) = heads_output(&operands, dtype, per_query_head(&ops.v), at)?;
        let lse = lse.contiguous()?;
        let mut scratch = Tensor::output_of(&operands, lse.dtype(), lse.shape(), at)?;
        self.backend()?.attention_backward(
            dtype,
            &ops.math,
            ops.inputs(),
            out.src(),
            dout.src(),
            lse.src(),
            scratch.dst(),
            [
                dq.dst_as(&dq_layout),
                dk.dst_as(&dk_layout),
                dv.dst_as(&dv_layout),
            ],
        )?;
        let (dk, dv) = (dk.with_layout(dk_layout), dv.with_layout(dv_layout));
        let (dk, dv) = if group == 1 {
            (dk, dv)
        } else {
            let sum_groups = |g: Tensor<'s>| -> Result<Tensor<'s>> {
                let [b, h, len, w] = dims(&g);
                g.reshape(&[b, h / group, group, len, w])?.sum(&[2], false)
            };
            (sum_groups(dk)?, sum_groups(dv)?)
        };
        Ok([
            with_rank(dq.with_layout(dq_layout), ops.rank)?,
            with_rank(dk, ops.rank)?,
            with_rank(dv, ops.rank)?,
        ])
    }
}
