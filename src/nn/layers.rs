//! Activations, dropout and the `Sequential` container.

use super::{Init, Linear, Mode, Module, Parameters};
use crate::autograd::Var;
use crate::error::{Error, Result};
use crate::scope::{Movable, Scope};
use crate::tensor::Tensor;

/// An elementwise nonlinearity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `max(x, 0)`.
    Relu,
    /// GELU, tanh approximation: `0.5 x (1 + tanh(sqrt(2/π) (x + 0.044715 x³)))` (GPT-2's
    /// `gelu_new`, PyTorch's `approximate="tanh"`).
    Gelu,
    /// GELU, exact: `x Φ(x)` (PyTorch's default, Hugging Face's `gelu`).
    GeluExact,
    /// SiLU (swish), `x sigmoid(x)`.
    Silu,
    /// Hyperbolic tangent.
    Tanh,
    /// Logistic sigmoid.
    Sigmoid,
}

impl<'m> Module<'m> for Activation {
    fn forward<'t, 's>(&self, x: &Var<'t, 's>, _mode: Mode) -> Result<Var<'t, 's>>
    where
        'm: 's,
    {
        match self {
            Activation::Relu => x.relu(),
            Activation::Gelu => x.gelu(),
            Activation::GeluExact => x.gelu_exact(),
            Activation::Silu => x.silu(),
            Activation::Tanh => x.tanh(),
            Activation::Sigmoid => x.sigmoid(),
        }
    }
}

/// Zeroes each element with probability `p` in training and scales the rest by `1 / (1 - p)`; passes
/// values through in evaluation. Masks come from the scope tree's seeded generator.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dropout {
    p: f64,
}

impl Dropout {
    /// Dropout with drop probability `p`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] unless `0 <= p < 1`.
    pub fn new(p: f64) -> Result<Dropout> {
        if !(0.0..1.0).contains(&p) {
            return Err(Error::InvalidArgument {
                op: "Dropout::new",
                reason: format!("the drop probability must be in [0, 1), got {p}"),
            });
        }
        Ok(Dropout { p })
    }

    /// The drop probability.
    pub fn p(&self) -> f64 {
        self.p
    }
}

impl<'m> Module<'m> for Dropout {
    fn forward<'t, 's>(&self, x: &Var<'t, 's>, mode: Mode) -> Result<Var<'t, 's>>
    where
        'm: 's,
    {
        if mode == Mode::Eval || self.p == 0.0 {
            return Ok(x.clone());
        }
        let scope = x.tape().scope();
        let threshold = scope.full(&[], self.p)?;
        let keep = scope.rand(x.shape())?.ge(&threshold)?;
        let mask = keep
            .mul_scalar(1.0 / (1.0 - self.p))?
            .to_dtype(x.value().dtype())?;
        x.mul(&x.tape().constant(&mask))
    }
}

/// One stage of a [`Sequential`].
// A model holds a handful of layers, built once: boxing the large variant would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub enum Layer<'m> {
    /// A fully connected layer.
    Linear(Linear<'m>),
    /// A nonlinearity.
    Activation(Activation),
    /// Dropout.
    Dropout(Dropout),
}

impl<'m> Module<'m> for Layer<'m> {
    fn forward<'t, 's>(&self, x: &Var<'t, 's>, mode: Mode) -> Result<Var<'t, 's>>
    where
        'm: 's,
    {
        match self {
            Layer::Linear(l) => l.forward(x, mode),
            Layer::Activation(a) => <Activation as Module<'m>>::forward(a, x, mode),
            Layer::Dropout(d) => <Dropout as Module<'m>>::forward(d, x, mode),
        }
    }
}

/// Layers applied in order.
#[derive(Debug, Default, Clone)]
pub struct Sequential<'m> {
    layers: Vec<Layer<'m>>,
}

impl<'m> Sequential<'m> {
    /// An empty stack.
    pub fn new() -> Sequential<'m> {
        Sequential { layers: Vec::new() }
    }

    /// Appends a layer.
    pub fn push(mut self, layer: Layer<'m>) -> Sequential<'m> {
        self.layers.push(layer);
        self
    }

    /// The layers.
    pub fn layers(&self) -> &[Layer<'m>] {
        &self.layers
    }
}

/// A multilayer perceptron: `Linear` layers of the given `sizes` (`[inputs, hidden.., outputs]`)
/// with `activation` between them (not after the last).
///
/// # Errors
/// [`Error::InvalidShape`] for fewer than two sizes or a zero size; allocation errors.
#[track_caller]
pub fn mlp<'m>(
    scope: &Scope<'m>,
    sizes: &[usize],
    activation: Activation,
    init: Init,
) -> Result<Sequential<'m>> {
    if sizes.len() < 2 {
        return Err(Error::InvalidShape {
            op: "mlp",
            shape: sizes.to_vec(),
            reason: "needs at least an input and an output size".into(),
        });
    }
    let mut model = Sequential::new();
    for (i, pair) in sizes.windows(2).enumerate() {
        if i > 0 {
            model = model.push(Layer::Activation(activation));
        }
        model = model.push(Layer::Linear(Linear::new(scope, pair[0], pair[1], init)?));
    }
    Ok(model)
}

impl<'m> Module<'m> for Sequential<'m> {
    fn forward<'t, 's>(&self, x: &Var<'t, 's>, mode: Mode) -> Result<Var<'t, 's>>
    where
        'm: 's,
    {
        let mut y = x.clone();
        for layer in &self.layers {
            y = layer.forward(&y, mode)?;
        }
        Ok(y)
    }
}

impl<'m> Parameters<'m> for Sequential<'m> {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor<'m>)) {
        for (i, layer) in self.layers.iter().enumerate() {
            if let Layer::Linear(l) = layer {
                l.visit(&format!("{prefix}{i}."), f);
            }
        }
    }

    fn visit_mut(&mut self, f: &mut dyn FnMut(&mut Tensor<'m>) -> Result<()>) -> Result<()> {
        for layer in &mut self.layers {
            if let Layer::Linear(l) = layer {
                l.visit_mut(f)?;
            }
        }
        Ok(())
    }
}

impl<'m> Movable<'m> for Layer<'m> {
    type Moved<'b> = Layer<'b>;
    fn move_into<'b>(self, target: &Scope<'b>) -> Result<Layer<'b>> {
        Ok(match self {
            Layer::Linear(l) => Layer::Linear(l.move_into(target)?),
            Layer::Activation(a) => Layer::Activation(a),
            Layer::Dropout(d) => Layer::Dropout(d),
        })
    }
}

impl<'m> Movable<'m> for Sequential<'m> {
    type Moved<'b> = Sequential<'b>;
    fn move_into<'b>(self, target: &Scope<'b>) -> Result<Sequential<'b>> {
        Ok(Sequential {
            layers: self.layers.move_into(target)?,
        })
    }
}

/// Stateless layers have no parameters and move as they are, so a model struct may hold them.
macro_rules! stateless {
    ($($t:ty),*) => {$(
        impl<'m> Parameters<'m> for $t {
            fn visit(&self, _prefix: &str, _f: &mut dyn FnMut(&str, &Tensor<'m>)) {}

            fn visit_mut(&mut self, _f: &mut dyn FnMut(&mut Tensor<'m>) -> Result<()>) -> Result<()> {
                Ok(())
            }
        }

        impl<'m> Movable<'m> for $t {
            type Moved<'b> = $t;
            fn move_into<'b>(self, _target: &Scope<'b>) -> Result<$t> {
                Ok(self)
            }
        }
    )*};
}

stateless!(Activation, Dropout, super::Pool2d);
