//! The differentiable ops of [`Var`]: each computes its value with the tensor op of the same name and
//! records the derivative. Elementwise derivatives are fused into one pass (`g * f'(x)`), so a
//! backward step makes one temporary per op.

use smallvec::{SmallVec, smallvec};

use super::reduce_to::sum_to;
use super::{InputGrads, Var};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::resolve_axis;
use crate::ops::Binary;
use crate::tensor::Tensor;

fn not_float(op: &'static str, dtype: DType) -> Error {
    Error::UnsupportedDType {
        op,
        dtype,
        expected: "a float dtype (f32, f64, bf16 or f16) to be differentiated",
    }
}

/// The fused derivative `op` (a `Binary` of `backend::op`, which states its math) elementwise over
/// the output gradient `g` and a saved tensor `x` of the same shape.
fn chain<'s>(
    name: &'static str,
    op: Binary,
    params: [f64; 2],
    g: &Tensor<'s>,
    x: &Tensor<'s>,
) -> Result<Tensor<'s>> {
    if !g.dtype().is_float() {
        return Err(not_float(name, g.dtype()));
    }
    g.zip_with(x, name, op, params)
}

/// Unary ops whose derivative is computed from the input `x`.
macro_rules! unary_from_input {
    ($($(#[$doc:meta])* $name:ident => $code:ident;)*) => {$(
        $(#[$doc])*
        ///
        /// # Errors
        /// As for the tensor op of the same name.
        #[track_caller]
        pub fn $name(&self) -> Result<Var<'t, 's>> {
            let value = self.value.$name()?;
            let x = self.value.clone();
            Var::record(&[self], stringify!($name), value, move |g, _| {
                Ok(smallvec![Some(chain(stringify!($name), Binary::$code, [0.0; 2], g, &x)?)])
            })
        }
    )*};
}

/// Unary ops whose derivative is computed from the output `y`.
macro_rules! unary_from_output {
    ($($(#[$doc:meta])* $name:ident => $code:ident;)*) => {$(
        $(#[$doc])*
        ///
        /// # Errors
        /// As for the tensor op of the same name.
        #[track_caller]
        pub fn $name(&self) -> Result<Var<'t, 's>> {
            let value = self.value.$name()?;
            let y = value.clone();
            Var::record(&[self], stringify!($name), value, move |g, _| {
                Ok(smallvec![Some(chain(stringify!($name), Binary::$code, [0.0; 2], g, &y)?)])
            })
        }
    )*};
}

impl<'t, 's> Var<'t, 's> {
    unary_from_input! {
        /// `-self`.
        neg => NegGrad;
        /// `|self|`; the derivative at 0 is taken as 0.
        abs => AbsGrad;
        /// `self²`.
        square => SquareGrad;
        /// Natural logarithm.
        log => Div;
        /// Sine.
        sin => SinGrad;
        /// Cosine.
        cos => CosGrad;
        /// `max(self, 0)`; the derivative at 0 is taken as 0.
        relu => ReluGrad;
        /// GELU (tanh approximation).
        gelu => GeluGrad;
        /// Exact GELU, `x Φ(x)`.
        gelu_exact => GeluExactGrad;
        /// SiLU, `x sigmoid(x)`.
        silu => SiluGrad;
        /// The error function.
        erf => ErfGrad;
    }

    unary_from_output! {
        /// `e^self`.
        exp => Mul;
        /// Square root.
        sqrt => SqrtGrad;
        /// `1 / self`.
        recip => RecipGrad;
        /// Hyperbolic tangent.
        tanh => TanhGrad;
        /// The logistic function.
        sigmoid => SigmoidGrad;
    }

    /// `ln(1 + self)`, accurate near 0. Derivative `g / (1 + x)`.
    ///
    /// # Errors
    /// As for [`Tensor::log1p`].
    #[track_caller]
    pub fn log1p(&self) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        let value = self.value.log1p()?;
        let x = self.value.clone();
        Var::record(&[self], "log1p", value, move |g, _| {
            Ok(smallvec![Some(g.div(&x.add_scalar(1.0)?)?)])
        })
    }

    /// `e^self - 1`, accurate near 0. Derivative `g (y + 1)` from the output `y`.
    ///
    /// # Errors
    /// As for [`Tensor::expm1`].
    #[track_caller]
    pub fn expm1(&self) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        let value = self.value.expm1()?;
        let y = value.clone();
        Var::record(&[self], "expm1", value, move |g, _| {
            Ok(smallvec![Some(g.mul(&y.add_scalar(1.0)?)?)])
        })
    }

    /// `value` where `mask` is non-zero, `self` elsewhere; `mask` gets no gradient and the filled
    /// elements pass none back.
    ///
    /// # Errors
    /// As for [`Tensor::masked_fill`].
    #[track_caller]
    pub fn masked_fill(&self, mask: &Tensor<'s>, value: f64) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        let out = self.value.masked_fill(mask, value)?;
        let mask = mask.clone();
        Var::record(&[self], "masked_fill", out, move |g, _| {
            Ok(smallvec![Some(g.masked_fill(&mask, 0.0)?)])
        })
    }

    /// Running sums along `axis` ([`Tensor::cumsum`]); the derivative is the running sum of the
    /// gradient from the end.
    ///
    /// # Errors
    /// As for [`Tensor::cumsum`].
    #[track_caller]
    pub fn cumsum(&self, axis: isize) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        let out = self.value.cumsum(axis)?;
        Var::record(&[self], "cumsum", out, move |g, _| {
            Ok(smallvec![Some(g.reverse_cumsum(axis)?)])
        })
    }

    /// The lower triangle of the last two dimensions ([`Tensor::tril`]).
    ///
    /// # Errors
    /// As for [`Tensor::tril`].
    #[track_caller]
    pub fn tril(&self, k: isize) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        let out = self.value.tril(k)?;
        Var::record(&[self], "tril", out, move |g, _| {
            Ok(smallvec![Some(g.tril(k)?)])
        })
    }

    /// The upper triangle of the last two dimensions ([`Tensor::triu`]).
    ///
    /// # Errors
    /// As for [`Tensor::triu`].
    #[track_caller]
    pub fn triu(&self, k: isize) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        let out = self.value.triu(k)?;
        Var::record(&[self], "triu", out, move |g, _| {
            Ok(smallvec![Some(g.triu(k)?)])
        })
    }

    /// `self + value`.
    ///
    /// # Errors
    /// As for [`Tensor::add_scalar`].
    #[track_caller]
    pub fn add_scalar(&self, value: f64) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        let out = self.value.add_scalar(value)?;
        Var::record(&[self], "add_scalar", out, |g, _| {
            Ok(smallvec![Some(g.clone())])
        })
    }

    /// `self * value`.
    ///
    /// # Errors
    /// As for [`Tensor::mul_scalar`].
    #[track_caller]
    pub fn mul_scalar(&self, value: f64) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        let out = self.value.mul_scalar(value)?;
        Var::record(&[self], "mul_scalar", out, move |g, _| {
            Ok(smallvec![Some(g.mul_scalar(value)?)])
        })
    }

    /// `self / value`.
    ///
    /// # Errors
    /// As for [`Tensor::div_scalar`].
    #[track_caller]
    pub fn div_scalar(&self, value: f64) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        let out = self.value.div_scalar(value)?;
        Var::record(&[self], "div_scalar", out, move |g, _| {
            Ok(smallvec![Some(g.div_scalar(value)?)])
        })
    }

    /// `self ^ exponent`.
    ///
    /// # Errors
    /// As for [`Tensor::powf`].
    #[track_caller]
    pub fn powf(&self, exponent: f64) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        let out = self.value.powf(exponent)?;
        let x = self.value.clone();
        Var::record(&[self], "powf", out, move |g, _| {
            let d = chain("powf", Binary::PowfGrad, [exponent, 0.0], g, &x)?;
            Ok(smallvec![Some(d)])
        })
    }

    /// `self` limited to `min..=max`; no gradient flows where it was clamped.
    ///
    /// # Errors
    /// As for [`Tensor::clamp`].
    #[track_caller]
    pub fn clamp(&self, min: f64, max: f64) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        let out = self.value.clamp(min, max)?;
        let x = self.value.clone();
        Var::record(&[self], "clamp", out, move |g, _| {
            let d = chain("clamp", Binary::ClampGrad, [min, max], g, &x)?;
            Ok(smallvec![Some(d)])
        })
    }

    /// Records a broadcasting binary op whose input gradients are computed elementwise at the output's
    /// shape and then summed down to each input's shape.
    fn binary(
        &self,
        other: &Var<'t, 's>,
        op: &'static str,
        value: Tensor<'s>,
        grads: impl FnOnce(&Tensor<'s>, &[bool]) -> Result<[Option<Tensor<'s>>; 2]> + 's,
    ) -> Result<Var<'t, 's>> {
        let shapes = [self.value.shape().to_vec(), other.value.shape().to_vec()];
        Var::record(&[self, other], op, value, move |g, needs| {
            let [ga, gb] = grads(g, needs)?;
            let reduce =
                |gr: Option<Tensor<'s>>, shape: &[usize]| gr.map(|t| sum_to(&t, shape)).transpose();
            Ok(smallvec![reduce(ga, &shapes[0])?, reduce(gb, &shapes[1])?])
        })
    }

    /// `self + other`, broadcasting.
    ///
    /// # Errors
    /// As for [`Tensor::add`].
    #[track_caller]
    pub fn add(&self, other: &Var<'t, 's>) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        if let Some([a, b]) = self.autocast_mixed(other)? {
            return a.add(&b);
        }
        let out = self.value.add(&other.value)?;
        self.binary(other, "add", out, |g, _| {
            Ok([Some(g.clone()), Some(g.clone())])
        })
    }

    /// `self - other`, broadcasting.
    ///
    /// # Errors
    /// As for [`Tensor::sub`].
    #[track_caller]
    pub fn sub(&self, other: &Var<'t, 's>) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        if let Some([a, b]) = self.autocast_mixed(other)? {
            return a.sub(&b);
        }
        let out = self.value.sub(&other.value)?;
        self.binary(other, "sub", out, |g, needs| {
            let gb = if needs[1] { Some(g.neg()?) } else { None };
            Ok([Some(g.clone()), gb])
        })
    }

    /// `self * other`, broadcasting.
    ///
    /// # Errors
    /// As for [`Tensor::mul`].
    #[track_caller]
    pub fn mul(&self, other: &Var<'t, 's>) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        if let Some([a, b]) = self.autocast_mixed(other)? {
            return a.mul(&b);
        }
        let out = self.value.mul(&other.value)?;
        let (a, b) = (self.value.clone(), other.value.clone());
        self.binary(other, "mul", out, move |g, needs| {
            let ga = if needs[0] { Some(g.mul(&b)?) } else { None };
            let gb = if needs[1] { Some(g.mul(&a)?) } else { None };
            Ok([ga, gb])
        })
    }

    /// `self / other`, broadcasting.
    ///
    /// # Errors
    /// As for [`Tensor::div`].
    #[track_caller]
    pub fn div(&self, other: &Var<'t, 's>) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        if let Some([a, b]) = self.autocast_mixed(other)? {
            return a.div(&b);
        }
        let out = self.value.div(&other.value)?;
        let (b, y) = (other.value.clone(), out.clone());
        self.binary(other, "div", out, move |g, needs| {
            let ga = g.div(&b)?;
            // d(a/b)/db = -(a/b)/b, so gb = -(g/b) * y.
            let gb = if needs[1] {
                Some(ga.mul(&y)?.neg()?)
            } else {
                None
            };
            Ok([needs[0].then_some(ga), gb])
        })
    }

    /// `self ^ other`, broadcasting. The derivative for the exponent uses `ln(self)`, so it is NaN
    /// where `self <= 0`.
    ///
    /// # Errors
    /// As for [`Tensor::pow`].
    #[track_caller]
    pub fn pow(&self, other: &Var<'t, 's>) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        if let Some([a, b]) = self.autocast_mixed(other)? {
            return a.pow(&b);
        }
        let out = self.value.pow(&other.value)?;
        let (a, b, y) = (self.value.clone(), other.value.clone(), out.clone());
        self.binary(other, "pow", out, move |g, needs| {
            let ga = if needs[0] {
                // g * b * a^(b - 1) = g * b * y / a would divide by zero at a = 0.
                let db = a.pow(&b.add_scalar(-1.0)?)?.mul(&b)?;
                Some(g.mul(&db)?)
            } else {
                None
            };
            let gb = if needs[1] {
                Some(g.mul(&y)?.mul(&a.log()?)?)
            } else {
                None
            };
            Ok([ga, gb])
        })
    }

    /// The larger of the two, elementwise; where they are equal the gradient goes to `self`.
    ///
    /// # Errors
    /// As for [`Tensor::maximum`].
    #[track_caller]
    pub fn maximum(&self, other: &Var<'t, 's>) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        if let Some([a, b]) = self.autocast_mixed(other)? {
            return a.maximum(&b);
        }
        let out = self.value.maximum(&other.value)?;
        let mask = self.value.ge(&other.value)?;
        self.select_grad(other, "maximum", out, mask)
    }

    /// The smaller of the two, elementwise; where they are equal the gradient goes to `self`.
    ///
    /// # Errors
    /// As for [`Tensor::minimum`].
    #[track_caller]
    pub fn minimum(&self, other: &Var<'t, 's>) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        if let Some([a, b]) = self.autocast_mixed(other)? {
            return a.minimum(&b);
        }
        let out = self.value.minimum(&other.value)?;
        let mask = self.value.le(&other.value)?;
        self.select_grad(other, "minimum", out, mask)
    }

    /// Records an op whose output takes `self` where `mask` is 1 and `other` elsewhere.
    fn select_grad(
        &self,
        other: &Var<'t, 's>,
        op: &'static str,
        out: Tensor<'s>,
        mask: Tensor<'s>,
    ) -> Result<Var<'t, 's>> {
        self.binary(other, op, out, move |g, needs| {
            let ga = if needs[0] {
                Some(chain(op, Binary::Mul, [0.0; 2], g, &mask)?)
            } else {
                None
            };
            let gb = if needs[1] {
                Some(chain(op, Binary::MaskNot, [0.0; 2], g, &mask)?)
            } else {
                None
            };
            Ok([ga, gb])
        })
    }

    /// `on_true` where `cond` is non-zero, `on_false` elsewhere (broadcasting); `cond` gets no gradient.
    ///
    /// # Errors
    /// As for [`Tensor::where_cond`].
    #[track_caller]
    pub fn where_cond(
        cond: &Tensor<'s>,
        on_true: &Var<'t, 's>,
        on_false: &Var<'t, 's>,
    ) -> Result<Var<'t, 's>> {
        let _placed = on_true.placing();
        let out = Tensor::where_cond(cond, &on_true.value, &on_false.value)?;
        let mask = cond.ne(&cond.mul_scalar(0.0)?)?.to_dtype(out.dtype())?;
        on_true.select_grad(on_false, "where_cond", out, mask)
    }

    /// Matrix product with [`Tensor::matmul`]'s rules (1-D operands, batched and broadcast batches).
    ///
    /// # Errors
    /// As for [`Tensor::matmul`].
    #[track_caller]
    pub fn matmul(&self, other: &Var<'t, 's>) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        // An `f32` weight the backend rounds as it packs: no rounded copy on the tape. Elsewhere
        // the recorded cast's copy serves the forward and the backward products alike.
        if let Some(dtype) = self.autocast()
            && self.value.rank() == 2
            && other.value.rank() == 2
            && other.value.dtype() == DType::F32
            && other.value.backend()?.matmul_rounds(dtype)
        {
            return self.cast_to(dtype)?.matmul_as(other, dtype);
        }
        if let Some([a, b]) = Var::autocast_operands([self, other])? {
            return a.matmul(&b);
        }
        let out = self.value.matmul(&other.value)?;
        let (a, b) = (self.value.clone(), other.value.clone());
        Var::record(&[self, other], "matmul", out, move |g, needs| {
            // Work on matrices: a 1-D `a` is a row, a 1-D `b` a column, as in the forward pass.
            let a2 = if a.rank() == 1 {
                a.unsqueeze(0)?
            } else {
                a.clone()
            };
            let b2 = if b.rank() == 1 {
                b.unsqueeze(-1)?
            } else {
                b.clone()
            };
            let mut g2 = g.clone();
            if a.rank() == 1 {
                g2 = g2.unsqueeze(if b.rank() == 1 { 0 } else { -2 })?;
            }
            if b.rank() == 1 {
                g2 = g2.unsqueeze(-1)?;
            }
            let ga = if needs[0] {
                let ga2 = product_in_layout_of(&a2, &g2, &b2.transpose(-1, -2)?, a2.dtype())?;
                Some(sum_to(&ga2, a2.shape())?.reshape(a.shape())?)
            } else {
                None
            };
            let gb = if needs[1] {
                let gb2 = product_in_layout_of(&b2, &a2.transpose(-1, -2)?, &g2, b2.dtype())?;
                Some(sum_to(&gb2, b2.shape())?.reshape(b.shape())?)
            } else {
                None
            };
            Ok(smallvec![ga, gb])
        })
    }

    /// Autocast's product of two matrices, `self` already in `dtype`:
    /// [`Tensor::matmul_as`], which reads an `f32` `other` (a weight) rounded as it packs it
    /// instead of recording a rounded copy; `other`'s gradient is computed in `dtype` and converted
    /// to its own, as the cast's would be.
    fn matmul_as(&self, other: &Var<'t, 's>, dtype: DType) -> Result<Var<'t, 's>> {
        let out = self.value.matmul_as(&other.value, dtype)?;
        let (a, b) = (self.value.clone(), other.value.clone());
        Var::record(&[self, other], "matmul", out, move |g, needs| {
            let ga = if needs[0] {
                Some(product_in_layout_of(&a, g, &b.t()?, dtype)?)
            } else {
                None
            };
            let gb = if needs[1] {
                let gb = product_in_layout_of(&b, &a.t()?, g, dtype)?;
                Some(gb.to_dtype(b.dtype())?)
            } else {
                None
            };
            Ok(smallvec![ga, gb])
        })
    }

    /// Resolves `axes` against this rank, sorted, for re-inserting reduced axes into a gradient.
    fn reduced_axes(&self, op: &'static str, axes: &[isize]) -> Result<SmallVec<[usize; 6]>> {
        let mut resolved = axes
            .iter()
            .map(|&a| resolve_axis(op, a, self.value.rank()))
            .collect::<Result<SmallVec<[usize; 6]>>>()?;
        resolved.sort_unstable();
        Ok(resolved)
    }

    /// Sum over `axes`.
    ///
    /// # Errors
    /// As for [`Tensor::sum`].
    #[track_caller]
    pub fn sum(&self, axes: &[isize], keepdim: bool) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        let out = self.value.sum(axes, keepdim)?;
        let reduced = self.reduced_axes("sum", axes)?;
        let shape = self.value.shape().to_vec();
        Var::record(&[self], "sum", out, move |g, _| {
            Ok(smallvec![Some(spread(g, &reduced, keepdim, &shape)?)])
        })
    }

    /// Mean over `axes`.
    ///
    /// # Errors
    /// As for [`Tensor::mean`].
    #[track_caller]
    pub fn mean(&self, axes: &[isize], keepdim: bool) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        let out = self.value.mean(axes, keepdim)?;
        let reduced = self.reduced_axes("mean", axes)?;
        let shape = self.value.shape().to_vec();
        let count = self
            .value
            .numel()
            .checked_div(out.numel())
            .unwrap_or(1)
            .max(1);
        Var::record(&[self], "mean", out, move |g, _| {
            let g = g.div_scalar(count as f64)?;
            Ok(smallvec![Some(spread(&g, &reduced, keepdim, &shape)?)])
        })
    }

    /// Sum of all elements, as a one-element tensor of shape `[]`.
    ///
    /// # Errors
    /// Only allocation errors.
    #[track_caller]
    pub fn sum_all(&self) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        let axes: SmallVec<[isize; 6]> = (0..self.value.rank() as isize).collect();
        self.sum(&axes, false)
    }

    /// Mean of all elements, as a one-element tensor of shape `[]`.
    ///
    /// # Errors
    /// [`Error::UnsupportedDType`] for integer tensors.
    #[track_caller]
    pub fn mean_all(&self) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        let axes: SmallVec<[isize; 6]> = (0..self.value.rank() as isize).collect();
        self.mean(&axes, false)
    }

    /// Maximum over `axes`; ties share the gradient equally.
    ///
    /// # Errors
    /// As for [`Tensor::max`].
    #[track_caller]
    pub fn max(&self, axes: &[isize], keepdim: bool) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        let out = self.value.max(axes, keepdim)?;
        self.extremum("max", axes, keepdim, out)
    }

    /// Minimum over `axes`; ties share the gradient equally.
    ///
    /// # Errors
    /// As for [`Tensor::min`].
    #[track_caller]
    pub fn min(&self, axes: &[isize], keepdim: bool) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        let out = self.value.min(axes, keepdim)?;
        self.extremum("min", axes, keepdim, out)
    }

    fn extremum(
        &self,
        op: &'static str,
        axes: &[isize],
        keepdim: bool,
        out: Tensor<'s>,
    ) -> Result<Var<'t, 's>> {
        let reduced = self.reduced_axes(op, axes)?;
        let shape = self.value.shape().to_vec();
        let x = self.value.clone();
        let kept = spread(&out, &reduced, keepdim, &shape)?;
        Var::record(&[self], op, out, move |g, _| {
            let mask = x.eq(&kept)?;
            let ties = spread(
                &mask.sum(&to_isize(&reduced), keepdim)?,
                &reduced,
                keepdim,
                &shape,
            )?;
            let g = spread(g, &reduced, keepdim, &shape)?;
            Ok(smallvec![Some(g.mul(&mask)?.div(&ties)?)])
        })
    }

    /// Softmax along `axis`.
    ///
    /// # Errors
    /// As for [`Tensor::softmax`].
    #[track_caller]
    pub fn softmax(&self, axis: isize) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        if let Some(x) = self.autocast_f32()? {
            return x.softmax(axis);
        }
        let out = self.value.softmax(axis)?;
        let y = out.clone();
        Var::record(&[self], "softmax", out, move |g, _| {
            // dx = y * (g - sum(g * y)) along the axis.
            let gy = g.mul(&y)?;
            let dot = gy.sum(&[axis], true)?;
            Ok(smallvec![Some(gy.sub(&y.mul(&dot)?)?)])
        })
    }

    /// Rotary position embedding of `[tokens, heads, head_dim]` queries or keys (see
    /// [`Tensor::rotary`]); the tables and positions are constants. Its derivative turns the
    /// gradient back by the same angles (the rotation is orthogonal). Under autocast it runs in the
    /// input's dtype, as transformers' does.
    ///
    /// # Errors
    /// As for [`Tensor::rotary`].
    #[track_caller]
    pub fn rotary(
        &self,
        cos: &Tensor<'s>,
        sin: &Tensor<'s>,
        positions: &Tensor<'s>,
    ) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        let out = self.value.rotary(cos, sin, positions)?;
        let (cos, sin, positions) = (cos.clone(), sin.clone(), positions.clone());
        Var::record(&[self], "rotary", out, move |g, _| {
            Ok(smallvec![Some(g.rotary_by(&cos, &sin, &positions, true)?)])
        })
    }

    /// Log-softmax along `axis`.
    ///
    /// # Errors
    /// As for [`Tensor::log_softmax`].
    #[track_caller]
    pub fn log_softmax(&self, axis: isize) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        if let Some(x) = self.autocast_f32()? {
            return x.log_softmax(axis);
        }
        let out = self.value.log_softmax(axis)?;
        let y = out.clone();
        Var::record(&[self], "log_softmax", out, move |g, _| {
            // dx = g - softmax * sum(g) along the axis.
            let total = g.sum(&[axis], true)?;
            let p_total = chain("log_softmax", Binary::ExpMul, [0.0; 2], &y, &total)?;
            Ok(smallvec![Some(g.sub(&p_total)?)])
        })
    }

    /// The value as `shape` (same element count).
    ///
    /// # Errors
    /// As for [`Tensor::reshape`].
    #[track_caller]
    pub fn reshape(&self, shape: &[usize]) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        let out = self.value.reshape(shape)?;
        self.relabelled("reshape", out)
    }

    /// Records `out`, the same elements as `self` under another shape: the derivative reshapes the
    /// gradient back to `self`'s shape.
    fn relabelled(&self, op: &'static str, out: Tensor<'s>) -> Result<Var<'t, 's>> {
        let from = self.value.shape().to_vec();
        Var::record(&[self], op, out, move |g, _| {
            Ok(smallvec![Some(g.reshape(&from)?)])
        })
    }

    /// The value as one dimension.
    ///
    /// # Errors
    /// Only allocation errors (a strided value is copied).
    #[track_caller]
    pub fn flatten(&self) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        self.reshape(&[self.value.numel()])
    }

    /// Swaps axes `a` and `b`.
    ///
    /// # Errors
    /// As for [`Tensor::transpose`].
    #[track_caller]
    pub fn transpose(&self, a: isize, b: isize) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        let out = self.value.transpose(a, b)?;
        Var::record(&[self], "transpose", out, move |g, _| {
            Ok(smallvec![Some(g.transpose(a, b)?)])
        })
    }

    /// Transpose of a 2-D value.
    ///
    /// # Errors
    /// As for [`Tensor::t`].
    #[track_caller]
    pub fn t(&self) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        let out = self.value.t()?;
        Var::record(&[self], "t", out, |g, _| Ok(smallvec![Some(g.t()?)]))
    }

    /// Reorders the axes: axis `i` of the result is axis `perm[i]` of `self`.
    ///
    /// # Errors
    /// As for [`Tensor::permute`].
    #[track_caller]
    pub fn permute(&self, perm: &[usize]) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        let out = self.value.permute(perm)?;
        let mut inverse = vec![0; perm.len()];
        for (i, &p) in perm.iter().enumerate() {
            inverse[p] = i;
        }
        Var::record(&[self], "permute", out, move |g, _| {
            Ok(smallvec![Some(g.permute(&inverse)?)])
        })
    }

    /// `len` entries along `axis` from `start`.
    ///
    /// # Errors
    /// As for [`Tensor::narrow`].
    #[track_caller]
    pub fn narrow(&self, axis: isize, start: usize, len: usize) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        let out = self.value.narrow(axis, start, len)?;
        let x = self.value.clone();
        Var::record(&[self], "narrow", out, move |g, _| {
            // Pad the gradient with zeros back to the input's extent along the axis.
            let ax = resolve_axis("narrow", axis, x.rank())?;
            let full = x.shape()[ax];
            let mut parts: SmallVec<[Tensor<'s>; 3]> = SmallVec::new();
            let mut shape = x.shape().to_vec();
            if start > 0 {
                shape[ax] = start;
                parts.push(g.full_like_scalar(&shape, 0.0)?);
            }
            parts.push(g.clone());
            if start + len < full {
                shape[ax] = full - start - len;
                parts.push(g.full_like_scalar(&shape, 0.0)?);
            }
            let refs: SmallVec<[&Tensor<'s>; 3]> = parts.iter().collect();
            Ok(smallvec![Some(Tensor::concat(&refs, axis)?)])
        })
    }

    /// The entries `range` along `axis`.
    ///
    /// # Errors
    /// As for [`Tensor::slice`].
    #[track_caller]
    pub fn slice(&self, axis: isize, range: std::ops::Range<usize>) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        self.narrow(axis, range.start, range.end.saturating_sub(range.start))
    }

    /// The value broadcast to `shape`; the gradient is summed back.
    ///
    /// # Errors
    /// As for [`Tensor::broadcast_to`].
    #[track_caller]
    pub fn broadcast_to(&self, shape: &[usize]) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        let out = self.value.broadcast_to(shape)?;
        let from = self.value.shape().to_vec();
        Var::record(&[self], "broadcast_to", out, move |g, _| {
            Ok(smallvec![Some(sum_to(g, &from)?)])
        })
    }

    /// Removes axis `axis` of size 1.
    ///
    /// # Errors
    /// As for [`Tensor::squeeze`].
    #[track_caller]
    pub fn squeeze(&self, axis: isize) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        let out = self.value.squeeze(axis)?;
        self.relabelled("squeeze", out)
    }

    /// Inserts an axis of size 1 at `axis`.
    ///
    /// # Errors
    /// As for [`Tensor::unsqueeze`].
    #[track_caller]
    pub fn unsqueeze(&self, axis: isize) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        let out = self.value.unsqueeze(axis)?;
        self.relabelled("unsqueeze", out)
    }

    /// A contiguous copy (or the value itself when it already is contiguous).
    ///
    /// # Errors
    /// Only allocation errors.
    #[track_caller]
    pub fn contiguous(&self) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        let out = self.value.contiguous()?;
        Var::record(&[self], "contiguous", out, |g, _| {
            Ok(smallvec![Some(g.clone())])
        })
    }

    /// Converts between float dtypes; the gradient is converted back.
    ///
    /// # Errors
    /// [`Error::UnsupportedDType`] unless both dtypes are floats.
    #[track_caller]
    pub fn to_dtype(&self, dtype: DType) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        let from = self.value.dtype();
        if !from.is_float() || !dtype.is_float() {
            return Err(not_float(
                "to_dtype",
                if from.is_float() { dtype } else { from },
            ));
        }
        let out = self.value.to_dtype(dtype)?;
        Var::record(&[self], "to_dtype", out, move |g, _| {
            Ok(smallvec![Some(g.to_dtype(from)?)])
        })
    }

    /// The slices `indices[k]` along `axis`.
    ///
    /// # Errors
    /// As for [`Tensor::index_select`].
    #[track_caller]
    pub fn index_select(&self, axis: isize, indices: &Tensor<'s>) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        let out = self.value.index_select(axis, indices)?;
        let (x, indices) = (self.value.clone(), indices.clone());
        Var::record(&[self], "index_select", out, move |g, _| {
            let zeros = g.full_like_scalar(x.shape(), 0.0)?;
            Ok(smallvec![Some(zeros.into_index_add(axis, &indices, g)?)])
        })
    }

    /// Picks along `axis` with an index tensor of the same rank.
    ///
    /// # Errors
    /// As for [`Tensor::gather`].
    #[track_caller]
    pub fn gather(&self, axis: isize, index: &Tensor<'s>) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        let out = self.value.gather(axis, index)?;
        let (x, index) = (self.value.clone(), index.clone());
        Var::record(&[self], "gather", out, move |g, _| {
            let zeros = g.full_like_scalar(x.shape(), 0.0)?;
            Ok(smallvec![Some(zeros.into_scatter_add(axis, &index, g)?)])
        })
    }

    /// Joins `vars` along an existing `axis`.
    ///
    /// # Errors
    /// As for [`Tensor::concat`]; [`Error::Empty`] for no variables.
    #[track_caller]
    pub fn concat(vars: &[&Var<'t, 's>], axis: isize) -> Result<Var<'t, 's>> {
        let first = vars.first().ok_or(Error::Empty { op: "concat" })?;
        let _placed = first.placing();
        let values: SmallVec<[&Tensor<'s>; 4]> = vars.iter().map(|v| &v.value).collect();
        let out = Tensor::concat(&values, axis)?;
        let ax = resolve_axis("concat", axis, first.value.rank())?;
        let sizes: SmallVec<[usize; 4]> = vars.iter().map(|v| v.value.shape()[ax]).collect();
        Var::record(vars, "concat", out, move |g, needs| {
            let mut start = 0;
            let mut grads = InputGrads::new();
            for (&len, &need) in sizes.iter().zip(needs) {
                grads.push(if need {
                    Some(g.narrow(axis, start, len)?)
                } else {
                    None
                });
                start += len;
            }
            Ok(grads)
        })
    }

    /// Stacks `vars` (of one shape) along a new `axis`.
    ///
    /// # Errors
    /// As for [`Tensor::stack`]; [`Error::Empty`] for no variables.
    #[track_caller]
    pub fn stack(vars: &[&Var<'t, 's>], axis: isize) -> Result<Var<'t, 's>> {
        let first = vars.first().ok_or(Error::Empty { op: "stack" })?;
        let _placed = first.placing();
        let values: SmallVec<[&Tensor<'s>; 4]> = vars.iter().map(|v| &v.value).collect();
        let out = Tensor::stack(&values, axis)?;
        let ax = resolve_axis("stack", axis, first.value.rank() + 1)? as isize;
        Var::record(vars, "stack", out, move |g, needs| {
            let mut grads = InputGrads::new();
            for (i, &need) in needs.iter().enumerate() {
                grads.push(if need {
                    Some(g.narrow(ax, i, 1)?.squeeze(ax)?)
                } else {
                    None
                });
            }
            Ok(grads)
        })
    }
}

/// `l @ r`, laid out like `like` when `like` is a transposed matrix (a `W.t()` view): then the product is
/// computed as `(rᵀ @ lᵀ)ᵀ`, so the gradient of a transposed weight comes out as a transposed view of a
/// contiguous block — after the transpose's own backward, contiguous in the weight's layout, which the
/// optimizer updates in one streaming pass instead of a strided one.
fn product_in_layout_of<'s>(
    like: &Tensor<'s>,
    l: &Tensor<'s>,
    r: &Tensor<'s>,
    dtype: DType,
) -> Result<Tensor<'s>> {
    let transposed = like.rank() == 2 && !like.is_contiguous() && like.t()?.is_contiguous();
    if transposed && l.rank() == 2 && r.rank() == 2 {
        return r.t()?.matmul_as(&l.t()?, dtype)?.t();
    }
    l.matmul_as(r, dtype)
}

fn to_isize(axes: &[usize]) -> SmallVec<[isize; 6]> {
    axes.iter().map(|&a| a as isize).collect()
}

/// Broadcasts a reduction's output (or its gradient) back over the reduced axes to `shape`.
fn spread<'s>(
    g: &Tensor<'s>,
    reduced: &[usize],
    keepdim: bool,
    shape: &[usize],
) -> Result<Tensor<'s>> {
    let mut g = g.clone();
    if !keepdim {
        for &axis in reduced {
            g = g.unsqueeze(axis as isize)?;
        }
    }
    g.broadcast_to(shape)
}

impl<'s> Tensor<'s> {
    /// A new tensor of `shape` filled with `value`, with this tensor's dtype and owner.
    #[track_caller]
    fn full_like_scalar(&self, shape: &[usize], value: f64) -> Result<Tensor<'s>> {
        let mut out =
            Tensor::output_of(&[self], self.dtype(), shape, std::panic::Location::caller())?;
        out.fill_(value)?;
        Ok(out)
    }
}
