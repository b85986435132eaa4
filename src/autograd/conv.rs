//! Convolution and pooling over `[batch, channels, rows, cols]`, made of `unfold2d` (whose
//! derivative is `fold2d`), matrix products and reductions: one host kernel and one GPU kernel per
//! direction serve all of them.

use std::panic::Location;

use smallvec::smallvec;

use super::Var;
use crate::error::{Error, Result};
use crate::ops::{Conv2dOptions, Window2d, window};

impl<'t, 's> Var<'t, 's> {
    /// The sliding windows as columns ([`Tensor::unfold2d`](crate::Tensor::unfold2d)); the
    /// derivative sums the columns' gradients back with `fold2d`.
    ///
    /// # Errors
    /// As for [`Tensor::unfold2d`](crate::Tensor::unfold2d).
    #[track_caller]
    pub fn unfold2d(&self, kernel: [usize; 2], options: &Conv2dOptions) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        let w = window("unfold2d", self.shape(), kernel, options)?;
        self.windows("unfold2d", w, 0.0, Location::caller())
    }

    /// The columns of the window `w` of this value, with `pad` in the padding, recorded with
    /// `fold2d` as the derivative.
    fn windows(
        &self,
        op: &'static str,
        w: Window2d,
        pad: f64,
        at: &'static Location<'static>,
    ) -> Result<Var<'t, 's>> {
        let out = self.value.unfold_window(&w, pad, at)?;
        Var::record(&[self], op, out, move |g, _| {
            Ok(smallvec![Some(g.fold_window(&w, at)?)])
        })
    }

    /// 2-D cross-correlation (PyTorch's `conv2d`) of `self` (`[batch, in channels, rows, cols]`)
    /// with `weight` (`[out channels, in channels / groups, kh, kw]`) plus an optional `bias`
    /// (`[out channels]`): `out[n, o, y, x] = bias[o] + Σ_{c, i, j} weight[o, c, i, j] ·
    /// input[n, g·C/G + c, y·sh + i·dh - ph, x·sw + j·dw - pw]` over the group `g` of `o`, with zeros
    /// in the padding. Computed as `unfold2d` and one (batched) matrix product.
    ///
    /// ```
    /// use ndscope::{Conv2dOptions, Device, Tape, root};
    /// root(Device::Cpu, |s| {
    ///     let tape = Tape::no_grad(s);
    ///     let x = tape.constant(&s.ones(&[1, 1, 4, 4])?);
    ///     let w = tape.constant(&s.ones(&[2, 1, 3, 3])?);
    ///     let same = Conv2dOptions { padding: [1, 1], ..Conv2dOptions::default() };
    ///     let y = x.conv2d(&w, None, &same)?;
    ///     assert_eq!(y.shape(), &[1, 2, 4, 4]);
    ///     assert_eq!(y.value().to_vec::<f32>()?[..4], [4.0, 6.0, 6.0, 4.0]); // a corner sees 4 ones
    ///     Ok::<_, ndscope::Error>(())
    /// })?;
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidShape`] for the window errors of [`Tensor::unfold2d`](crate::Tensor::unfold2d),
    /// or a weight whose rank is not 4 or whose channels do not match the input and groups;
    /// [`Error::ShapeMismatch`] for a bias of another length than the output channels.
    #[track_caller]
    pub fn conv2d(
        &self,
        weight: &Var<'t, 's>,
        bias: Option<&Var<'t, 's>>,
        options: &Conv2dOptions,
    ) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        const OP: &str = "conv2d";
        if let Some([x, w]) = Var::autocast_operands([self, weight])? {
            return x.conv2d(&w, bias, options);
        }
        let at = Location::caller();
        let &[out_channels, group_channels, kh, kw] = weight.shape() else {
            return Err(Error::InvalidShape {
                op: OP,
                shape: weight.shape().to_vec(),
                reason: "the weight must be [out channels, in channels / groups, kh, kw]".into(),
            });
        };
        let groups = options.groups;
        let in_channels = self.shape().get(1).copied().unwrap_or(0);
        if groups == 0
            || !out_channels.is_multiple_of(groups)
            || group_channels * groups != in_channels
        {
            return Err(Error::InvalidShape {
                op: OP,
                shape: weight.shape().to_vec(),
                reason: format!(
                    "an input of {in_channels} channels in {groups} groups needs a weight of shape \
                     [out channels (a multiple of {groups}), {}, kh, kw]",
                    in_channels.checked_div(groups).unwrap_or(0)
                ),
            });
        }
        if let Some(b) = bias
            && b.shape() != [out_channels]
        {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: weight.shape().to_vec(),
                rhs: b.shape().to_vec(),
                hint: "the bias needs one element per output channel",
            });
        }
        let w = window(OP, self.shape(), [kh, kw], options)?;
        let batch = self.shape()[0];
        let windows = w.output[0] * w.output[1];
        let taps = group_channels * kh * kw;
        let cols = self.windows(OP, w, 0.0, at)?;
        let out = if groups == 1 {
            // [out, taps] @ [batch, taps, windows]: one weight for the whole batch.
            weight.reshape(&[out_channels, taps])?.matmul(&cols)?
        } else {
            let per_group = out_channels / groups;
            weight
                .reshape(&[groups, per_group, taps])?
                .matmul(&cols.reshape(&[batch, groups, taps, windows])?)?
                .reshape(&[batch, out_channels, windows])?
        };
        let out = match bias {
            Some(b) => out.add(&b.reshape(&[out_channels, 1])?)?,
            None => out,
        };
        out.reshape(&[batch, out_channels, w.output[0], w.output[1]])
    }

    /// 2-D max pooling: the largest element of each `kernel` window (PyTorch's `max_pool2d`, with
    /// `-inf` in the padding, which PyTorch limits to half the kernel); the gradient goes to the
    /// maxima (shared equally between ties).
    ///
    /// # Errors
    /// As for [`Tensor::unfold2d`](crate::Tensor::unfold2d); [`Error::InvalidShape`] for padding
    /// larger than half the kernel.
    #[track_caller]
    pub fn max_pool2d(
        &self,
        kernel: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
    ) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        self.pool("max_pool2d", kernel, stride, padding, Location::caller())
    }

    /// 2-D average pooling: the mean of each `kernel` window, padding counted as zeros (PyTorch's
    /// `avg_pool2d` with `count_include_pad=True`, its default).
    ///
    /// # Errors
    /// As for [`max_pool2d`](Self::max_pool2d).
    #[track_caller]
    pub fn avg_pool2d(
        &self,
        kernel: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
    ) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        self.pool("avg_pool2d", kernel, stride, padding, Location::caller())
    }

    fn pool(
        &self,
        op: &'static str,
        kernel: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
        at: &'static Location<'static>,
    ) -> Result<Var<'t, 's>> {
        if padding[0] * 2 > kernel[0] || padding[1] * 2 > kernel[1] {
            return Err(Error::InvalidShape {
                op,
                shape: self.shape().to_vec(),
                reason: format!("padding {padding:?} must be at most half the kernel {kernel:?}"),
            });
        }
        let options = Conv2dOptions {
            stride,
            padding,
            ..Conv2dOptions::default()
        };
        let w = window(op, self.shape(), kernel, &options)?;
        let (batch, channels) = (self.shape()[0], self.shape()[1]);
        let (pad, max) = match op {
            "max_pool2d" => (f64::NEG_INFINITY, true),
            _ => (0.0, false),
        };
        let taps = self.windows(op, w, pad, at)?.reshape(&[
            batch,
            channels,
            kernel[0] * kernel[1],
            w.output[0] * w.output[1],
        ])?;
        let pooled = if max {
            taps.max(&[2], false)?
        } else {
            taps.mean(&[2], false)?
        };
        pooled.reshape(&[batch, channels, w.output[0], w.output[1]])
    }

    /// Adaptive average pooling to `size` (`[rows, cols]`) outputs per plane: output `(i, j)`
    /// averages input rows `floor(i·H/h) .. ceil((i+1)·H/h)` and the same columns (PyTorch's
    /// `adaptive_avg_pool2d`). Computed as two products with averaging matrices.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] for an input not `[batch, channels, rows, cols]` or a zero `size`;
    /// [`Error::UnsupportedDType`] for integer inputs.
    #[track_caller]
    pub fn adaptive_avg_pool2d(&self, size: [usize; 2]) -> Result<Var<'t, 's>> {
        let _placed = self.placing();
        const OP: &str = "adaptive_avg_pool2d";
        let at = Location::caller();
        let &[_, _, rows, cols] = self.shape() else {
            return Err(Error::InvalidShape {
                op: OP,
                shape: self.shape().to_vec(),
                reason: "needs a tensor of shape [batch, channels, rows, cols]".into(),
            });
        };
        if size.contains(&0) || rows == 0 || cols == 0 {
            return Err(Error::InvalidShape {
                op: OP,
                shape: self.shape().to_vec(),
                reason: format!("needs a non-empty input and output size, got {size:?}"),
            });
        }
        let tape = self.tape();
        let ph = tape.constant(&self.value.adaptive_pool_matrix(rows, size[0], at)?);
        let pw = tape.constant(&self.value.adaptive_pool_matrix(cols, size[1], at)?);
        ph.matmul(self)?.matmul(&pw.t()?)
    }
}
