//! Reductions over axes: sum, mean, max, min, argmax.

use std::panic::Location;

use smallvec::SmallVec;

use crate::backend::Backend;
use crate::backend::op::Reduce;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::{Shape, resolve_axis};
use crate::ops::require_float;
use crate::tensor::Tensor;

/// Resolves, sorts and deduplicates reduction axes.
fn reduced_axes(op: &'static str, axes: &[isize], rank: usize) -> Result<SmallVec<[usize; 6]>> {
    let mut out: SmallVec<[usize; 6]> = SmallVec::new();
    for &a in axes {
        let a = resolve_axis(op, a, rank)?;
        if out.contains(&a) {
            return Err(Error::InvalidArgument {
                op,
                reason: format!("axis {a} is named twice in {axes:?}"),
            });
        }
        out.push(a);
    }
    out.sort_unstable();
    Ok(out)
}

impl<'s> Tensor<'s> {
    /// Every axis, for reductions to a single value.
    fn all_axes(&self) -> SmallVec<[isize; 6]> {
        (0..self.rank() as isize).collect()
    }

    #[track_caller]
    fn reduce(
        &self,
        op: &'static str,
        kind: Reduce,
        axes: &[isize],
        keepdim: bool,
    ) -> Result<Tensor<'s>> {
        let axes = reduced_axes(op, axes, self.rank())?;
        if matches!(kind, Reduce::Max | Reduce::Min) && axes.iter().any(|&a| self.shape()[a] == 0) {
            return Err(Error::InvalidShape {
                op,
                shape: self.shape().to_vec(),
                reason: "cannot take the max or min over an empty axis".into(),
            });
        }
        let kept: Shape = self
            .shape()
            .iter()
            .enumerate()
            .map(|(i, &d)| if axes.contains(&i) { 1 } else { d })
            .collect();
        let mut out = Tensor::output_of(&[self], self.dtype(), &kept, Location::caller())?;
        let backend = self.backend()?;
        let (input, axes_there) = self.rows_for(backend, &axes)?;
        backend.reduce(self.dtype(), kind, input.src(), &axes_there, out.dst())?;
        if keepdim {
            return Ok(out);
        }
        let squeezed: Shape = self
            .shape()
            .iter()
            .enumerate()
            .filter(|(i, _)| !axes.contains(i))
            .map(|(_, &d)| d)
            .collect();
        out.reshape(&squeezed)
    }

    /// `self` in the form `backend` reduces over the sorted `axes`, and where those axes are in it: as
    /// it is when the backend reads any layout, else with the axes moved last and packed contiguously
    /// (rows of the reduced axes).
    fn rows_for(
        &self,
        backend: &dyn Backend,
        axes: &[usize],
    ) -> Result<(Tensor<'s>, SmallVec<[usize; 6]>)> {
        if backend.reads_any_layout() {
            return Ok((self.clone(), SmallVec::from_slice(axes)));
        }
        let perm: SmallVec<[usize; 6]> = (0..self.rank())
            .filter(|a| !axes.contains(a))
            .chain(axes.iter().copied())
            .collect();
        let trailing = (self.rank() - axes.len()..self.rank()).collect();
        Ok((self.permute(&perm)?.contiguous()?, trailing))
    }

    /// Sum over `axes` (negative axes count from the end); `keepdim` keeps them as size 1.
    ///
    /// ```
    /// # ndscope::root(ndscope::Device::Cpu, |s| {
    /// let x = s.from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3])?;
    /// assert_eq!(x.sum(&[1], false)?.to_vec::<f32>()?, vec![6.0, 15.0]);
    /// assert_eq!(x.sum(&[0], true)?.shape(), &[1, 3]);
    /// # Ok::<_, ndscope::Error>(()) })?; Ok::<(), ndscope::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::AxisOutOfRange`] for an axis outside the rank, [`Error::InvalidArgument`] for a repeated
    /// axis.
    #[track_caller]
    pub fn sum(&self, axes: &[isize], keepdim: bool) -> Result<Tensor<'s>> {
        self.reduce("sum", Reduce::Sum, axes, keepdim)
    }

    /// Mean over `axes` (floats).
    #[track_caller]
    pub fn mean(&self, axes: &[isize], keepdim: bool) -> Result<Tensor<'s>> {
        require_float("mean", self)?;
        self.reduce("mean", Reduce::Mean, axes, keepdim)
    }

    /// Maximum over `axes` (NaN if any element is NaN).
    #[track_caller]
    pub fn max(&self, axes: &[isize], keepdim: bool) -> Result<Tensor<'s>> {
        self.reduce("max", Reduce::Max, axes, keepdim)
    }

    /// Minimum over `axes` (NaN if any element is NaN).
    #[track_caller]
    pub fn min(&self, axes: &[isize], keepdim: bool) -> Result<Tensor<'s>> {
        self.reduce("min", Reduce::Min, axes, keepdim)
    }

    /// Sum of all elements, as a tensor of shape `[]`.
    #[track_caller]
    pub fn sum_all(&self) -> Result<Tensor<'s>> {
        self.reduce("sum_all", Reduce::Sum, &self.all_axes(), false)
    }

    /// Mean of all elements, as a tensor of shape `[]` (floats).
    #[track_caller]
    pub fn mean_all(&self) -> Result<Tensor<'s>> {
        self.mean(&self.all_axes(), false)
    }

    /// Resolves the axis of an argmax or argmin, which must not be empty.
    fn check_arg_axis(&self, op: &'static str, axis: isize) -> Result<usize> {
        let axis = resolve_axis(op, axis, self.rank())?;
        if self.shape()[axis] == 0 {
            return Err(Error::InvalidShape {
                op,
                shape: self.shape().to_vec(),
                reason: format!("axis {axis} is empty"),
            });
        }
        Ok(axis)
    }

    /// Index of the smallest element along `axis` as `i64` (the first one on ties; the first NaN if
    /// any).
    ///
    /// ```
    /// # ndscope::root(ndscope::Device::Cpu, |s| {
    /// let x = s.from_slice(&[3.0f32, 1.0, 2.0, 1.0], &[4])?;
    /// assert_eq!(x.argmin(0, false)?.to_vec::<i64>()?, vec![1]);
    /// # Ok::<_, ndscope::Error>(()) })?; Ok::<(), ndscope::Error>(())
    /// ```
    ///
    /// # Errors
    /// As for [`argmax`](Self::argmax).
    #[track_caller]
    pub fn argmin(&self, axis: isize, keepdim: bool) -> Result<Tensor<'s>> {
        self.check_arg_axis("argmin", axis)?;
        // The first largest of an order-reversing map is the first smallest: `-x` for floats (NaN
        // stays NaN), `-x - 1` with wrapping for integers (exact, and `i64::MIN` maps to `i64::MAX`).
        let reversed = if self.dtype().is_float() {
            self.neg()?
        } else {
            self.neg()?.add_scalar(-1.0)?
        };
        reversed.argmax(axis, keepdim)
    }

    /// Index of the largest element along `axis` as `i64` (the first one on ties; the first NaN if
    /// any).
    ///
    /// # Errors
    /// [`Error::AxisOutOfRange`]; [`Error::InvalidShape`] when the axis is empty.
    #[track_caller]
    pub fn argmax(&self, axis: isize, keepdim: bool) -> Result<Tensor<'s>> {
        let axis = self.check_arg_axis("argmax", axis)?;
        let mut kept: Shape = SmallVec::from_slice(self.shape());
        kept[axis] = 1;
        let mut out = Tensor::output_of(&[self], DType::I64, &kept, Location::caller())?;
        let backend = self.backend()?;
        let (input, axis_there) = self.rows_for(backend, &[axis])?;
        backend.argmax(self.dtype(), input.src(), axis_there[0], out.dst())?;
        if keepdim {
            Ok(out)
        } else {
            out.squeeze(axis as isize)
        }
    }
}
