//! The fully connected layer, in either weight layout.

use super::given;
use super::{Init, Mode, Module};
use crate::autograd::Var;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::scope::Scope;
use crate::scope::{Movable, MoveOut};
use crate::tensor::{QuantTensor, Tensor};
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
///
/// The weight may instead be block-quantized ([`Linear::from_quantized`]: GGUF's Q8_0, Q4_0,
/// Q4_K, …): the layer then computes `x Wᵀ` from the blocks
/// ([`Tensor::matmul_quantized_t`]), its weight is frozen (not a parameter: gradients flow
/// through it to `x` and to the bias only), and the dense [`weight`](Self::weight) field is empty.
#[derive(Debug, Clone)]
pub struct Linear<'m> {
    /// `[out_features, in_features]`, or `[in_features, out_features]` for [`WeightLayout::InOut`].
    /// Empty (`[0]`) in a layer whose weight is quantized: see
    /// [`quantized_weight`](Self::quantized_weight).
    pub weight: Tensor<'m>,
    /// `[out_features, in_features]` blocks, when the weight is block-quantized.
    quantized: Option<QuantTensor<'m>>,
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
            quantized: None,
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
            quantized: None,
            bias: bias
                .then(|| weights.parameter(scope, "bias", &[out_features], dtype))
                .transpose()?,
            layout,
        })
    }

    /// [`load`](Self::load), except that a weight stored block-quantized stays in its blocks
    /// ([`from_quantized`](Self::from_quantized), read `[out, in]` as the file stores it) when
    /// `keep_blocks`.
    #[track_caller]
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn load_keeping_blocks(
        scope: &Scope<'m>,
        weights: &Weights,
        in_features: usize,
        out_features: usize,
        bias: bool,
        layout: WeightLayout,
        dtype: DType,
        keep_blocks: bool,
    ) -> Result<Linear<'m>> {
        if !(keep_blocks && weights.quantized("weight")?.is_some()) {
            return Linear::load(
                scope,
                weights,
                in_features,
                out_features,
                bias,
                layout,
                dtype,
            );
        }
        check_features(in_features, out_features)?;
        Linear::from_quantized(
            weights.quantized_tensor(scope, "weight", &[out_features, in_features])?,
            bias.then(|| weights.parameter(scope, "bias", &[out_features], dtype))
                .transpose()?,
        )
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
            quantized: None,
            bias,
            layout,
        })
    }

    /// A layer computing `x Wᵀ + b` from the block-quantized `weight` (`[out, in]`, as GGUF files
    /// and llama.cpp store every matrix) and an optional float `bias` (`[out]`). The weight is a
    /// frozen constant: the layer's parameters are its bias alone, and training reaches the
    /// layer's input through it (the gradient `g W` uses the decoded weight).
    ///
    /// ```
    /// use ndscope::nn::{Linear, Mode, Module, Parameters};
    /// use ndscope::quant::QuantType;
    /// use ndscope::{Device, QuantTensor, Tape, root};
    ///
    /// root(Device::Cpu, |s| {
    ///     let w = s.from_slice(&(0..3 * 32).map(|i| (i % 9) as f32 / 8.0).collect::<Vec<_>>(), &[3, 32])?;
    ///     let layer = Linear::from_quantized(QuantTensor::quantize(&w, QuantType::Q8_0)?, None)?;
    ///     assert_eq!((layer.in_features(), layer.out_features()), (32, 3));
    ///     assert_eq!(layer.parameter_count(), 0); // the blocks are not trainable
    ///     let tape = Tape::no_grad(s);
    ///     let y = layer.forward(&tape.constant(&s.ones(&[2, 32])?), Mode::Eval)?;
    ///     assert_eq!(y.shape(), [2, 3]);
    ///     Ok::<_, ndscope::Error>(())
    /// })?;
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidShape`] for a bias that is not `[out]`; [`Error::UnsupportedDType`] for an
    /// integer bias; [`Error::DeviceMismatch`] for a bias on another device than the weight.
    #[track_caller]
    pub fn from_quantized(weight: QuantTensor<'m>, bias: Option<Tensor<'m>>) -> Result<Linear<'m>> {
        let [out_features, _] = weight.shape();
        let op = "Linear::from_quantized";
        if let Some(b) = &bias {
            given::check(op, "bias", b, &[out_features], None)?;
            crate::ops::same_device(op, weight.blocks(), b)?;
        }
        Ok(Linear {
            weight: weight.empty_like(DType::F32)?,
            quantized: Some(weight),
            bias,
            layout: WeightLayout::OutIn,
        })
    }

    /// The block-quantized weight (`[out, in]`) of a layer made by
    /// [`from_quantized`](Self::from_quantized); `None` when the weight is the dense
    /// [`weight`](Self::weight).
    pub fn quantized_weight(&self) -> Option<&QuantTensor<'m>> {
        self.quantized.as_ref()
    }

    /// How the weight is stored.
    pub fn layout(&self) -> WeightLayout {
        self.layout
    }

    /// Input features.
    pub fn in_features(&self) -> usize {
        if let Some(q) = &self.quantized {
            return q.shape()[1];
        }
        match self.layout {
            WeightLayout::OutIn => self.weight.shape()[1],
            WeightLayout::InOut => self.weight.shape()[0],
        }
    }

    /// Output features.
    pub fn out_features(&self) -> usize {
        if let Some(q) = &self.quantized {
            return q.shape()[0];
        }
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
        let biased = |y: Var<'t, 's>| match &self.bias {
            Some(bias) => y.add(&tape.param(bias)),
            None => Ok(y),
        };
        if let Some(q) = &self.quantized {
            return biased(x.matmul_quantized_t(q)?);
        }
        let param = tape.param(&self.weight);
        let weight = match self.layout {
            WeightLayout::OutIn => param.t()?,
            WeightLayout::InOut => param,
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

// By hand rather than `layer_parts!`: a quantized weight is moved with the layer but is not a
// parameter (optimizers, autocast and checkpoints see the bias alone).
impl<'m> super::Parameters<'m> for Linear<'m> {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor<'m>)) {
        if self.quantized.is_none() {
            f(&format!("{prefix}weight"), &self.weight);
        }
        if let Some(bias) = &self.bias {
            f(&format!("{prefix}bias"), bias);
        }
    }

    fn visit_mut(&mut self, f: &mut dyn FnMut(&mut Tensor<'m>) -> Result<()>) -> Result<()> {
        if self.quantized.is_none() {
            f(&mut self.weight)?;
        }
        if let Some(bias) = &mut self.bias {
            f(bias)?;
        }
        Ok(())
    }
}

impl<'m> Movable<'m> for Linear<'m> {
    type Moved<'b> = Linear<'b>;

    fn move_into<'b>(self, target: &Scope<'b>) -> Result<Linear<'b>> {
        Ok(Linear {
            weight: self.weight.move_into(target)?,
            quantized: self.quantized.move_into(target)?,
            bias: self.bias.move_into(target)?,
            layout: self.layout,
        })
    }
}

impl<'m> MoveOut<'m> for Linear<'m> {
    fn move_out(self) -> Result<Linear<'static>> {
        Ok(Linear {
            weight: self.weight.move_out()?,
            quantized: self.quantized.move_out()?,
            bias: self.bias.move_out()?,
            layout: self.layout,
        })
    }
}
