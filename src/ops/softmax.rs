//! Softmax and log-softmax, numerically stable: each row is shifted by its maximum before `exp`.

use std::panic::Location;

use rayon::prelude::*;

use crate::dtype::{Float, with_float_dtype};
use crate::error::{Error, Result};
use crate::layout::resolve_axis;
use crate::ops::PARALLEL_MIN;
use crate::tensor::Tensor;

/// One row: `out = softmax(x)` or `log_softmax(x)`.
fn row<T: Float>(x: &[T], out: &mut [T], log: bool) {
    let m = x.iter().fold(T::lowest(), |a, &b| a.max_nan(b));
    if m == T::lowest() {
        // Every entry is -inf (a fully masked row): the distribution is undefined; PyTorch gives NaN.
        out.fill(T::from_f64(f64::NAN));
        return;
    }
    let mut sum = T::zero();
    for (o, &v) in out.iter_mut().zip(x) {
        let e = v.sub(m).exp();
        *o = e;
        sum = sum.add(e);
    }
    if log {
        let lse = sum.ln();
        for (o, &v) in out.iter_mut().zip(x) {
            *o = v.sub(m).sub(lse);
        }
    } else {
        let inv = sum.recip();
        out.iter_mut().for_each(|o| *o = o.mul(inv));
    }
}

impl<'s> Tensor<'s> {
    #[track_caller]
    fn softmax_impl(&self, op: &'static str, axis: isize, log: bool) -> Result<Tensor<'s>> {
        let axis = resolve_axis(op, axis, self.rank())?;
        let last = self.rank() - 1;
        // Work on rows along the last axis of a contiguous tensor; move `axis` there first if needed.
        let moved = if axis == last {
            self.contiguous()?
        } else {
            self.transpose(axis as isize, -1)?.contiguous()?
        };
        if !self.dtype().is_float() {
            return Err(Error::UnsupportedDType {
                op,
                dtype: self.dtype(),
                expected: "a float dtype (f32 or f64)",
            });
        }
        #[cfg(feature = "cuda")]
        if self.device().is_cuda() {
            let out = crate::cuda::ops::softmax_rows(self, &moved, log, Location::caller())?;
            return if axis == last {
                Ok(out)
            } else {
                out.transpose(axis as isize, -1)
            };
        }
        let mut out = Tensor::output_of(&[self], self.dtype(), moved.shape(), Location::caller())?;
        let n = moved.shape()[last];
        if n > 0 {
            with_float_dtype!(self.dtype(), T => {
                let off = moved.layout().offset();
                let x = &moved.block_data::<T>()[off..off + moved.numel()];
                let o = out.fresh_mut::<T>();
                if x.len() >= PARALLEL_MIN {
                    o.par_chunks_mut(n).zip(x.par_chunks(n)).for_each(|(o, x)| row(x, o, log));
                } else {
                    o.chunks_mut(n).zip(x.chunks(n)).for_each(|(o, x)| row(x, o, log));
                }
            }, else return Err(Error::UnsupportedDType { op, dtype: self.dtype(), expected: "a float dtype (f32 or f64)" }));
        }
        if axis == last {
            Ok(out)
        } else {
            out.transpose(axis as isize, -1)
        }
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
    /// [`Error::AxisOutOfRange`]; [`Error::UnsupportedDType`] for integers.
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
