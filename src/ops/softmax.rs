//! Softmax and log-softmax, numerically stable: each row is shifted by its maximum before `exp`.

use std::panic::Location;

use crate::dtype::DType;
use crate::error::Result;
use crate::layout::resolve_axis;
use crate::ops::require_float;
use crate::tensor::Tensor;

impl<'s> Tensor<'s> {
    #[track_caller]
    fn softmax_impl(&self, op: &'static str, axis: isize, log: bool) -> Result<Tensor<'s>> {
        let axis = resolve_axis(op, axis, self.rank())?;
        require_float(op, self)?;
        let last = self.rank() - 1;
        // Work on rows along the last axis of a contiguous tensor; move `axis` there first if needed.
        let moved = if axis == last {
            self.contiguous()?
        } else {
            self.transpose(axis as isize, -1)?.contiguous()?
        };
        let mut out = Tensor::output_of(&[self], self.dtype(), moved.shape(), Location::caller())?;
        self.backend()?
            .softmax(self.dtype(), moved.src(), log, out.dst())?;
        if axis == last {
            Ok(out)
        } else {
            out.transpose(axis as isize, -1)
        }
    }

    /// `ln Σ e^x` of each row of float `[rows, classes]` values, as `[rows]` in the compute type
    /// (`f32`, or `f64` for `f64`): one read of the values, no `[rows, classes]` output.
    #[track_caller]
    pub(crate) fn row_logsumexp(&self) -> Result<Tensor<'s>> {
        debug_assert!(self.rank() == 2 && self.dtype().is_float());
        let x = self.contiguous()?;
        let compute = if x.dtype() == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        let mut out = Tensor::output_of(&[&x], compute, &x.shape()[..1], Location::caller())?;
        self.backend()?.logsumexp(x.dtype(), x.src(), out.dst())?;
        Ok(out)
    }

    /// The derivative of cross-entropy with respect to these logits (`[rows, classes]`, checked by
    /// the forward pass): `(softmax - (1 - ε) one_hot(labels) - ε / classes) · weight` per row, from
    /// each row's log-sum-exp `lse` and `weight` (both `[rows]` in the compute type).
    #[track_caller]
    pub(crate) fn cross_entropy_grad(
        &self,
        lse: &Tensor<'s>,
        labels: &Tensor<'s>,
        weight: &Tensor<'s>,
        smoothing: f64,
    ) -> Result<Tensor<'s>> {
        debug_assert!(self.rank() == 2 && labels.dtype() == DType::I64);
        let (x, lse, labels, weight) = (
            self.contiguous()?,
            lse.contiguous()?,
            labels.contiguous()?,
            weight.contiguous()?,
        );
        let mut out = Tensor::output_of(&[&x], x.dtype(), x.shape(), Location::caller())?;
        self.backend()?.cross_entropy_grad(
            x.dtype(),
            x.src(),
            lse.src(),
            labels.src(),
            weight.src(),
            smoothing,
            out.dst(),
        )?;
        Ok(out)
    }

    /// Softmax along `axis`: `exp(x - max) / Σ exp(x - max)`.
    ///
    /// ```
    /// # ndscope::root(ndscope::Device::Cpu, |s| {
    /// let p = s.from_slice(&[1000.0f32, 1000.0], &[2])?.softmax(-1)?; // no overflow
    /// assert_eq!(p.to_vec::<f32>()?, vec![0.5, 0.5]);
    /// # Ok::<_, ndscope::Error>(()) })?; Ok::<(), ndscope::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::AxisOutOfRange`](crate::Error::AxisOutOfRange);
    /// [`Error::UnsupportedDType`](crate::Error::UnsupportedDType) for integers.
    #[track_caller]
    pub fn softmax(&self, axis: isize) -> Result<Tensor<'s>> {
        self.softmax_impl("softmax", axis, false)
    }

    /// Log-softmax along `axis`: `x - max - ln Σ exp(x - max)`.
    #[track_caller]
    pub fn log_softmax(&self, axis: isize) -> Result<Tensor<'s>> {
        self.softmax_impl("log_softmax", axis, true)
    }
}
