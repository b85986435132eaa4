//! Sliding windows over `[batch, channels, rows, cols]` tensors: `unfold2d` (im2col) and its adjoint
//! `fold2d` (col2im), from which convolutions and pooling are made (`autograd::conv`).

use std::panic::Location;

use crate::backend::op::Window2d;
use crate::dtype::{DType, Element, with_float_dtype};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Where the windows of a convolution or a pooling go over the last two dimensions; PyTorch's
/// defaults are `Conv2dOptions::default()`: stride 1, no padding, dilation 1, one group.
///
/// ```
/// use ndscope::Conv2dOptions;
/// let same = Conv2dOptions { padding: [1, 1], ..Conv2dOptions::default() };
/// assert_eq!(same.stride, [1, 1]);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Conv2dOptions {
    /// Step between windows, rows and columns.
    pub stride: [usize; 2],
    /// Zero rows above and below, zero columns left and right.
    pub padding: [usize; 2],
    /// Step between a window's taps (1: adjacent elements).
    pub dilation: [usize; 2],
    /// Channel groups: input and output channels split into `groups` independent convolutions.
    pub groups: usize,
}

impl Default for Conv2dOptions {
    fn default() -> Conv2dOptions {
        Conv2dOptions {
            stride: [1, 1],
            padding: [0, 0],
            dilation: [1, 1],
            groups: 1,
        }
    }
}

/// The window of `kernel` over `input` (`[batch, channels, rows, cols]`), or an error naming `op`.
pub(crate) fn window(
    op: &'static str,
    input: &[usize],
    kernel: [usize; 2],
    options: &Conv2dOptions,
) -> Result<Window2d> {
    let bad = |reason: String| Error::InvalidShape {
        op,
        shape: input.to_vec(),
        reason,
    };
    let &[batch, channels, rows, cols] = input else {
        return Err(bad(
            "needs a tensor of shape [batch, channels, rows, cols]".into()
        ));
    };
    if channels == 0 || rows == 0 || cols == 0 {
        return Err(bad(
            "needs at least one channel, row and column (only the batch may be empty)".into(),
        ));
    }
    let positive = |v: [usize; 2]| v.iter().all(|&x| x > 0);
    if !positive(kernel) || !positive(options.stride) || !positive(options.dilation) {
        return Err(bad(format!(
            "kernel {kernel:?}, stride {:?} and dilation {:?} must be positive",
            options.stride, options.dilation
        )));
    }
    let mut output = [0; 2];
    for axis in 0..2 {
        let span = options.dilation[axis] * (kernel[axis] - 1) + 1;
        let padded = [rows, cols][axis] + 2 * options.padding[axis];
        if span > padded {
            return Err(bad(format!(
                "a window spanning {span} does not fit in {padded} (the padded {}); use a smaller \
                 kernel or dilation, or more padding",
                ["rows", "columns"][axis]
            )));
        }
        output[axis] = (padded - span) / options.stride[axis] + 1;
    }
    Ok(Window2d {
        planes: batch * channels,
        input: [rows, cols],
        kernel,
        stride: options.stride,
        padding: options.padding,
        dilation: options.dilation,
        output,
    })
}

impl<'s> Tensor<'s> {
    /// The sliding windows of `self` (`[batch, channels, rows, cols]`) as columns (im2col, PyTorch's
    /// `F.unfold`): a `[batch, channels · kh · kw, windows]` tensor whose column `l` holds the taps of
    /// window `l` (row-major over the output positions), channel-major then kernel row then kernel
    /// column. Taps in the padding read 0. `options.groups` plays no part.
    ///
    /// ```
    /// # ndscope::root(ndscope::Device::Cpu, |s| {
    /// let x = s.arange(0.0f32, 9.0, 1.0)?.reshape(&[1, 1, 3, 3])?;
    /// let cols = x.unfold2d([2, 2], &ndscope::Conv2dOptions::default())?;
    /// assert_eq!(cols.shape(), &[1, 4, 4]);
    /// // The first window covers 0 1 / 3 4.
    /// assert_eq!(cols.narrow(2, 0, 1)?.to_vec::<f32>()?, vec![0.0, 1.0, 3.0, 4.0]);
    /// # Ok::<_, ndscope::Error>(()) })?; Ok::<(), ndscope::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidShape`] unless `self` is `[batch, channels, rows, cols]` with positive
    /// channels, rows and columns, the kernel, stride and dilation are positive, and the window
    /// fits in the padded input.
    #[track_caller]
    pub fn unfold2d(&self, kernel: [usize; 2], options: &Conv2dOptions) -> Result<Tensor<'s>> {
        let w = window("unfold2d", self.shape(), kernel, options)?;
        self.unfold_window(&w, 0.0, Location::caller())
    }

    /// The columns of `w`'s windows, with `pad` in the padding (`-inf` for max pooling).
    pub(crate) fn unfold_window(
        &self,
        w: &Window2d,
        pad: f64,
        at: &'static Location<'static>,
    ) -> Result<Tensor<'s>> {
        let x = self.contiguous()?;
        let [batch, channels] = [self.shape()[0], self.shape()[1]];
        let shape = [
            batch,
            channels * w.kernel[0] * w.kernel[1],
            w.output[0] * w.output[1],
        ];
        let mut out = Tensor::output_of(&[self], self.dtype(), &shape, at)?;
        self.backend()?
            .unfold2d(self.dtype(), w, pad, x.src(), out.dst())?;
        Ok(out)
    }

    /// The adjoint of [`unfold2d`](Self::unfold2d) (col2im, PyTorch's `F.fold`): `self`
    /// (`[batch, channels · kh · kw, windows]`) summed back into a `[batch, channels, rows, cols]`
    /// tensor of the given `size` (`[rows, cols]`); every element is the sum of the taps that read it.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] as for `unfold2d` on the output shape, or when `self`'s shape is not
    /// the columns of that window.
    #[track_caller]
    pub fn fold2d(
        &self,
        size: [usize; 2],
        kernel: [usize; 2],
        options: &Conv2dOptions,
    ) -> Result<Tensor<'s>> {
        const OP: &str = "fold2d";
        let taps = kernel[0] * kernel[1];
        let (batch, rows) = match *self.shape() {
            [batch, rows, _] if taps > 0 && rows % taps == 0 => (batch, rows),
            _ => {
                return Err(Error::InvalidShape {
                    op: OP,
                    shape: self.shape().to_vec(),
                    reason: format!(
                        "needs columns of shape [batch, channels * {taps}, windows] for kernel {kernel:?}"
                    ),
                });
            }
        };
        let w = window(OP, &[batch, rows / taps, size[0], size[1]], kernel, options)?;
        if self.shape()[2] != w.output[0] * w.output[1] {
            return Err(Error::InvalidShape {
                op: OP,
                shape: self.shape().to_vec(),
                reason: format!(
                    "an output of {size:?} has {} windows of kernel {kernel:?}, not {}",
                    w.output[0] * w.output[1],
                    self.shape()[2]
                ),
            });
        }
        self.fold_window(&w, Location::caller())
    }

    /// The planes `w`'s columns (`self`) sum back into.
    pub(crate) fn fold_window(
        &self,
        w: &Window2d,
        at: &'static Location<'static>,
    ) -> Result<Tensor<'s>> {
        let cols = self.contiguous()?;
        let channels = self.shape()[1] / (w.kernel[0] * w.kernel[1]);
        let shape = [self.shape()[0], channels, w.input[0], w.input[1]];
        let mut out = Tensor::output_of(&[self], self.dtype(), &shape, at)?;
        self.backend()?
            .fold2d(self.dtype(), w, cols.src(), out.dst())?;
        Ok(out)
    }

    /// The `[output, input]` matrix of adaptive average pooling along one axis: row `i` averages
    /// inputs `floor(i · input / output) .. ceil((i + 1) · input / output)` (PyTorch's windows), in
    /// this tensor's dtype, owner and device.
    pub(crate) fn adaptive_pool_matrix(
        &self,
        input: usize,
        output: usize,
        at: &'static Location<'static>,
    ) -> Result<Tensor<'s>> {
        let mut m = vec![0.0f64; output * input];
        for i in 0..output {
            let (start, end) = (i * input / output, ((i + 1) * input).div_ceil(output));
            for j in start..end {
                m[i * input + j] = 1.0 / (end - start) as f64;
            }
        }
        let mut t = Tensor::output_of(&[self], self.dtype(), &[output, input], at)?;
        with_float_dtype!(self.dtype(), T => t.upload(&m.iter().map(|&v| T::from_f64(v)).collect::<Vec<_>>())?, else {
            return Err(Error::UnsupportedDType {
                op: "adaptive_avg_pool2d",
                dtype: DType::I64,
                expected: "a float dtype",
            });
        });
        Ok(t)
    }
}
