//! Joining tensors: `concat` along an existing axis, `stack` along a new one.

use std::panic::Location;

use crate::error::{Error, Result};
use crate::layout::{Shape, resolve_axis};
use crate::ops::{same_device, same_dtype};
use crate::tensor::Tensor;

impl<'s> Tensor<'s> {
    /// Joins `tensors` along `axis`; all other dimensions must match. The result belongs to the
    /// innermost scope among the inputs' owners.
    ///
    /// ```
    /// # ndscope::root(ndscope::Device::Cpu, |s| {
    /// let (a, b) = (s.zeros(&[1, 2])?, s.ones(&[2, 2])?);
    /// let c = ndscope::Tensor::concat(&[&a, &b], 0)?;
    /// assert_eq!(c.shape(), &[3, 2]);
    /// # Ok::<_, ndscope::Error>(()) })?; Ok::<(), ndscope::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::Empty`] for no tensors; [`Error::ShapeMismatch`], [`Error::DTypeMismatch`] between any
    /// input and the first.
    #[track_caller]
    pub fn concat(tensors: &[&Tensor<'s>], axis: isize) -> Result<Tensor<'s>> {
        const OP: &str = "concat";
        let first = *tensors.first().ok_or(Error::Empty { op: OP })?;
        let axis = resolve_axis(OP, axis, first.rank())?;
        let mut total = 0usize;
        for t in tensors {
            same_dtype(OP, first, t)?;
            same_device(OP, first, t)?;
            let same_rest = t.rank() == first.rank()
                && t.shape()
                    .iter()
                    .zip(first.shape())
                    .enumerate()
                    .all(|(d, (a, b))| d == axis || a == b);
            if !same_rest {
                return Err(Error::ShapeMismatch {
                    op: OP,
                    lhs: first.shape().to_vec(),
                    rhs: t.shape().to_vec(),
                    hint: "all dimensions but the joined axis must be equal",
                });
            }
            total = total
                .checked_add(t.shape()[axis])
                .ok_or_else(|| Error::SizeOverflow {
                    shape: first.shape().to_vec(),
                    element_bytes: first.dtype().size(),
                })?;
        }
        let mut shape: Shape = first.shape().into();
        shape[axis] = total;
        let mut out = Tensor::output_of(tensors, first.dtype(), &shape, Location::caller())?;
        let (backend, dtype) = (first.backend()?, first.dtype());
        let mut at = 0;
        for t in tensors {
            let len = t.shape()[axis];
            let part = out.layout().narrowed(axis, at, len)?;
            backend.copy(dtype, dtype, t.src(), out.dst_as(&part))?;
            at += len;
        }
        Ok(out)
    }

    /// Joins equally shaped `tensors` along a new axis inserted at `axis`.
    ///
    /// # Errors
    /// As [`concat`](Self::concat).
    #[track_caller]
    pub fn stack(tensors: &[&Tensor<'s>], axis: isize) -> Result<Tensor<'s>> {
        let first = *tensors.first().ok_or(Error::Empty { op: "stack" })?;
        for t in tensors {
            if t.shape() != first.shape() {
                return Err(Error::ShapeMismatch {
                    op: "stack",
                    lhs: first.shape().to_vec(),
                    rhs: t.shape().to_vec(),
                    hint: "stacked tensors must have equal shapes",
                });
            }
        }
        let views = tensors
            .iter()
            .map(|t| t.unsqueeze(axis))
            .collect::<Result<Vec<_>>>()?;
        let refs: Vec<&Tensor<'s>> = views.iter().collect();
        Tensor::concat(&refs, axis)
    }
}
