//! Convolution and pooling layers over `[batch, channels, rows, cols]`.

use super::given;
use super::params::layer_parts;
use super::{Init, Mode, Module};
use crate::autograd::Var;
use crate::error::{Error, Result};
use crate::ops::Conv2dOptions;
use crate::scope::Scope;
use crate::tensor::Tensor;

/// A 2-D convolution ([`Var::conv2d`]) with a learned kernel and bias.
#[derive(Debug, Clone)]
pub struct Conv2d<'m> {
    /// `[out channels, in channels / groups, kh, kw]` (PyTorch's layout).
    pub weight: Tensor<'m>,
    /// `[out channels]`.
    pub bias: Tensor<'m>,
    options: Conv2dOptions,
}

impl<'m> Conv2d<'m> {
    /// A convolution from `in_channels` to `out_channels` with a `kernel` (`[rows, cols]`) placed by
    /// `options`; the weight drawn with `init` (fan-in `in_channels / groups · kh · kw`), the bias zero.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] for zero sizes, or channels that are not multiples of the groups.
    #[track_caller]
    pub fn new(
        scope: &Scope<'m>,
        in_channels: usize,
        out_channels: usize,
        kernel: [usize; 2],
        options: Conv2dOptions,
        init: Init,
    ) -> Result<Conv2d<'m>> {
        let groups = options.groups;
        if in_channels == 0
            || out_channels == 0
            || kernel.contains(&0)
            || groups == 0
            || !in_channels.is_multiple_of(groups)
            || !out_channels.is_multiple_of(groups)
        {
            return Err(Error::InvalidShape {
                op: "Conv2d::new",
                shape: vec![out_channels, in_channels, kernel[0], kernel[1]],
                reason: format!(
                    "needs positive channels and kernel, both channel counts multiples of the groups ({groups})"
                ),
            });
        }
        let shape = [out_channels, in_channels / groups, kernel[0], kernel[1]];
        Ok(Conv2d {
            weight: init.tensor(scope, &shape)?.named("weight"),
            bias: scope.zeros(&[out_channels])?.named("bias"),
            options,
        })
    }

    /// A convolution of tensors the caller holds: `weight` `[out channels, in channels / groups,
    /// kh, kw]` (PyTorch's layout) and `bias` `[out channels]`, placed by `options`. The tensors
    /// are taken as they are, so the layer lives in their scope.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] for a weight that is not 4-D with no zero dimension, output
    /// channels that are not a multiple of the groups, or a bias that is not `[out channels]`;
    /// [`Error::UnsupportedDType`], [`Error::DTypeMismatch`], [`Error::DeviceMismatch`].
    pub fn from_tensors(
        weight: Tensor<'m>,
        bias: Tensor<'m>,
        options: Conv2dOptions,
    ) -> Result<Conv2d<'m>> {
        let op = "Conv2d::from_tensors";
        let &[out_channels, per_group, kh, kw] = weight.shape() else {
            return Err(Error::InvalidShape {
                op,
                shape: weight.shape().to_vec(),
                reason: "the weight must be [out channels, in channels / groups, kh, kw]".into(),
            });
        };
        if options.groups == 0 || !out_channels.is_multiple_of(options.groups) {
            return Err(Error::InvalidShape {
                op,
                shape: weight.shape().to_vec(),
                reason: format!(
                    "the output channels must be a multiple of the groups ({})",
                    options.groups
                ),
            });
        }
        given::check(
            op,
            "weight",
            &weight,
            &[out_channels, per_group, kh, kw],
            None,
        )?;
        given::check(op, "bias", &bias, &[out_channels], Some(&weight))?;
        Ok(Conv2d {
            weight,
            bias,
            options,
        })
    }

    /// Where the windows go.
    pub fn options(&self) -> &Conv2dOptions {
        &self.options
    }
}

impl<'m> Module<'m> for Conv2d<'m> {
    fn forward<'t, 's>(&self, x: &Var<'t, 's>, _mode: Mode) -> Result<Var<'t, 's>>
    where
        'm: 's,
    {
        let tape = x.tape();
        x.conv2d(
            &tape.param(&self.weight),
            Some(&tape.param(&self.bias)),
            &self.options,
        )
    }
}

layer_parts!(Conv2d {
    tensors: [weight, bias],
    layers: [],
    plain: [options]
});

/// Which statistic a [`Pool2d`] takes of each window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolKind {
    /// The largest element ([`Var::max_pool2d`]).
    Max,
    /// The mean, padding counted as zeros ([`Var::avg_pool2d`]).
    Average,
}

/// Max or average pooling over `kernel` windows; no parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pool2d {
    /// The statistic.
    pub kind: PoolKind,
    /// Window rows and columns.
    pub kernel: [usize; 2],
    /// Step between windows (PyTorch's default: the kernel).
    pub stride: [usize; 2],
    /// Padding on each side (at most half the kernel).
    pub padding: [usize; 2],
}

impl Pool2d {
    /// Max pooling over non-overlapping `kernel` windows (PyTorch's `MaxPool2d(kernel)`).
    pub fn max(kernel: [usize; 2]) -> Pool2d {
        Pool2d {
            kind: PoolKind::Max,
            kernel,
            stride: kernel,
            padding: [0, 0],
        }
    }

    /// Average pooling over non-overlapping `kernel` windows.
    pub fn average(kernel: [usize; 2]) -> Pool2d {
        Pool2d {
            kind: PoolKind::Average,
            ..Pool2d::max(kernel)
        }
    }
}

impl<'m> Module<'m> for Pool2d {
    fn forward<'t, 's>(&self, x: &Var<'t, 's>, _mode: Mode) -> Result<Var<'t, 's>>
    where
        'm: 's,
    {
        match self.kind {
            PoolKind::Max => x.max_pool2d(self.kernel, self.stride, self.padding),
            PoolKind::Average => x.avg_pool2d(self.kernel, self.stride, self.padding),
        }
    }
}
