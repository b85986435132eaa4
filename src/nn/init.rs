//! Weight initialisers drawing from the scope tree's seeded generator.

use crate::error::Result;
use crate::scope::Scope;
use crate::tensor::Tensor;

/// How to fill a weight of shape `[fan_out, fan_in]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// He et al. (2015) for ReLU networks: uniform in `±sqrt(6 / fan_in)`.
    KaimingUniform,
    /// He et al. (2015): normal with standard deviation `sqrt(2 / fan_in)`.
    KaimingNormal,
    /// Glorot & Bengio (2010) for tanh/sigmoid networks: uniform in `±sqrt(6 / (fan_in + fan_out))`.
    XavierUniform,
    /// Glorot & Bengio (2010): normal with standard deviation `sqrt(2 / (fan_in + fan_out))`.
    XavierNormal,
    /// Normal with mean 0 and the given standard deviation, whatever the fans (embeddings; GPT-2
    /// initialises its weights with 0.02).
    Normal(f64),
    /// Every element `value`.
    Constant(f64),
}

impl Init {
    /// A new `f32` tensor of `shape` (`[fan_out, fan_in]` for a weight) in `scope`, drawn with the
    /// tree's generator (seed it with [`Scope::set_seed`] for reproducible runs).
    ///
    /// # Errors
    /// Allocation errors; [`Error::InvalidShape`](crate::Error::InvalidShape) for a rank-0 shape with
    /// a fan-based initialiser.
    #[track_caller]
    pub fn tensor<'s>(self, scope: &Scope<'s>, shape: &[usize]) -> Result<Tensor<'s>> {
        let (fan_out, fan_in) = match shape {
            [] if !matches!(self, Init::Constant(_) | Init::Normal(_)) => {
                return Err(crate::Error::InvalidShape {
                    op: "Init::tensor",
                    shape: Vec::new(),
                    reason: "a fan-based initialiser needs at least one dimension".into(),
                });
            }
            [] => (1, 1),
            [n] => (*n, *n),
            [out, rest @ ..] => (*out, rest.iter().product()),
        };
        let (fan_in, fan_out) = (fan_in.max(1) as f64, fan_out.max(1) as f64);
        // Draw where the caller asked (creation sites in dumps point at the model code), then scale in
        // place: uniform u in [0, 1) becomes (2u - 1) * bound.
        let (mut t, scale, shift) = match self {
            Init::KaimingUniform | Init::XavierUniform => {
                let bound = if self == Init::KaimingUniform {
                    (6.0 / fan_in).sqrt()
                } else {
                    (6.0 / (fan_in + fan_out)).sqrt()
                };
                (scope.rand(shape)?, 2.0 * bound, -bound)
            }
            Init::KaimingNormal => (scope.randn(shape)?, (2.0 / fan_in).sqrt(), 0.0),
            Init::XavierNormal => (scope.randn(shape)?, (2.0 / (fan_in + fan_out)).sqrt(), 0.0),
            Init::Normal(std) => (scope.randn(shape)?, std, 0.0),
            Init::Constant(value) => (scope.zeros(shape)?, 0.0, value),
        };
        t.mul_scalar_(scale)?;
        t.add_scalar_(shift)?;
        Ok(t)
    }
}
