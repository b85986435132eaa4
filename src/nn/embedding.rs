//! Lookup tables: token embeddings and learned positional embeddings.

use super::Init;
use super::Parameters;
use super::params::layer_parts;
use crate::autograd::{Tape, Var};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::scope::{Movable, MoveOut, Scope};
use crate::tensor::{QuantTensor, Tensor};
use crate::weights::Weights;

/// A table of `num` vectors of width `dim`; looking up `i64` ids gives their rows (PyTorch's
/// `nn.Embedding`). The gradient of a lookup is added into the rows it read, so ids that repeat
/// in a batch accumulate.
///
/// The table may instead be block-quantized ([`Embedding::from_quantized`]: a GGUF file's
/// `token_embd`): lookups decode only the rows they read, [`project`](Embedding::project) computes
/// on the blocks, and the table is frozen (not a parameter).
#[derive(Debug, Clone)]
pub struct Embedding<'m> {
    /// `[num, dim]`. Empty (`[0]`, of the dtype lookups give) in a table that is quantized: see
    /// [`quantized_weight`](Self::quantized_weight).
    pub weight: Tensor<'m>,
    /// `[num, dim]` blocks, when the table is block-quantized.
    quantized: Option<QuantTensor<'m>>,
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
            quantized: None,
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
            quantized: None,
        })
    }

    /// [`load`](Self::load), except that a table stored block-quantized stays in its blocks
    /// ([`from_quantized`](Self::from_quantized), its rows looked up as `dtype`) when
    /// `keep_blocks`.
    #[track_caller]
    pub(crate) fn load_keeping_blocks(
        scope: &Scope<'m>,
        weights: &Weights,
        num: usize,
        dim: usize,
        dtype: DType,
        keep_blocks: bool,
    ) -> Result<Embedding<'m>> {
        if keep_blocks && weights.quantized("weight")?.is_some() {
            let table = weights.quantized_tensor(scope, "weight", &[num, dim])?;
            return Embedding::from_quantized(table, dtype);
        }
        Embedding::load(scope, weights, num, dim, dtype)
    }

    /// A frozen table of the block-quantized `table` (`[num, dim]`), its rows looked up decoded to
    /// `dtype` (a float dtype).
    ///
    /// ```
    /// use ndscope::nn::{Embedding, Parameters};
    /// use ndscope::quant::QuantType;
    /// use ndscope::{DType, Device, QuantTensor, Tape, root};
    ///
    /// root(Device::Cpu, |s| {
    ///     let rows = s.from_slice(&(0..4 * 32).map(|i| (i % 5) as f32).collect::<Vec<_>>(), &[4, 32])?;
    ///     let table = Embedding::from_quantized(QuantTensor::quantize(&rows, QuantType::Q8_0)?, DType::F32)?;
    ///     assert_eq!((table.num(), table.dim(), table.parameter_count()), (4, 32, 0));
    ///     let tape = Tape::no_grad(s);
    ///     let looked_up = table.forward(&tape, &s.from_slice(&[2i64, 0], &[2])?)?;
    ///     assert_eq!(looked_up.value().to_vec::<f32>()?[..5], [3.0, 4.0, 0.0, 1.0, 2.0]);
    ///     Ok::<_, ndscope::Error>(())
    /// })?;
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::UnsupportedDType`] for an integer `dtype`.
    #[track_caller]
    pub fn from_quantized(table: QuantTensor<'m>, dtype: DType) -> Result<Embedding<'m>> {
        if !dtype.is_float() {
            return Err(Error::UnsupportedDType {
                op: "Embedding::from_quantized",
                dtype,
                expected: "a float dtype (f32, f64, bf16, f16) for the rows a lookup gives",
            });
        }
        Ok(Embedding {
            weight: table.empty_like(dtype)?,
            quantized: Some(table),
        })
    }

    /// The block-quantized table (`[num, dim]`) of one made by
    /// [`from_quantized`](Self::from_quantized); `None` when the table is the dense
    /// [`weight`](Self::weight).
    pub fn quantized_weight(&self) -> Option<&QuantTensor<'m>> {
        self.quantized.as_ref()
    }

    /// The dtype of the rows a lookup gives.
    pub fn dtype(&self) -> DType {
        self.weight.dtype()
    }

    /// Rows in the table.
    pub fn num(&self) -> usize {
        match &self.quantized {
            Some(q) => q.shape()[0],
            None => self.weight.shape()[0],
        }
    }

    /// Width of each row.
    pub fn dim(&self) -> usize {
        match &self.quantized {
            Some(q) => q.shape()[1],
            None => self.weight.shape()[1],
        }
    }

    /// The rows of `ids` (`i64`, any shape): a result of shape `ids.shape() + [dim]`, recorded on
    /// `tape` with the table as a parameter (a quantized table: as a constant).
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
        let rows = match &self.quantized {
            Some(table) => tape.quantized_rows(table, &ids.flatten()?, self.dtype())?,
            None => tape.param(&self.weight).index_select(0, &ids.flatten()?)?,
        };
        rows.reshape(&shape)
    }

    /// `x Eᵀ` for rows `x` (`[n, dim]`): every row's score against every entry of the table, the
    /// table serving as a tied output head (GPT-2's and small Llamas' logits). A quantized table
    /// computes on its blocks ([`Var::matmul_quantized_t`]).
    ///
    /// # Errors
    /// [`Error::InvalidShape`](crate::Error::InvalidShape) for rows of another width.
    #[track_caller]
    pub fn project<'t, 's>(&self, x: &Var<'t, 's>) -> Result<Var<'t, 's>>
    where
        'm: 's,
    {
        match &self.quantized {
            Some(table) => x.matmul_quantized_t(table),
            None => x.matmul(&x.tape().param(&self.weight).t()?),
        }
    }
}

// By hand rather than `layer_parts!`: a quantized table is moved with the layer but is not a
// parameter.
impl<'m> Parameters<'m> for Embedding<'m> {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor<'m>)) {
        if self.quantized.is_none() {
            f(&format!("{prefix}weight"), &self.weight);
        }
    }

    fn visit_mut(&mut self, f: &mut dyn FnMut(&mut Tensor<'m>) -> Result<()>) -> Result<()> {
        if self.quantized.is_none() {
            f(&mut self.weight)?;
        }
        Ok(())
    }
}

impl<'m> Movable<'m> for Embedding<'m> {
    type Moved<'b> = Embedding<'b>;

    fn move_into<'b>(self, target: &Scope<'b>) -> Result<Embedding<'b>> {
        Ok(Embedding {
            weight: self.weight.move_into(target)?,
            quantized: self.quantized.move_into(target)?,
        })
    }
}

impl<'m> MoveOut<'m> for Embedding<'m> {
    fn move_out(self) -> Result<Embedding<'static>> {
        Ok(Embedding {
            weight: self.weight.move_out()?,
            quantized: self.quantized.move_out()?,
        })
    }
}

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
