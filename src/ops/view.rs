//! Views: new layouts over the same block, no copy (except `reshape` of a strided tensor, which
//! must copy to keep row-major order).

use std::panic::Location;

use smallvec::SmallVec;

use crate::error::{Error, Result};
use crate::layout::{Layout, checked_numel, resolve_axis};
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

/// Where a view's elements sit in its storage block: what gradients of views of parameters need.
impl<'s> Tensor<'s> {
    /// Elements in the tensor's storage block (the tensor it was created as, before any view).
    pub(crate) fn block_numel(&self) -> usize {
        self.block_bytes() / self.dtype().size()
    }

    /// The inverse of viewing a block through `view`: a contiguous `[block_numel]` tensor that holds
    /// `self` (shaped as `view`) at the elements `view` addresses and zero elsewhere. Elements the
    /// view repeats (a stride of 0, as `broadcast_to` makes) receive the sum of their copies. This
    /// is the gradient of a view of a parameter, in the coordinates of the parameter's block.
    #[track_caller]
    pub(crate) fn scatter_into_block(
        &self,
        view: &Layout,
        block_numel: usize,
    ) -> Result<Tensor<'s>> {
        debug_assert_eq!(self.shape(), view.shape());
        // The block's own layout (or a reshape of it): the gradient is already in block order.
        if view.is_whole(block_numel) {
            return self.contiguous()?.reshape(&[block_numel]);
        }
        // A repeated element's gradient is the sum over its copies: reduce those axes to size 1,
        // after which the view addresses each element at most once and a strided copy writes it.
        let repeated: SmallVec<[isize; 6]> = (0..view.rank())
            .filter(|&i| view.strides()[i] == 0 && view.shape()[i] > 1)
            .map(|i| i as isize)
            .collect();
        let (values, view) = if repeated.is_empty() {
            (self.clone(), view.clone())
        } else {
            let mut shape: SmallVec<[usize; 6]> = view.shape().into();
            repeated.iter().for_each(|&i| shape[i as usize] = 1);
            let layout = Layout::from_parts(&shape, view.strides(), view.offset());
            (self.sum(&repeated, true)?, layout)
        };
        let mut out = Tensor::output_of(
            &[&values],
            values.dtype(),
            &[block_numel],
            Location::caller(),
        )?;
        out.fill_(0.0)?;
        let dtype = values.dtype();
        values
            .backend()?
            .copy(dtype, dtype, values.src(), out.dst_as(&view))?;
        Ok(out)
    }
}
