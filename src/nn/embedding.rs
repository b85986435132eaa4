//! Lookup tables: token embeddings and learned positional embeddings.

use super::Init;
use super::params::layer_parts;
use crate::autograd::{Tape, Var};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::scope::Scope;
use crate::tensor::Tensor;
use crate::weights::Weights;

/// A table of `num` vectors of width `dim`; looking up `i64` ids gives their rows (PyTorch's
/// `nn.Embedding`). The gradient of a lookup is added into the rows it read, so ids that repeat
/// in a batch accumulate.
#[derive(Debug, Clone)]
pub struct Embedding<'m> {
    /// `[num, dim]`.
    pub weight: Tensor<'m>,
}

impl<'m> Embedding<'m> {
    /// A table of `num` rows of width `dim` in `scope`, drawn with `init`
    /// (PyTorch draws `Init::Normal(1.0)`).
    ///
    /// # Errors
    /// [`Error::InvalidShape`] for a zero size; allocation errors.
    #[track_caller]
    pub fn new(scope: &Scope<'m>, num: usize, dim: usize, init: Init) -> Result<Embedding<'m>> {
        if num == 0 || dim == 0 {
            return Err(Error::InvalidShape {
                op: "Embedding::new",
                shape: vec![num, dim],
                reason: "an embedding needs at least one row and one column".into(),
            });
        }
        Ok(Embedding {
            weight: init.tensor(scope, &[num, dim])?.named("weight"),
        })
    }

    /// A table of `num` rows of width `dim` loaded from `weights` (`weight`) as `dtype`.
    ///
    /// # Errors
    /// [`Error::MissingTensor`], [`Error::TensorMismatch`]; allocation errors.
    #[track_caller]
    pub fn load(
        scope: &Scope<'m>,
        weights: &Weights,
        num: usize,
        dim: usize,
        dtype: DType,
    ) -> Result<Embedding<'m>> {
        Ok(Embedding {
            weight: weights.parameter(scope, "weight", &[num, dim], dtype)?,
        })
    }

    /// Rows in the table.
    pub fn num(&self) -> usize {
        self.weight.shape()[0]
    }

    /// Width of each row (0 for an empty table, as a model holds beside a quantized one).
    pub fn dim(&self) -> usize {
        self.weight.shape().get(1).copied().unwrap_or(0)
    }

    /// The rows of `ids` (`i64`, any shape): a result of shape `ids.shape() + [dim]`, recorded on
    /// `tape` with the table as a parameter.
    ///
    /// # Errors
    /// [`Error::UnsupportedDType`](crate::Error::UnsupportedDType) for non-integer ids;
    /// [`Error::IndexOutOfRange`](crate::Error::IndexOutOfRange) for an id outside `0..num`.
    #[track_caller]
    pub fn forward<'t, 's>(&self, tape: &'t Tape<'s>, ids: &Tensor<'s>) -> Result<Var<'t, 's>>
    where
        'm: 's,
    {
        let mut shape = ids.shape().to_vec();
        shape.push(self.dim());
        tape.param(&self.weight)
            .index_select(0, &ids.flatten()?)?
            .reshape(&shape)
    }
}

layer_parts!(Embedding {
    tensors: [weight],
    layers: [],
    plain: []
});

/// Learned positional embeddings: position `p` of a sequence gets row `p` of a `[max_len, dim]`
/// table added (GPT-2's `wpe`).
#[derive(Debug, Clone)]
pub struct PositionalEmbedding<'m> {
    /// `[max_len, dim]`.
    pub weight: Tensor<'m>,
}

impl<'m> PositionalEmbedding<'m> {
    /// A table for sequences of up to `max_len` positions of width `dim`.
    ///
    /// # Errors
    /// As for [`Embedding::new`].
    #[track_caller]
    pub fn new(
        scope: &Scope<'m>,
        max_len: usize,
        dim: usize,
        init: Init,
    ) -> Result<PositionalEmbedding<'m>> {
        Ok(PositionalEmbedding {
            weight: Embedding::new(scope, max_len, dim, init)?.weight,
        })
    }

    /// A table for up to `max_len` positions of width `dim` loaded from `weights` (`weight`) as
    /// `dtype`.
    ///
    /// # Errors
    /// As for [`Embedding::load`].
    #[track_caller]
    pub fn load(
        scope: &Scope<'m>,
        weights: &Weights,
        max_len: usize,
        dim: usize,
        dtype: DType,
    ) -> Result<PositionalEmbedding<'m>> {
        Ok(PositionalEmbedding {
            weight: Embedding::load(scope, weights, max_len, dim, dtype)?.weight,
        })
    }

    /// The longest sequence the table covers.
    pub fn max_len(&self) -> usize {
        self.weight.shape()[0]
    }

    /// `x` (`[..., len, dim]`) plus the first `len` rows of the table.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] for a sequence longer than `max_len` or a width other than `dim`.
    #[track_caller]
    pub fn forward<'t, 's>(&self, x: &Var<'t, 's>) -> Result<Var<'t, 's>>
    where
        'm: 's,
    {
        let (len, dim) = match *x.shape() {
            [.., len, dim] => (len, dim),
            _ => (0, 0),
        };
        if x.shape().len() < 2 || len > self.max_len() || dim != self.weight.shape()[1] {
            return Err(Error::InvalidShape {
                op: "PositionalEmbedding::forward",
                shape: x.shape().to_vec(),
                reason: format!(
                    "needs [..., len, {}] with len <= {} (the table's rows)",
                    self.weight.shape()[1],
                    self.max_len()
                ),
            });
        }
        x.add(&x.tape().param(&self.weight).narrow(0, 0, len)?)
    }
}

layer_parts!(PositionalEmbedding {
    tensors: [weight],
    layers: [],
    plain: []
});
