//! Elementwise ops: unary maps, binary ops with NumPy broadcasting, scalar ops, comparisons, `where`,
//! dtype casts, and in-place updates. What each computes is stated in `backend::op`; here are the
//! checks, the output's placement and the call into the operands' backend.

use std::panic::Location;

use crate::backend::op::{Binary, Unary, unary_maps};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::broadcast_shapes;
use crate::ops::{not_float, same_device, same_dtype};
use crate::tensor::Tensor;

/// The `Tensor` methods of the parameterless unary maps, from the list in `backend::op`.
macro_rules! unary_methods {
    ($($(#[$doc:meta])* $method:ident: $variant:ident = $code:literal, $define:literal, $domain:ident, |$x:ident| $body:expr;)*) => {
        impl<'s> Tensor<'s> {$(
            $(#[$doc])*
            ///
            /// # Errors
            /// [`Error::UnsupportedDType`] for integer tensors when the map is float-only; allocation
            /// errors.
            #[track_caller]
            pub fn $method(&self) -> Result<Tensor<'s>> {
                self.map(Unary::$variant, [0.0; 2])
            }
        )*}
    };
}

unary_maps!(unary_methods);

macro_rules! binary_ops {
    ($($(#[$doc:meta])* $name:ident => $variant:ident;)*) => {$(
        $(#[$doc])*
        ///
        /// # Errors
        /// When the shapes do not broadcast or the dtypes or devices differ.
        #[track_caller]
        pub fn $name(&self, other: &Tensor<'s>) -> Result<Tensor<'s>> {
            self.zip_with(other, stringify!($name), Binary::$variant, [0.0; 2])
        }
    )*};
}

impl<'s> Tensor<'s> {
    /// `op(self, other)` elementwise with broadcasting, into a new tensor.
    #[track_caller]
    pub(crate) fn zip_with(
        &self,
        other: &Tensor<'s>,
        name: &'static str,
        op: Binary,
        params: [f64; 2],
    ) -> Result<Tensor<'s>> {
        same_dtype(name, self, other)?;
        same_device(name, self, other)?;
        let backend = self.backend()?;
        if self.shape() == other.shape() {
            // The common case needs no broadcast layouts.
            let mut out = Tensor::output_of(
                &[self, other],
                self.dtype(),
                self.shape(),
                Location::caller(),
            )?;
            backend.binary(self.dtype(), op, params, self.src(), other.src(), out.dst())?;
            return Ok(out);
        }
        let shape = broadcast_shapes(name, self.shape(), other.shape())?;
        let (la, lb) = (
            self.layout().broadcast_to(&shape)?,
            other.layout().broadcast_to(&shape)?,
        );
        let mut out = Tensor::output_of(&[self, other], self.dtype(), &shape, Location::caller())?;
        let (a, b) = (self.src_as(&la), other.src_as(&lb));
        backend.binary(self.dtype(), op, params, a, b, out.dst())?;
        Ok(out)
    }

    /// `op(self)` elementwise into a new tensor.
    #[track_caller]
    pub(crate) fn map(&self, op: Unary, params: [f64; 2]) -> Result<Tensor<'s>> {
        if op.float_only() && !self.dtype().is_float() {
            return Err(not_float(op.name(), self.dtype()));
        }
        let mut out = Tensor::output_of(&[self], self.dtype(), self.shape(), Location::caller())?;
        self.backend()?
            .unary(self.dtype(), op, params, self.src(), out.dst())?;
        Ok(out)
    }

    binary_ops! {
        /// `self + other`.
        add => Add;
        /// `self - other`.
        sub => Sub;
        /// `self * other`.
        mul => Mul;
        /// The larger of the two, elementwise (NaN if either is NaN).
        maximum => Maximum;
        /// The smaller of the two, elementwise (NaN if either is NaN).
        minimum => Minimum;
        /// `1` where `self == other`, else `0`, in the operands' dtype.
        eq => Eq;
        /// `1` where `self != other`, else `0`.
        ne => Ne;
        /// `1` where `self < other`, else `0`.
        lt => Lt;
        /// `1` where `self <= other`, else `0`.
        le => Le;
        /// `1` where `self > other`, else `0`.
        gt => Gt;
        /// `1` where `self >= other`, else `0`.
        ge => Ge;
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
        self.zip_with(other, "div", Binary::Div, [0.0; 2])
    }

    /// `self ^ other` elementwise (floats).
    ///
    /// # Errors
    /// When the shapes do not broadcast, the dtypes differ, or the dtype is an integer.
    #[track_caller]
    pub fn pow(&self, other: &Tensor<'s>) -> Result<Tensor<'s>> {
        if !self.dtype().is_float() {
            return Err(not_float("pow", self.dtype()));
        }
        self.zip_with(other, "pow", Binary::Pow, [0.0; 2])
    }

    /// `self + value` (the scalar is converted to the dtype).
    #[track_caller]
    pub fn add_scalar(&self, value: f64) -> Result<Tensor<'s>> {
        self.map(Unary::AddScalar, [value, 0.0])
    }

    /// `self - value` (the scalar is converted to the dtype).
    ///
    /// ```
    /// # ndscope::root(ndscope::Device::Cpu, |s| {
    /// let x = s.from_slice(&[1.0f32, 2.0], &[2])?;
    /// assert_eq!(x.sub_scalar(0.5)?.to_vec::<f32>()?, vec![0.5, 1.5]);
    /// # Ok::<_, ndscope::Error>(()) })?; Ok::<(), ndscope::Error>(())
    /// ```
    #[track_caller]
    pub fn sub_scalar(&self, value: f64) -> Result<Tensor<'s>> {
        self.map(Unary::AddScalar, [-value, 0.0])
    }

    /// `self * value`.
    #[track_caller]
    pub fn mul_scalar(&self, value: f64) -> Result<Tensor<'s>> {
        self.map(Unary::MulScalar, [value, 0.0])
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
        self.map(Unary::DivScalar, [value, 0.0])
    }

    /// `self ^ exponent` (floats).
    #[track_caller]
    pub fn powf(&self, exponent: f64) -> Result<Tensor<'s>> {
        self.map(Unary::Powf, [exponent, 0.0])
    }

    /// Limits every element to `[min, max]` (NaN stays NaN).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `min > max` or either bound is NaN.
    #[track_caller]
    pub fn clamp(&self, min: f64, max: f64) -> Result<Tensor<'s>> {
        if min.is_nan() || max.is_nan() || min > max {
            return Err(Error::InvalidArgument {
                op: "clamp",
                reason: format!("the bounds [{min}, {max}] must be ordered numbers"),
            });
        }
        self.map(Unary::Clamp, [min, max])
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
        // The condition is read in the branches' dtype (an alias when it already has it).
        let cond = cond.to_dtype(on_true.dtype())?;
        let (lc, lt, lf) = (
            cond.layout().broadcast_to(&shape)?,
            on_true.layout().broadcast_to(&shape)?,
            on_false.layout().broadcast_to(&shape)?,
        );
        let mut out = Tensor::output_of(
            &[&cond, on_true, on_false],
            on_true.dtype(),
            &shape,
            Location::caller(),
        )?;
        on_true.backend()?.where_cond(
            on_true.dtype(),
            cond.src_as(&lc),
            on_true.src_as(&lt),
            on_false.src_as(&lf),
            out.dst(),
        )?;
        Ok(out)
    }

    /// The elements converted to `dtype` (an alias when it already has it; [`deep_copy`](Self::deep_copy)
    /// gives a private copy). Floats convert to integers by truncation, saturating at the integer
    /// range; NaN becomes 0.
    #[track_caller]
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor<'s>> {
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        if let Some(order) = self.dense_order() {
            // A permuted view of dense elements (a transposed weight): convert them in memory order
            // and give the result the same permutation, rather than gathering across rows.
            let inverse = inverse_permutation(&order);
            return self.permute(&order)?.to_dtype(dtype)?.permute(&inverse);
        }
        let mut out = Tensor::output_of(&[self], dtype, self.shape(), Location::caller())?;
        self.backend()?
            .copy(self.dtype(), dtype, self.src(), out.dst())?;
        Ok(out)
    }

    /// The axis order in which this non-contiguous view is contiguous (largest stride first), when
    /// it is a permutation of dense elements; `None` when it is contiguous already, or strided
    /// otherwise (broadcast, stepped or narrowed along an inner axis).
    fn dense_order(&self) -> Option<Vec<usize>> {
        if self.is_contiguous() || self.rank() < 2 {
            return None;
        }
        let strides = self.layout().strides();
        let mut order: Vec<usize> = (0..self.rank()).collect();
        order.sort_by_key(|&a| std::cmp::Reverse(strides[a]));
        let permuted = self.layout().permuted("to_dtype", &order).ok()?;
        permuted.is_contiguous().then_some(order)
    }

    /// Updates `self` in place with `op(self, other)`, `other` broadcast to `self`'s shape. Copies
    /// first when the block is shared (other handles keep the old values) or strided.
    fn update(&mut self, other: &Tensor<'_>, name: &'static str, op: Binary, p: f64) -> Result<()> {
        same_dtype(name, self, other)?;
        same_device(name, self, other)?;
        let lb = other
            .layout()
            .broadcast_to(self.shape())
            .map_err(|_| Error::ShapeMismatch {
                op: name,
                lhs: self.shape().to_vec(),
                rhs: other.shape().to_vec(),
                hint: "the operand of an in-place op must broadcast to the updated tensor's shape",
            })?;
        self.make_unique_contiguous()?;
        let (backend, dtype) = (self.backend()?, self.dtype());
        backend.binary_in_place(dtype, op, [p, 0.0], self.dst(), other.src_as(&lb))
    }

    /// `self += other` in place (`other` broadcasts to `self`'s shape).
    ///
    /// In-place ops never change what other handles see: when the block is shared (a clone or a view
    /// of it exists), `self` first gets a private copy. A borrowed view ([`as_slice`](Self::as_slice))
    /// blocks them at compile time.
    pub fn add_(&mut self, other: &Tensor<'_>) -> Result<()> {
        self.update(other, "add_", Binary::Add, 0.0)
    }

    /// `self -= other` in place.
    pub fn sub_(&mut self, other: &Tensor<'_>) -> Result<()> {
        self.update(other, "sub_", Binary::Sub, 0.0)
    }

    /// `self *= other` in place.
    pub fn mul_(&mut self, other: &Tensor<'_>) -> Result<()> {
        self.update(other, "mul_", Binary::Mul, 0.0)
    }

    /// `self += alpha * other` in place (the optimizer's update).
    pub fn axpy_(&mut self, alpha: f64, other: &Tensor<'_>) -> Result<()> {
        self.update(other, "axpy_", Binary::Axpy, alpha)
    }

    /// Overwrites `self` with `src` (broadcast to `self`'s shape) in place.
    pub fn copy_from_(&mut self, src: &Tensor<'_>) -> Result<()> {
        self.update(src, "copy_from_", Binary::Assign, 0.0)
    }

    /// Applies `op` to every element in place (after the copy-on-write step).
    fn apply_(&mut self, op: Unary, params: [f64; 2]) -> Result<()> {
        self.make_unique_contiguous()?;
        let (backend, dtype) = (self.backend()?, self.dtype());
        backend.unary_in_place(dtype, op, params, self.dst())
    }

    /// `self *= value` in place.
    pub fn mul_scalar_(&mut self, value: f64) -> Result<()> {
        self.apply_(Unary::MulScalar, [value, 0.0])
    }

    /// `self += value` in place.
    pub fn add_scalar_(&mut self, value: f64) -> Result<()> {
        self.apply_(Unary::AddScalar, [value, 0.0])
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
    pub fn copy_from_slice_<T: crate::dtype::Element>(&mut self, data: &[T]) -> Result<()> {
        self.check_dtype::<T>("copy_from_slice_")?;
        if data.len() != self.numel() {
            return Err(Error::DataLength {
                op: "copy_from_slice_",
                expected: self.numel(),
                got: data.len(),
            });
        }
        self.make_unique_contiguous()?;
        self.upload(data)
    }

    /// Overwrites the elements with `bytes`, little-endian in row-major order (a checkpoint's
    /// encoding): one copy (one upload on a GPU).
    pub(crate) fn copy_from_le_bytes_(&mut self, bytes: &[u8]) -> Result<()> {
        if bytes.len() != self.numel() * self.dtype().size() {
            return Err(Error::DataLength {
                op: "copy_from_le_bytes_",
                expected: self.numel() * self.dtype().size(),
                got: bytes.len(),
            });
        }
        self.make_unique_contiguous()?;
        self.upload_bytes(bytes)
    }

    /// Sets every element to `value` in place.
    pub fn fill_(&mut self, value: f64) -> Result<()> {
        self.apply_(Unary::Fill, [value, 0.0])
    }
}

/// The permutation that undoes `order`.
fn inverse_permutation(order: &[usize]) -> Vec<usize> {
    let mut inverse = vec![0; order.len()];
    for (i, &a) in order.iter().enumerate() {
        inverse[a] = i;
    }
    inverse
}
