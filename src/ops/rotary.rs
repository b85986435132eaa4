//! Rotary position embedding (RoPE; Su et al. 2021, "RoFormer"), in the "rotate half" layout of
//! Llama, Qwen2 and Mistral (transformers' `apply_rotary_pos_emb`).

use std::panic::Location;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::ops::index::{Access, check_indices};
use crate::ops::require_float;
use crate::ops::same_device;
use crate::tensor::Tensor;

impl<'s> Tensor<'s> {
    /// Rotary position embedding. `self` is `[tokens, heads, dim]` (float, `dim` even), `positions`
    /// `i64 [tokens]` (each token's position), and `cos`, `sin` are `[max_positions, dim / 2]` in
    /// the compute dtype (`f64` for `f64`, `f32` for the other floats). For each token `t` at
    /// `p = positions[t]`, head `h` and `i < dim / 2`, with `c = cos[p, i]`, `s = sin[p, i]`:
    ///
    /// ```text
    /// out[t, h, i]         = x[t, h, i] · c − x[t, h, i + dim/2] · s
    /// out[t, h, i + dim/2] = x[t, h, i + dim/2] · c + x[t, h, i] · s
    /// ```
    ///
    /// computed in the compute dtype and rounded once. With `cos[p, i] = cos(p θ_i)` and
    /// `sin[p, i] = sin(p θ_i)` this rotates each plane `(i, i + dim/2)` by `p θ_i`;
    /// [`RotaryEmbedding`](crate::nn::RotaryEmbedding) builds the tables for a model's `θ_i` and
    /// scaling. Positions come per token, so packed rows of different sequences (a decode batch)
    /// each get their own.
    ///
    /// ```
    /// # ndscope::root(ndscope::Device::Cpu, |s| {
    /// let x = s.from_slice(&[1.0f32, 0.0], &[1, 1, 2])?; // one token, one head, dim 2
    /// let angle = std::f32::consts::FRAC_PI_2;
    /// let cos = s.from_slice(&[1.0f32, angle.cos()], &[2, 1])?; // positions 0 and 1
    /// let sin = s.from_slice(&[0.0f32, angle.sin()], &[2, 1])?;
    /// let at_1 = s.from_slice(&[1i64], &[1])?;
    /// let y = x.rotary(&cos, &sin, &at_1)?.to_vec::<f32>()?; // (1, 0) turned by 90°
    /// assert!((y[0] - 0.0).abs() < 1e-6 && (y[1] - 1.0).abs() < 1e-6);
    /// # Ok::<_, ndscope::Error>(()) })?; Ok::<(), ndscope::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidShape`] for another rank, an odd `dim`, tables that are not
    /// `[_, dim / 2]` alike, or positions that are not `[tokens]`; [`Error::UnsupportedDType`] for
    /// an integer `self`, tables not in the compute dtype, or positions that are not `i64`;
    /// [`Error::IndexOutOfRange`] for a position outside the tables; [`Error::DeviceMismatch`].
    #[track_caller]
    pub fn rotary(
        &self,
        cos: &Tensor<'_>,
        sin: &Tensor<'_>,
        positions: &Tensor<'_>,
    ) -> Result<Tensor<'s>> {
        self.rotary_by(cos, sin, positions, false)
    }

    /// [`rotary`](Self::rotary) by the opposite angles: its inverse, and its derivative (the
    /// rotation is orthogonal, so the gradient turns back).
    #[track_caller]
    pub(crate) fn rotary_by(
        &self,
        cos: &Tensor<'_>,
        sin: &Tensor<'_>,
        positions: &Tensor<'_>,
        inverse: bool,
    ) -> Result<Tensor<'s>> {
        const OP: &str = "rotary";
        require_float(OP, self)?;
        let &[tokens, _, dim] = self.shape() else {
            return Err(Error::InvalidShape {
                op: OP,
                shape: self.shape().to_vec(),
                reason: "needs [tokens, heads, head_dim] (reshape [batch, seq, heads, head_dim] \
                         to [batch * seq, heads, head_dim])"
                    .into(),
            });
        };
        if !dim.is_multiple_of(2) {
            return Err(Error::InvalidShape {
                op: OP,
                shape: self.shape().to_vec(),
                reason: format!("head_dim {dim} must be even: rotary pairs its two halves"),
            });
        }
        let table = if self.dtype() == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        for t in [cos, sin] {
            if t.rank() != 2 || t.shape()[1] != dim / 2 || t.shape() != cos.shape() {
                return Err(Error::InvalidShape {
                    op: OP,
                    shape: t.shape().to_vec(),
                    reason: format!(
                        "cos and sin must both be [max_positions, {}] (half of head_dim {dim}); \
                         got {:?} and {:?}",
                        dim / 2,
                        cos.shape(),
                        sin.shape()
                    ),
                });
            }
            if t.dtype() != table {
                return Err(Error::UnsupportedDType {
                    op: OP,
                    dtype: t.dtype(),
                    expected: if table == DType::F64 {
                        "f64 tables for f64 values"
                    } else {
                        "f32 tables (the compute dtype of f32, bf16 and f16 values)"
                    },
                });
            }
            same_device(OP, self, t)?;
        }
        same_device(OP, self, positions)?;
        if positions.shape() != [tokens] {
            return Err(Error::InvalidShape {
                op: OP,
                shape: positions.shape().to_vec(),
                reason: format!("positions must be [tokens] = [{tokens}], one per token"),
            });
        }
        check_indices(OP, positions, cos.shape()[0], Access::Read)?;
        let x = self.contiguous()?;
        let (cos, sin, positions) = (
            cos.contiguous()?,
            sin.contiguous()?,
            positions.contiguous()?,
        );
        let mut out = Tensor::output_of(&[self], self.dtype(), self.shape(), Location::caller())?;
        self.backend()?.rotary(
            self.dtype(),
            x.src(),
            cos.src(),
            sin.src(),
            positions.src(),
            inverse,
            out.dst(),
        )?;
        Ok(out)
    }
}
