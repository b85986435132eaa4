//! The fully connected layer, in either weight layout.

use super::given;
use super::params::layer_parts;
use super::{Init, Mode, Module};
use crate::autograd::Var;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::scope::Scope;
use crate::tensor::Tensor;
use crate::weights::Weights;

/// How a matrix weight is stored: which of its two dimensions is the input.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightLayout {
    /// `[out_features, in_features]`: PyTorch's `nn.Linear`, candle, ndscope's default.
    #[default]
    OutIn,
    /// `[in_features, out_features]`: Hugging Face's `Conv1D` (GPT-2's projections), JAX/Flax's
    /// `Dense`. The product reads the weight as stored; a checkpoint saved from such a layer keeps
    /// the layout, so the library that wrote it loads it back.
    InOut,
}

impl WeightLayout {
    /// The stored shape of a weight mapping `in_features` to `out_features`.
    pub fn shape(self, in_features: usize, out_features: usize) -> [usize; 2] {
        match self {
            WeightLayout::OutIn => [out_features, in_features],
            WeightLayout::InOut => [in_features, out_features],
        }
    }
}

/// `y = x Wᵀ + b` with `W` stored `[out_features, in_features]` (PyTorch's layout), or `y = x W +
/// b` with `W` stored `[in_features, out_features]` ([`WeightLayout::InOut`]); the bias
/// (`[out_features]`) is optional.
#[derive(Debug, Clone)]
pub struct Linear<'m> {
    /// `[out_features, in_features]`, or `[in_features, out_features]` for [`WeightLayout::InOut`].
    pub weight: Tensor<'m>,
    /// `[out_features]`, if the layer has a bias.
    pub bias: Option<Tensor<'m>>,
    layout: WeightLayout,
}

impl<'m> Linear<'m> {
    /// A layer in `scope` with `init`ialised weights (`[out, in]`) and zero bias.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] for a zero feature count; allocation errors.
    #[track_caller]
    pub fn new(
        scope: &Scope<'m>,
        in_features: usize,
        out_features: usize,
        init: Init,
    ) -> Result<Linear<'m>> {
        Linear::with_layout(
            scope,
            in_features,
            out_features,
            true,
            WeightLayout::OutIn,
            init,
        )
    }

    /// A layer in `scope` whose weight is stored in `layout` and `init`ialised (the
    /// initialisers' fan-in and fan-out follow the layout); a zero bias if `bias`.
    ///
    /// # Errors
    /// As for [`new`](Self::new).
    #[track_caller]
    pub fn with_layout(
        scope: &Scope<'m>,
        in_features: usize,
        out_features: usize,
        bias: bool,
        layout: WeightLayout,
        init: Init,
    ) -> Result<Linear<'m>> {
        check_features(in_features, out_features)?;
        // Initialisers read the fan-in from the last dimension (PyTorch's [out, in] convention):
        // draw in that layout and store the transpose.
        let weight = match layout {
            WeightLayout::OutIn => init.tensor(scope, &[out_features, in_features])?,
            WeightLayout::InOut => scope.scope(|draw| {
                let w = init.tensor(draw, &[out_features, in_features])?;
                draw.ret(w.t()?.contiguous()?)
            })?,
        };
        // Not in a closure: `#[track_caller]` names the caller's line as the bias's creation site.
        let bias = if bias {
            Some(scope.zeros(&[out_features])?.named("bias"))
        } else {
            None
        };
        Ok(Linear {
            weight: weight.named("weight"),
            bias,
            layout,
        })
    }

    /// A layer loaded from `weights`: `weight` stored in `layout` and, if `bias`, `bias`, as
    /// `dtype`.
    ///
    /// # Errors
    /// [`Error::MissingTensor`], [`Error::TensorMismatch`] (whose hint says when the weight is
    /// stored in the other layout); as for [`new`](Self::new).
    #[track_caller]
    pub fn load(
        scope: &Scope<'m>,
        weights: &Weights,
        in_features: usize,
        out_features: usize,
        bias: bool,
        layout: WeightLayout,
        dtype: DType,
    ) -> Result<Linear<'m>> {
        check_features(in_features, out_features)?;
        let shape = layout.shape(in_features, out_features);
        Ok(Linear {
            weight: weights.parameter(scope, "weight", &shape, dtype)?,
            bias: bias
                .then(|| weights.parameter(scope, "bias", &[out_features], dtype))
                .transpose()?,
            layout,
        })
    }

    /// A layer of tensors the caller holds: `weight` stored in `layout` (`[out, in]` for
    /// [`WeightLayout::OutIn`], `[in, out]` for [`WeightLayout::InOut`]) and an optional `bias`
    /// (`[out]`), as candle's `Linear::new(weight, bias)`. The tensors are taken as they are (not
    /// copied), so the layer lives in their scope.
    ///
    /// ```
    /// use ndscope::nn::{Linear, WeightLayout};
    /// use ndscope::{Device, root};
    ///
    /// root(Device::Cpu, |s| {
    ///     let weight = s.from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[3, 2])?; // [out, in]
    ///     let bias = s.from_slice(&[0.5f32, 0.0, -0.5], &[3])?;
    ///     let layer = Linear::from_tensors(weight, Some(bias), WeightLayout::OutIn)?;
    ///     assert_eq!((layer.in_features(), layer.out_features()), (2, 3));
    ///     Ok::<_, ndscope::Error>(())
    /// })?;
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidShape`] for a weight that is not a matrix with no zero dimension, or a bias
    /// that is not `[out]`; [`Error::UnsupportedDType`] for an integer weight;
    /// [`Error::DTypeMismatch`] and [`Error::DeviceMismatch`] for a bias unlike the weight.
    pub fn from_tensors(
        weight: Tensor<'m>,
        bias: Option<Tensor<'m>>,
        layout: WeightLayout,
    ) -> Result<Linear<'m>> {
        let &[rows, cols] = weight.shape() else {
            return Err(Error::InvalidShape {
                op: "Linear::from_tensors",
                shape: weight.shape().to_vec(),
                reason: "the weight must be a matrix: [out, in] (OutIn) or [in, out] (InOut)"
                    .into(),
            });
        };
        let shape = [rows, cols];
        given::check("Linear::from_tensors", "weight", &weight, &shape, None)?;
        let out_features = match layout {
            WeightLayout::OutIn => rows,
            WeightLayout::InOut => cols,
        };
        if let Some(b) = &bias {
            given::check(
                "Linear::from_tensors",
                "bias",
                b,
                &[out_features],
                Some(&weight),
            )?;
        }
        Ok(Linear {
            weight,
            bias,
            layout,
        })
    }

    /// How the weight is stored.
    pub fn layout(&self) -> WeightLayout {
        self.layout
    }

    /// Input features.
    pub fn in_features(&self) -> usize {
        match self.layout {
            WeightLayout::OutIn => self.weight.shape()[1],
            WeightLayout::InOut => self.weight.shape()[0],
        }
    }

    /// Output features.
    pub fn out_features(&self) -> usize {
        match self.layout {
            WeightLayout::OutIn => self.weight.shape()[0],
            WeightLayout::InOut => self.weight.shape()[1],
        }
    }
}

fn check_features(in_features: usize, out_features: usize) -> Result<()> {
    if in_features == 0 || out_features == 0 {
        return Err(Error::InvalidShape {
            op: "Linear",
            shape: vec![out_features, in_features],
            reason: "a linear layer needs at least one input and one output feature".into(),
        });
    }
    Ok(())
}

impl<'m> Module<'m> for Linear<'m> {
    fn forward<'t, 's>(&self, x: &Var<'t, 's>, _mode: Mode) -> Result<Var<'t, 's>>
    where
        'm: 's,
    {
        let tape = x.tape();
        let param = tape.param(&self.weight);
        let weight = match self.layout {
            WeightLayout::OutIn => param.t()?,
            WeightLayout::InOut => param,
        };
        let biased = |y: Var<'t, 's>| match &self.bias {
            Some(bias) => y.add(&tape.param(bias)),
            None => Ok(y),
        };
        if x.shape().len() <= 2 {
            return biased(x.matmul(&weight)?);
        }
        // [..., in] as one matrix: one product instead of a batch of small ones.
        let mut shape = x.shape().to_vec();
        let rows = shape[..shape.len() - 1].iter().product();
        let y = biased(x.reshape(&[rows, self.in_features()])?.matmul(&weight)?)?;
        *shape.last_mut().expect("rank > 2") = self.out_features();
        y.reshape(&shape)
    }
}

layer_parts!(Linear {
    tensors: [weight],
    layers: [bias],
    plain: [layout]
});
