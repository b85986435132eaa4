//! A language model's token table, dense (an [`Embedding`], trainable) or block-quantized (a GGUF
//! file's `token_embd`, frozen): the lookup at the input and, tied, the output head.
//!
//! A model stores the pair `(Embedding, Option<QuantTensor>)`: with blocks, the embedding is an
//! empty `[0]` tensor of the model's dtype (so `Gpt2::wte` stays a public `Embedding`, which users
//! build by literal) and the blocks are no parameter.

use crate::autograd::{Tape, Var};
use crate::dtype::DType;
use crate::error::Result;
use crate::nn::Embedding;
use crate::scope::Scope;
use crate::tensor::{QuantTensor, Tensor};
use crate::weights::Weights;

/// A model's token table as its passes read it.
#[derive(Clone, Copy)]
pub(super) struct TokenTable<'a, 'm> {
    pub(super) dense: &'a Embedding<'m>,
    pub(super) blocks: Option<&'a QuantTensor<'m>>,
}

impl<'m> TokenTable<'_, 'm> {
    /// The rows of `ids` (`[..]` -> `[.., hidden]`): a parameter's rows, or decoded blocks (a
    /// constant).
    #[track_caller]
    pub(super) fn forward<'t, 's>(
        &self,
        tape: &'t Tape<'s>,
        ids: &Tensor<'s>,
    ) -> Result<Var<'t, 's>>
    where
        'm: 's,
    {
        match self.blocks {
            None => self.dense.forward(tape, ids),
            Some(table) => {
                let mut shape = ids.shape().to_vec();
                shape.push(table.shape()[1]);
                tape.quantized_rows(table, &ids.flatten()?, self.dense.weight.dtype())?
                    .reshape(&shape)
            }
        }
    }

    /// The tied output head: `x Eᵀ` for rows `x` `[n, hidden]`, on the blocks where there are.
    pub(super) fn tied_head<'t, 's>(&self, x: &Var<'t, 's>) -> Result<Var<'t, 's>>
    where
        'm: 's,
    {
        match self.blocks {
            None => x.matmul(&x.tape().param(&self.dense.weight).t()?),
            Some(table) => x.matmul_quantized_t(table),
        }
    }
}

/// The table `weight` (`[num, dim]`) of `weights`: kept in its blocks beside an empty embedding of
/// `dtype` if `keep_blocks` and it is stored block-quantized, else loaded as `dtype`.
#[track_caller]
pub(super) fn load<'m>(
    scope: &Scope<'m>,
    weights: &Weights,
    (num, dim): (usize, usize),
    dtype: DType,
    keep_blocks: bool,
) -> Result<(Embedding<'m>, Option<QuantTensor<'m>>)> {
    if keep_blocks && weights.quantized("weight")?.is_some() {
        let table = weights.quantized_tensor(scope, "weight", &[num, dim])?;
        let empty = Embedding {
            weight: table.empty_like(dtype)?,
        };
        return Ok((empty, Some(table)));
    }
    Ok((Embedding::load(scope, weights, num, dim, dtype)?, None))
}
