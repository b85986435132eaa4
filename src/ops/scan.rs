//! Running sums: `cumsum` along an axis.

use std::panic::Location;

use crate::error::Result;
use crate::layout::resolve_axis;
use crate::tensor::Tensor;

impl<'s> Tensor<'s> {
    /// Running sums along `axis`: `out[.., i, ..] = Σ_{j <= i} self[.., j, ..]` (PyTorch's `cumsum`),
    /// added in index order on every device. Integer tensors sum in `i64` with wrap-around.
    ///
    /// ```
    /// # ndscope::root(ndscope::Device::Cpu, |s| {
    /// let x = s.from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3])?;
    /// assert_eq!(x.cumsum(1)?.to_vec::<f32>()?, vec![1.0, 3.0, 6.0, 4.0, 9.0, 15.0]);
    /// assert_eq!(x.cumsum(0)?.to_vec::<f32>()?, vec![1.0, 2.0, 3.0, 5.0, 7.0, 9.0]);
    /// # Ok::<_, ndscope::Error>(()) })?; Ok::<(), ndscope::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::AxisOutOfRange`](crate::Error::AxisOutOfRange) for an axis out of range (a rank-0
    /// tensor takes axis 0 or -1, as in PyTorch).
    #[track_caller]
    pub fn cumsum(&self, axis: isize) -> Result<Tensor<'s>> {
        self.scan("cumsum", axis, false, Location::caller())
    }

    /// Running sums from the end: `out[.., i, ..] = Σ_{j >= i} self[.., j, ..]` (the derivative of
    /// `cumsum`).
    pub(crate) fn reverse_cumsum(&self, axis: isize) -> Result<Tensor<'s>> {
        self.scan("cumsum", axis, true, Location::caller())
    }

    fn scan(
        &self,
        op: &'static str,
        axis: isize,
        reverse: bool,
        at: &'static Location<'static>,
    ) -> Result<Tensor<'s>> {
        if self.rank() == 0 {
            resolve_axis(op, axis, 1)?;
            return self.deep_copy();
        }
        let axis = resolve_axis(op, axis, self.rank())?;
        let last = self.rank() - 1;
        // Rows along the last axis of a contiguous tensor; move `axis` there first if needed.
        let moved = if axis == last {
            self.contiguous()?
        } else {
            self.transpose(axis as isize, -1)?.contiguous()?
        };
        let mut out = Tensor::output_of(&[self], self.dtype(), moved.shape(), at)?;
        self.backend()?
            .cumsum(self.dtype(), moved.src(), reverse, out.dst())?;
        if axis == last {
            Ok(out)
        } else {
            out.transpose(axis as isize, -1)?.contiguous()
        }
    }
}
