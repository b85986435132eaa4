//! Masking: `masked_fill`, and `tril`/`triu`, which keep one triangle of the last two dimensions.
//!
//! A triangle is a `[rows, cols]` 0/1 mask built on the host and uploaded into the operand's owner
//! (rows × cols elements, small next to the tensor it masks), then applied with `where_cond`, so the
//! ops run on every device with no kernel of their own and a masked NaN or infinity does not leak
//! through a multiplication by zero.

use std::panic::Location;

use crate::dtype::{DType, with_dtype};
use crate::error::{Error, Result};
use crate::ops::same_device;
use crate::tensor::Tensor;

/// Which triangle a mask marks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Triangle {
    /// Element `(i, j)` with `j - i <= k`: on or below the `k`-th diagonal.
    Lower,
    /// Element `(i, j)` with `j - i >= k`: on or above the `k`-th diagonal.
    Upper,
}

impl Triangle {
    fn contains(self, i: usize, j: usize, k: isize) -> bool {
        let d = j as i128 - i as i128;
        match self {
            Triangle::Lower => d <= k as i128,
            Triangle::Upper => d >= k as i128,
        }
    }
}

impl<'s> Tensor<'s> {
    /// A `[rows, cols]` tensor of `dtype` in this tensor's owner and device, `1` inside `triangle`
    /// (relative to the `k`-th diagonal) and `0` outside.
    pub(crate) fn triangle_mask(
        &self,
        rows: usize,
        cols: usize,
        triangle: Triangle,
        k: isize,
        dtype: DType,
        at: &'static Location<'static>,
    ) -> Result<Tensor<'s>> {
        let mut mask = Tensor::output_of(&[self], dtype, &[rows, cols], at)?;
        with_dtype!(dtype, T => mask.upload(&triangle_values::<T>(rows, cols, triangle, k))?);
        Ok(mask)
    }

    /// A `[]` tensor holding `value`, in this tensor's owner, device and dtype.
    fn scalar_like(&self, value: f64, at: &'static Location<'static>) -> Result<Tensor<'s>> {
        let mut v = Tensor::output_of(&[self], self.dtype(), &[], at)?;
        v.fill_(value)?;
        Ok(v)
    }

    /// `value` where `mask` is non-zero, the element of `self` elsewhere; `mask` broadcasts against
    /// `self` and may have any dtype. The result has `self`'s shape.
    ///
    /// ```
    /// # ndscope::root(ndscope::Device::Cpu, |s| {
    /// let x = s.from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2])?;
    /// let mask = s.from_slice(&[0i64, 1], &[2])?; // broadcast over the rows
    /// assert_eq!(x.masked_fill(&mask, -1.0)?.to_vec::<f32>()?, vec![1.0, -1.0, 3.0, -1.0]);
    /// # Ok::<_, ndscope::Error>(()) })?; Ok::<(), ndscope::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when `mask` does not broadcast to `self`'s shape;
    /// [`Error::DeviceMismatch`]; allocation errors.
    #[track_caller]
    pub fn masked_fill(&self, mask: &Tensor<'s>, value: f64) -> Result<Tensor<'s>> {
        let at = Location::caller();
        same_device("masked_fill", self, mask)?;
        let mask = mask.broadcast_within("masked_fill", self.shape())?;
        let fill = self.scalar_like(value, at)?;
        Tensor::where_cond(&mask, &fill, self)
    }

    /// The elements on and below the `k`-th diagonal of the last two dimensions (`k = 0` the main
    /// diagonal, `k > 0` above it, `k < 0` below it); zero elsewhere. PyTorch's `tril`.
    ///
    /// ```
    /// # ndscope::root(ndscope::Device::Cpu, |s| {
    /// let x = s.ones(&[2, 3])?;
    /// assert_eq!(x.tril(0)?.to_vec::<f32>()?, vec![1.0, 0.0, 0.0, 1.0, 1.0, 0.0]);
    /// assert_eq!(x.triu(1)?.to_vec::<f32>()?, vec![0.0, 1.0, 1.0, 0.0, 0.0, 1.0]);
    /// # Ok::<_, ndscope::Error>(()) })?; Ok::<(), ndscope::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidShape`] for a tensor of rank below 2; allocation errors.
    #[track_caller]
    pub fn tril(&self, k: isize) -> Result<Tensor<'s>> {
        self.keep_triangle("tril", Triangle::Lower, k, Location::caller())
    }

    /// The elements on and above the `k`-th diagonal of the last two dimensions; zero elsewhere.
    /// PyTorch's `triu`; see [`tril`](Self::tril).
    ///
    /// # Errors
    /// [`Error::InvalidShape`] for a tensor of rank below 2; allocation errors.
    #[track_caller]
    pub fn triu(&self, k: isize) -> Result<Tensor<'s>> {
        self.keep_triangle("triu", Triangle::Upper, k, Location::caller())
    }

    fn keep_triangle(
        &self,
        op: &'static str,
        triangle: Triangle,
        k: isize,
        at: &'static Location<'static>,
    ) -> Result<Tensor<'s>> {
        let (rows, cols) = self.matrix_dims(op)?;
        let keep = self.triangle_mask(rows, cols, triangle, k, self.dtype(), at)?;
        let zero = self.scalar_like(0.0, at)?;
        Tensor::where_cond(&keep, self, &zero)
    }

    /// The last two dimensions, or an error naming `op` for a tensor of rank below 2.
    pub(crate) fn matrix_dims(&self, op: &'static str) -> Result<(usize, usize)> {
        match *self.shape() {
            [.., rows, cols] => Ok((rows, cols)),
            _ => Err(Error::InvalidShape {
                op,
                shape: self.shape().to_vec(),
                reason: "needs at least two dimensions (the matrix is the last two)".into(),
            }),
        }
    }

    /// This tensor as a view broadcast to `shape`, which it must not extend: a mask may repeat
    /// over `shape` but not make the result larger than the tensor it masks.
    fn broadcast_within(&self, op: &'static str, shape: &[usize]) -> Result<Tensor<'s>> {
        let fits = self.rank() <= shape.len()
            && self
                .shape()
                .iter()
                .rev()
                .zip(shape.iter().rev())
                .all(|(&m, &s)| m == s || m == 1);
        if !fits {
            return Err(Error::ShapeMismatch {
                op,
                lhs: shape.to_vec(),
                rhs: self.shape().to_vec(),
                hint: "the mask must broadcast to the shape of the tensor it masks",
            });
        }
        self.broadcast_to(shape)
    }
}

fn triangle_values<T: crate::dtype::Element>(
    rows: usize,
    cols: usize,
    triangle: Triangle,
    k: isize,
) -> Vec<T> {
    let mut values = Vec::with_capacity(rows * cols);
    for i in 0..rows {
        values.extend((0..cols).map(|j| {
            if triangle.contains(i, j, k) {
                T::one()
            } else {
                T::zero()
            }
        }));
    }
    values
}
