//! Elementwise ops: unary maps, binary ops with NumPy broadcasting, scalar ops, comparisons, `where`,
//! dtype casts, and in-place updates.
//!
//! Each kernel walks its operands row by row ([`RowWalk`]) and picks a loop by the row strides
//! (contiguous, broadcast scalar, or strided), so the common cases are plain slice loops that the
//! compiler vectorises.

use std::panic::Location;

use crate::dtype::{DType, Element, Float, with_dtype, with_float_dtype};
use crate::error::{Error, Result};
use crate::layout::{RowWalk, broadcast_shapes, contiguous_strides};
use rayon::prelude::*;

use crate::ops::op_code::{Binary, Unary};
use crate::ops::{CHUNK, PARALLEL_MIN, fill_segments, same_device, same_dtype};
use crate::tensor::Tensor;

/// One output row from two operand rows.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn binary_row<T: Copy, U>(
    out: &mut [U],
    a: &[T],
    ia: usize,
    sa: usize,
    b: &[T],
    ib: usize,
    sb: usize,
    f: impl Fn(T, T) -> U,
) {
    let n = out.len();
    match (sa, sb) {
        (1, 1) => {
            for ((o, &x), &y) in out.iter_mut().zip(&a[ia..ia + n]).zip(&b[ib..ib + n]) {
                *o = f(x, y);
            }
        }
        (1, 0) => {
            let y = b[ib];
            for (o, &x) in out.iter_mut().zip(&a[ia..ia + n]) {
                *o = f(x, y);
            }
        }
        (0, 1) => {
            let x = a[ia];
            for (o, &y) in out.iter_mut().zip(&b[ib..ib + n]) {
                *o = f(x, y);
            }
        }
        _ => {
            for (j, o) in out.iter_mut().enumerate() {
                *o = f(a[ia + j * sa], b[ib + j * sb]);
            }
        }
    }
}

/// One output row from one operand row.
#[inline(always)]
fn unary_row<T: Copy, U>(out: &mut [U], a: &[T], ia: usize, sa: usize, f: impl Fn(T) -> U) {
    let n = out.len();
    if sa == 1 {
        for (o, &x) in out.iter_mut().zip(&a[ia..ia + n]) {
            *o = f(x);
        }
    } else {
        for (j, o) in out.iter_mut().enumerate() {
            *o = f(a[ia + j * sa]);
        }
    }
}

/// `out[i] = f(a[i], b[i])` over equal-length contiguous slices, on rayon's threads when large.
fn zip_contiguous<T: Element>(out: &mut [T], a: &[T], b: &[T], f: &(impl Fn(T, T) -> T + Sync)) {
    if out.len() < PARALLEL_MIN {
        for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
            *o = f(x, y);
        }
        return;
    }
    out.par_chunks_mut(CHUNK)
        .zip(a.par_chunks(CHUNK).zip(b.par_chunks(CHUNK)))
        .for_each(|(o, (a, b))| zip_contiguous(o, a, b, f));
}

/// `out[i] = f(a[i])` over equal-length contiguous slices, on rayon's threads when large.
fn map_contiguous<T: Element>(out: &mut [T], a: &[T], f: &(impl Fn(T) -> T + Sync)) {
    if out.len() < PARALLEL_MIN {
        for (o, &x) in out.iter_mut().zip(a) {
            *o = f(x);
        }
        return;
    }
    out.par_chunks_mut(CHUNK)
        .zip(a.par_chunks(CHUNK))
        .for_each(|(o, a)| map_contiguous(o, a, f));
}

macro_rules! binary_ops {
    ($($(#[$doc:meta])* $name:ident [$code:ident] => |$a:ident, $b:ident| $body:expr;)*) => {$(
        $(#[$doc])*
        ///
        /// # Errors
        /// When the shapes do not broadcast or the dtypes or devices differ.
        #[track_caller]
        pub fn $name(&self, other: &Tensor<'s>) -> Result<Tensor<'s>> {
            with_dtype!(self.dtype(), T => self.zip_map::<T>(other, stringify!($name), (Binary::$code, [0.0; 2]), |$a: T, $b: T| $body))
        }
    )*};
}

macro_rules! unary_float_ops {
    ($($(#[$doc:meta])* $name:ident [$code:ident] => |$x:ident| $body:expr;)*) => {$(
        $(#[$doc])*
        ///
        /// # Errors
        /// [`Error::UnsupportedDType`] for integer tensors.
        #[track_caller]
        pub fn $name(&self) -> Result<Tensor<'s>> {
            with_float_dtype!(self.dtype(), T => self.map::<T>((Unary::$code, [0.0; 2]), |$x: T| $body), else Err(Error::UnsupportedDType {
                op: stringify!($name),
                dtype: self.dtype(),
                expected: "a float dtype (f32 or f64)",
            }))
        }
    )*};
}

fn bool_of<T: Element>(v: bool) -> T {
    if v { T::one() } else { T::zero() }
}

impl<'s> Tensor<'s> {
    /// `f(self, other)` elementwise with broadcasting, into a new tensor of `T`. On a GPU the
    /// kernel computes `code` with the parameters `params`, which must be the same function as `f`.
    #[track_caller]
    pub(crate) fn zip_map<T: Element>(
        &self,
        other: &Tensor<'s>,
        op: &'static str,
        (code, params): (Binary, [f64; 2]),
        f: impl Fn(T, T) -> T + Sync,
    ) -> Result<Tensor<'s>> {
        same_dtype(op, self, other)?;
        same_device(op, self, other)?;
        #[cfg(feature = "cuda")]
        if self.device().is_cuda() {
            let shape = broadcast_shapes(op, self.shape(), other.shape())?;
            let (la, lb) = (
                self.layout().broadcast_to(&shape)?,
                other.layout().broadcast_to(&shape)?,
            );
            let operands = [(self, &la), (other, &lb)];
            return crate::cuda::ops::binary(operands, &shape, code, params, Location::caller());
        }
        #[cfg(not(feature = "cuda"))]
        let _ = (code, params);
        if self.shape() == other.shape() && self.is_contiguous() && other.is_contiguous() {
            // The common case, without broadcasting or a strided walk.
            let mut out =
                Tensor::output_of(&[self, other], T::DTYPE, self.shape(), Location::caller())?;
            let (a, b) = (self.contiguous_data::<T>(), other.contiguous_data::<T>());
            zip_contiguous(out.fresh_mut::<T>(), a, b, &f);
            return Ok(out);
        }
        let shape = broadcast_shapes(op, self.shape(), other.shape())?;
        let (la, lb) = (
            self.layout().broadcast_to(&shape)?,
            other.layout().broadcast_to(&shape)?,
        );
        let mut out = Tensor::output_of(&[self, other], T::DTYPE, &shape, Location::caller())?;
        let (a, b) = (self.block_data::<T>(), other.block_data::<T>());
        let walk = RowWalk::new(
            &shape,
            [la.strides(), lb.strides()],
            [la.offset(), lb.offset()],
        );
        let [sa, sb] = walk.row_strides();
        fill_segments(&walk, out.fresh_mut::<T>(), |o, [ia, ib]| {
            binary_row(o, a, ia, sa, b, ib, sb, &f)
        });
        Ok(out)
    }

    /// `f(self)` elementwise into a new tensor of `T`. On a GPU the kernel computes `code` with the
    /// parameters `params`, which must be the same function as `f`.
    #[track_caller]
    fn map<T: Element>(
        &self,
        (code, params): (Unary, [f64; 2]),
        f: impl Fn(T) -> T + Sync,
    ) -> Result<Tensor<'s>> {
        #[cfg(feature = "cuda")]
        if self.device().is_cuda() {
            return crate::cuda::ops::unary(self, code, params, Location::caller());
        }
        #[cfg(not(feature = "cuda"))]
        let _ = (code, params);
        let mut out = Tensor::output_of(&[self], T::DTYPE, self.shape(), Location::caller())?;
        if self.is_contiguous() {
            map_contiguous(out.fresh_mut::<T>(), self.contiguous_data::<T>(), &f);
            return Ok(out);
        }
        let a = self.block_data::<T>();
        let walk = RowWalk::new(self.shape(), [self.strides()], [self.layout().offset()]);
        let [sa] = walk.row_strides();
        fill_segments(&walk, out.fresh_mut::<T>(), |o, [ia]| {
            unary_row(o, a, ia, sa, &f)
        });
        Ok(out)
    }

    binary_ops! {
        /// `self + other`.
        add [Add] => |a, b| a.add(b);
        /// `self - other`.
        sub [Sub] => |a, b| a.sub(b);
        /// `self * other`.
        mul [Mul] => |a, b| a.mul(b);
        /// The larger of the two, elementwise (NaN if either is NaN).
        maximum [Maximum] => |a, b| a.max_nan(b);
        /// The smaller of the two, elementwise (NaN if either is NaN).
        minimum [Minimum] => |a, b| a.min_nan(b);
        /// `1` where `self == other`, else `0`, in the operands' dtype.
        eq [Eq] => |a, b| bool_of::<T>(a == b);
        /// `1` where `self != other`, else `0`.
        ne [Ne] => |a, b| bool_of::<T>(a != b);
        /// `1` where `self < other`, else `0`.
        lt [Lt] => |a, b| bool_of::<T>(a < b);
        /// `1` where `self <= other`, else `0`.
        le [Le] => |a, b| bool_of::<T>(a <= b);
        /// `1` where `self > other`, else `0`.
        gt [Gt] => |a, b| bool_of::<T>(a > b);
        /// `1` where `self >= other`, else `0`.
        ge [Ge] => |a, b| bool_of::<T>(a >= b);
    }

    /// `self / other`. Float division follows IEEE 754 (`x / 0` is infinite or NaN).
    ///
    /// # Errors
    /// When the shapes do not broadcast or the dtypes differ; [`Error::DivisionByZero`] when an
    /// integer divisor is zero.
    #[track_caller]
    pub fn div(&self, other: &Tensor<'s>) -> Result<Tensor<'s>> {
        if other.dtype() == DType::I64 && other.to_vec::<i64>()?.contains(&0) {
            return Err(Error::DivisionByZero { op: "div" });
        }
        with_dtype!(self.dtype(), T => self.zip_map::<T>(other, "div", (Binary::Div, [0.0; 2]), |a: T, b: T| a.div(b)))
    }

    /// `self ^ other` elementwise (floats).
    ///
    /// # Errors
    /// When the shapes do not broadcast, the dtypes differ, or the dtype is an integer.
    #[track_caller]
    pub fn pow(&self, other: &Tensor<'s>) -> Result<Tensor<'s>> {
        with_float_dtype!(self.dtype(), T => self.zip_map::<T>(other, "pow", (Binary::Pow, [0.0; 2]), |a: T, b: T| a.powf(b)),
            else Err(Error::UnsupportedDType { op: "pow", dtype: self.dtype(), expected: "a float dtype (f32 or f64)" }))
    }

    /// `-self`.
    #[track_caller]
    pub fn neg(&self) -> Result<Tensor<'s>> {
        with_dtype!(self.dtype(), T => self.map::<T>((Unary::Neg, [0.0; 2]), |x: T| x.neg()))
    }

    /// `|self|`.
    #[track_caller]
    pub fn abs(&self) -> Result<Tensor<'s>> {
        with_dtype!(self.dtype(), T => self.map::<T>((Unary::Abs, [0.0; 2]), |x: T| x.abs()))
    }

    /// `self * self`.
    #[track_caller]
    pub fn square(&self) -> Result<Tensor<'s>> {
        with_dtype!(self.dtype(), T => self.map::<T>((Unary::Square, [0.0; 2]), |x: T| x.mul(x)))
    }

    /// `max(self, 0)`.
    #[track_caller]
    pub fn relu(&self) -> Result<Tensor<'s>> {
        with_dtype!(self.dtype(), T => self.map::<T>((Unary::Relu, [0.0; 2]), |x: T| if x > T::zero() || x.partial_cmp(&x).is_none() { x } else { T::zero() }))
    }

    unary_float_ops! {
        /// `e^self` (for `f32` a vectorised approximation within 2 ulp).
        exp [Exp] => |x| Float::exp(x);
        /// Natural logarithm.
        log [Log] => |x| x.ln();
        /// Square root.
        sqrt [Sqrt] => |x| x.sqrt();
        /// `1 / self`.
        recip [Recip] => |x| x.recip();
        /// Hyperbolic tangent (for `f32` a vectorised approximation within 3 ulp).
        tanh [Tanh] => |x| Float::tanh(x);
        /// Sine.
        sin [Sin] => |x| x.sin();
        /// Cosine.
        cos [Cos] => |x| x.cos();
        /// The logistic function `1 / (1 + e^-x)`, computed without overflow for large `|x|`.
        sigmoid [Sigmoid] => |x| {
            // e = e^-|x| never overflows; both branches are computed so the loop stays branch-free.
            let e = Float::exp(x.abs().neg());
            let r = T::one().div(T::one().add(e));
            if x >= T::zero() { r } else { e.mul(r) }
        };
        /// GELU with the tanh approximation: `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
        gelu [Gelu] => |x| {
            let c = T::from_f64((2.0 / std::f64::consts::PI).sqrt());
            let inner = c.mul(x.add(T::from_f64(0.044715).mul(x).mul(x).mul(x)));
            T::from_f64(0.5).mul(x).mul(T::one().add(Float::tanh(inner)))
        };
    }

    /// `self + value` (the scalar is converted to the dtype).
    #[track_caller]
    pub fn add_scalar(&self, value: f64) -> Result<Tensor<'s>> {
        with_dtype!(self.dtype(), T => { let v = T::from_f64(value); self.map::<T>((Unary::AddScalar, [value, 0.0]), move |x: T| x.add(v)) })
    }

    /// `self * value`.
    #[track_caller]
    pub fn mul_scalar(&self, value: f64) -> Result<Tensor<'s>> {
        with_dtype!(self.dtype(), T => { let v = T::from_f64(value); self.map::<T>((Unary::MulScalar, [value, 0.0]), move |x: T| x.mul(v)) })
    }

    /// `self / value`.
    ///
    /// # Errors
    /// [`Error::DivisionByZero`] when dividing an integer tensor by zero.
    #[track_caller]
    pub fn div_scalar(&self, value: f64) -> Result<Tensor<'s>> {
        if self.dtype() == DType::I64 && value as i64 == 0 {
            return Err(Error::DivisionByZero { op: "div_scalar" });
        }
        with_dtype!(self.dtype(), T => { let v = T::from_f64(value); self.map::<T>((Unary::DivScalar, [value, 0.0]), move |x: T| x.div(v)) })
    }

    /// `self ^ exponent` (floats).
    #[track_caller]
    pub fn powf(&self, exponent: f64) -> Result<Tensor<'s>> {
        with_float_dtype!(self.dtype(), T => { let e = T::from_f64(exponent); self.map::<T>((Unary::Powf, [exponent, 0.0]), move |x: T| x.powf(e)) },
            else Err(Error::UnsupportedDType { op: "powf", dtype: self.dtype(), expected: "a float dtype (f32 or f64)" }))
    }

    /// Limits every element to `[min, max]` (NaN stays NaN).
    ///
    /// # Errors
    /// [`Error::InvalidShape`] when `min > max` or either bound is NaN.
    #[track_caller]
    pub fn clamp(&self, min: f64, max: f64) -> Result<Tensor<'s>> {
        if min.is_nan() || max.is_nan() || min > max {
            return Err(Error::InvalidShape {
                op: "clamp",
                shape: self.shape().to_vec(),
                reason: format!("the bounds [{min}, {max}] must be ordered numbers"),
            });
        }
        with_dtype!(self.dtype(), T => {
            let (lo, hi) = (T::from_f64(min), T::from_f64(max));
            self.map::<T>((Unary::Clamp, [min, max]), move |x: T| if x < lo { lo } else if x > hi { hi } else { x })
        })
    }

    /// Picks `on_true` where `cond` is non-zero and `on_false` elsewhere, broadcasting all three.
    /// `cond` may have any dtype; the two branches share theirs.
    ///
    /// ```
    /// # ndscope::root(ndscope::Device::Cpu, |s| {
    /// let x = s.from_slice(&[-1.0f32, 2.0, -3.0], &[3])?;
    /// let positive = x.gt(&s.zeros(&[1])?)?;
    /// let y = ndscope::Tensor::where_cond(&positive, &x, &s.zeros(&[1])?)?;
    /// assert_eq!(y.to_vec::<f32>()?, vec![0.0, 2.0, 0.0]);
    /// # Ok::<_, ndscope::Error>(()) })?; Ok::<(), ndscope::Error>(())
    /// ```
    #[track_caller]
    pub fn where_cond(
        cond: &Tensor<'s>,
        on_true: &Tensor<'s>,
        on_false: &Tensor<'s>,
    ) -> Result<Tensor<'s>> {
        const OP: &str = "where_cond";
        same_dtype(OP, on_true, on_false)?;
        same_device(OP, cond, on_true)?;
        same_device(OP, on_true, on_false)?;
        let shape = broadcast_shapes(OP, cond.shape(), on_true.shape())?;
        let shape = broadcast_shapes(OP, &shape, on_false.shape())?;
        let (lc, lt, lf) = (
            cond.layout().broadcast_to(&shape)?,
            on_true.layout().broadcast_to(&shape)?,
            on_false.layout().broadcast_to(&shape)?,
        );
        #[cfg(feature = "cuda")]
        if on_true.device().is_cuda() {
            // The kernel reads the condition in the branches' dtype.
            let cond = cond.to_dtype(on_true.dtype())?;
            let lc = cond.layout().broadcast_to(&shape)?;
            let operands = [(&cond, &lc), (on_true, &lt), (on_false, &lf)];
            return crate::cuda::ops::where_cond(operands, &shape, Location::caller());
        }
        let mut out = Tensor::output_of(
            &[cond, on_true, on_false],
            on_true.dtype(),
            &shape,
            Location::caller(),
        )?;
        let walk = RowWalk::new(
            &shape,
            [lc.strides(), lt.strides(), lf.strides()],
            [lc.offset(), lt.offset(), lf.offset()],
        );
        let [sc, st, sf] = walk.row_strides();
        with_dtype!(cond.dtype(), C => with_dtype!(on_true.dtype(), T => {
            let (c, t, f) = (cond.block_data::<C>(), on_true.block_data::<T>(), on_false.block_data::<T>());
            fill_segments(&walk, out.fresh_mut::<T>(), |o, [ic, it, iff]| {
                for (j, v) in o.iter_mut().enumerate() {
                    *v = if c[ic + j * sc] != C::zero() { t[it + j * st] } else { f[iff + j * sf] };
                }
            });
        }));
        Ok(out)
    }

    /// The elements converted to `dtype` (an alias when it already has it). Floats convert to integers
    /// by truncation, saturating at the integer range; NaN becomes 0.
    #[track_caller]
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor<'s>> {
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        #[cfg(feature = "cuda")]
        if self.device().is_cuda() {
            return crate::cuda::ops::cast(self, dtype, Location::caller());
        }
        let mut out = Tensor::output_of(&[self], dtype, self.shape(), Location::caller())?;
        let walk = RowWalk::new(self.shape(), [self.strides()], [self.layout().offset()]);
        let [sa] = walk.row_strides();
        with_dtype!(self.dtype(), S => with_dtype!(dtype, D => {
            let a = self.block_data::<S>();
            fill_segments(&walk, out.fresh_mut::<D>(), |o, [ia]| unary_row(o, a, ia, sa, |x: S| D::from_f64(x.to_f64())));
        }));
        Ok(out)
    }

    /// Updates `self` in place with `f(self, other)`, `other` broadcast to `self`'s shape. Copies first
    /// when the block is shared (other handles keep the old values) or strided.
    fn update<T: Element>(
        &mut self,
        other: &Tensor<'_>,
        op: &'static str,
        (code, p): (Binary, f64),
        f: impl Fn(T, T) -> T,
    ) -> Result<()> {
        same_dtype(op, self, other)?;
        same_device(op, self, other)?;
        let lb = other
            .layout()
            .broadcast_to(self.shape())
            .map_err(|_| Error::ShapeMismatch {
                op,
                lhs: self.shape().to_vec(),
                rhs: other.shape().to_vec(),
                hint: "the operand of an in-place op must broadcast to the updated tensor's shape",
            })?;
        self.make_unique_contiguous()?;
        #[cfg(feature = "cuda")]
        if self.device().is_cuda() {
            return crate::cuda::ops::binary_in_place(self, other, &lb, code, p);
        }
        #[cfg(not(feature = "cuda"))]
        let _ = (code, p);
        let shape = self.layout().shape().to_vec();
        let walk = RowWalk::new(
            &shape,
            [&contiguous_strides(&shape), lb.strides()],
            [0, lb.offset()],
        );
        let [_, sb] = walk.row_strides();
        let b = other.block_data::<T>();
        let data = self.fresh_mut::<T>();
        walk.for_segments(0, data.len(), |pos, [_, ib], len| {
            for (j, v) in data[pos..pos + len].iter_mut().enumerate() {
                *v = f(*v, b[ib + j * sb]);
            }
        });
        Ok(())
    }

    /// `self += other` in place (`other` broadcasts to `self`'s shape).
    ///
    /// In-place ops never change what other handles see: when the block is shared (a clone or a view
    /// of it exists), `self` first gets a private copy. A borrowed view ([`as_slice`](Self::as_slice))
    /// blocks them at compile time.
    pub fn add_(&mut self, other: &Tensor<'_>) -> Result<()> {
        with_dtype!(self.dtype(), T => self.update::<T>(other, "add_", (Binary::Add, 0.0), |a: T, b: T| a.add(b)))
    }

    /// `self -= other` in place.
    pub fn sub_(&mut self, other: &Tensor<'_>) -> Result<()> {
        with_dtype!(self.dtype(), T => self.update::<T>(other, "sub_", (Binary::Sub, 0.0), |a: T, b: T| a.sub(b)))
    }

    /// `self *= other` in place.
    pub fn mul_(&mut self, other: &Tensor<'_>) -> Result<()> {
        with_dtype!(self.dtype(), T => self.update::<T>(other, "mul_", (Binary::Mul, 0.0), |a: T, b: T| a.mul(b)))
    }

    /// `self += alpha * other` in place (the optimizer's update).
    pub fn axpy_(&mut self, alpha: f64, other: &Tensor<'_>) -> Result<()> {
        let alpha_f64 = alpha;
        with_dtype!(self.dtype(), T => {
            let alpha = T::from_f64(alpha);
            self.update::<T>(other, "axpy_", (Binary::Axpy, alpha_f64), move |a: T, b: T| a.add(alpha.mul(b)))
        })
    }

    /// Overwrites `self` with `src` (broadcast to `self`'s shape) in place.
    pub fn copy_from_(&mut self, src: &Tensor<'_>) -> Result<()> {
        with_dtype!(self.dtype(), T => self.update::<T>(src, "copy_from_", (Binary::Assign, 0.0), |_: T, b: T| b))
    }

    /// Applies `f` to every element in place (after the copy-on-write step); on a GPU the kernel
    /// computes `code` with `params`, the same function.
    fn apply_<T: Element>(
        &mut self,
        (code, params): (Unary, [f64; 2]),
        f: impl Fn(T) -> T,
    ) -> Result<()> {
        self.make_unique_contiguous()?;
        #[cfg(feature = "cuda")]
        if self.device().is_cuda() {
            return crate::cuda::ops::unary_in_place(self, code, params);
        }
        #[cfg(not(feature = "cuda"))]
        let _ = (code, params);
        self.fresh_mut::<T>().iter_mut().for_each(|x| *x = f(*x));
        Ok(())
    }

    /// `self *= value` in place.
    pub fn mul_scalar_(&mut self, value: f64) -> Result<()> {
        with_dtype!(self.dtype(), T => { let v = T::from_f64(value); self.apply_::<T>((Unary::MulScalar, [value, 0.0]), move |x| x.mul(v)) })
    }

    /// `self += value` in place.
    pub fn add_scalar_(&mut self, value: f64) -> Result<()> {
        with_dtype!(self.dtype(), T => { let v = T::from_f64(value); self.apply_::<T>((Unary::AddScalar, [value, 0.0]), move |x| x.add(v)) })
    }

    /// Overwrites the elements, in row-major order, with `data` (as many values as the tensor holds,
    /// of its element type). A data loader fills one batch tensor this way without allocating.
    ///
    /// ```
    /// # ndscope::root(ndscope::Device::Cpu, |s| {
    /// let mut t = s.zeros(&[2, 2])?;
    /// t.copy_from_slice_(&[1.0f32, 2.0, 3.0, 4.0])?;
    /// assert_eq!(t.to_vec::<f32>()?, vec![1.0, 2.0, 3.0, 4.0]);
    /// # Ok::<_, ndscope::Error>(()) })?; Ok::<(), ndscope::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::ElementType`] when `T` is not the tensor's dtype; [`Error::DataLength`] when `data`
    /// has the wrong length.
    pub fn copy_from_slice_<T: Element>(&mut self, data: &[T]) -> Result<()> {
        self.check_dtype::<T>("copy_from_slice_")?;
        if data.len() != self.numel() {
            return Err(Error::DataLength {
                op: "copy_from_slice_",
                expected: self.numel(),
                got: data.len(),
            });
        }
        self.make_unique_contiguous()?;
        #[cfg(feature = "cuda")]
        if self.device().is_cuda() {
            return crate::cuda::transfer::upload(data, self);
        }
        self.fresh_mut::<T>().copy_from_slice(data);
        Ok(())
    }

    /// Sets every element to `value` in place.
    pub fn fill_(&mut self, value: f64) -> Result<()> {
        with_dtype!(self.dtype(), T => {
            let v = T::from_f64(value);
            self.apply_::<T>((Unary::Fill, [value, 0.0]), move |_| v)
        })
    }
}
