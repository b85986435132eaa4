//! Views: new layouts over the same block, no copy (except `reshape` of a strided tensor, which
//! must copy to keep row-major order).

use crate::error::{Error, Result};
use crate::layout::{checked_numel, resolve_axis};
use crate::tensor::Tensor;

impl<'s> Tensor<'s> {
    /// The same elements with another shape (same element count). A view of contiguous tensors; a
    /// strided tensor is copied first.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] when the element counts differ.
    #[track_caller]
    pub fn reshape(&self, shape: &[usize]) -> Result<Tensor<'s>> {
        let n = checked_numel(shape, self.dtype().size())?;
        if n != self.numel() {
            return Err(Error::InvalidShape {
                op: "reshape",
                shape: shape.to_vec(),
                reason: format!(
                    "it holds {n} elements but the tensor of shape {:?} holds {}",
                    self.shape(),
                    self.numel()
                ),
            });
        }
        if shape == self.shape() {
            return Ok(self.clone()); // nothing to do, whatever the strides
        }
        match self.layout().reshaped(shape) {
            Some(layout) => Ok(self.with_layout(layout)),
            None => {
                let c = self.contiguous()?;
                let layout = c
                    .layout()
                    .reshaped(shape)
                    .expect("a contiguous layout reshapes");
                Ok(c.with_layout(layout))
            }
        }
    }

    /// A 1-D view of all elements (copies a strided tensor).
    #[track_caller]
    pub fn flatten(&self) -> Result<Tensor<'s>> {
        self.reshape(&[self.numel()])
    }

    /// Swaps two axes (negative axes count from the end).
    pub fn transpose(&self, a: isize, b: isize) -> Result<Tensor<'s>> {
        let (a, b) = (
            resolve_axis("transpose", a, self.rank())?,
            resolve_axis("transpose", b, self.rank())?,
        );
        let mut perm: Vec<usize> = (0..self.rank()).collect();
        perm.swap(a, b);
        self.permute(&perm)
    }

    /// The transpose of a 2-D tensor.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] when the tensor is not 2-D.
    pub fn t(&self) -> Result<Tensor<'s>> {
        if self.rank() != 2 {
            return Err(Error::InvalidShape {
                op: "t",
                shape: self.shape().to_vec(),
                reason: "t() transposes 2-D tensors; use transpose(a, b) for other ranks".into(),
            });
        }
        self.transpose(0, 1)
    }

    /// Reorders the axes: axis `i` of the result is axis `perm[i]` of `self`.
    pub fn permute(&self, perm: &[usize]) -> Result<Tensor<'s>> {
        Ok(self.with_layout(self.layout().permuted("permute", perm)?))
    }

    /// The elements `start..start + len` along `axis`.
    pub fn narrow(&self, axis: isize, start: usize, len: usize) -> Result<Tensor<'s>> {
        let axis = resolve_axis("narrow", axis, self.rank())?;
        Ok(self.with_layout(self.layout().narrowed(axis, start, len)?))
    }

    /// The elements `range` along `axis` (the same as `narrow(axis, range.start, range.len())`).
    ///
    /// ```
    /// # ndscope::root(ndscope::Device::Cpu, |s| {
    /// let x = s.arange(0i64, 6, 1)?.reshape(&[2, 3])?;
    /// assert_eq!(x.slice(1, 1..3)?.to_vec::<i64>()?, vec![1, 2, 4, 5]);
    /// # Ok::<_, ndscope::Error>(()) })?; Ok::<(), ndscope::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidShape`] when the range is reversed or exceeds the axis.
    pub fn slice(&self, axis: isize, range: std::ops::Range<usize>) -> Result<Tensor<'s>> {
        if range.end < range.start {
            return Err(Error::InvalidShape {
                op: "slice",
                shape: self.shape().to_vec(),
                reason: format!("the range {range:?} is reversed"),
            });
        }
        self.narrow(axis, range.start, range.len())
    }

    /// A view with `shape`, repeating dimensions of size 1 (stride 0) and adding leading dimensions.
    pub fn broadcast_to(&self, shape: &[usize]) -> Result<Tensor<'s>> {
        Ok(self.with_layout(self.layout().broadcast_to(shape)?))
    }

    /// Removes an axis of size 1.
    pub fn squeeze(&self, axis: isize) -> Result<Tensor<'s>> {
        let axis = resolve_axis("squeeze", axis, self.rank())?;
        Ok(self.with_layout(self.layout().squeezed(axis)?))
    }

    /// Inserts an axis of size 1 at `axis` (`0..=rank`; negative counts from the end, `-1` appends).
    pub fn unsqueeze(&self, axis: isize) -> Result<Tensor<'s>> {
        let axis = resolve_axis("unsqueeze", axis, self.rank() + 1)?;
        Ok(self.with_layout(self.layout().unsqueezed(axis)))
    }
}
