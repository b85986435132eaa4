//! A language model's token table, dense (an [`Embedding`], trainable) or block-quantized (a GGUF
//! file's `token_embd`, frozen): the lookup at the input and, tied, the output head.

use crate::autograd::{Tape, Var};
use crate::dtype::DType;
use crate::error::Result;
use crate::nn::{Embedding, Parameters};
use crate::scope::{Movable, MoveOut, Scope};
use crate::tensor::{QuantTensor, Tensor};

#[derive(Debug, Clone)]
pub(super) enum TokenTable<'m> {
    Dense(Embedding<'m>),
    /// `[vocab, hidden]` blocks, looked up decoded to `dtype` (the model's).
    Quantized {
        table: QuantTensor<'m>,
        dtype: DType,
    },
}

impl<'m> TokenTable<'m> {
    /// The dtype the model computes in.
    pub(super) fn dtype(&self) -> DType {
        match self {
            TokenTable::Dense(e) => e.weight.dtype(),
            TokenTable::Quantized { dtype, .. } => *dtype,
        }
    }

    /// The rows of `ids` (`[..]` -> `[.., hidden]`).
    #[track_caller]
    pub(super) fn forward<'t, 's>(
        &self,
        tape: &'t Tape<'s>,
        ids: &Tensor<'s>,
    ) -> Result<Var<'t, 's>>
    where
        'm: 's,
    {
        match self {
            TokenTable::Dense(e) => e.forward(tape, ids),
            TokenTable::Quantized { table, dtype } => {
                let mut shape = ids.shape().to_vec();
                shape.push(table.shape()[1]);
                tape.quantized_rows(table, &ids.flatten()?, *dtype)?
                    .reshape(&shape)
            }
        }
    }

    /// The tied output head: `x Eᵀ` for rows `x` `[n, hidden]`.
    pub(super) fn tied_head<'t, 's>(&self, x: &Var<'t, 's>) -> Result<Var<'t, 's>>
    where
        'm: 's,
    {
        match self {
            TokenTable::Dense(e) => x.matmul(&x.tape().param(&e.weight).t()?),
            TokenTable::Quantized { table, .. } => x.matmul_quantized_t(table),
        }
    }

    /// The dense table's parameter (a quantized table is frozen: none).
    pub(super) fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor<'m>)) {
        if let TokenTable::Dense(e) = self {
            e.visit(prefix, f);
        }
    }

    pub(super) fn visit_mut(
        &mut self,
        f: &mut dyn FnMut(&mut Tensor<'m>) -> Result<()>,
    ) -> Result<()> {
        match self {
            TokenTable::Dense(e) => e.visit_mut(f),
            TokenTable::Quantized { .. } => Ok(()),
        }
    }
}

impl<'m> Movable<'m> for TokenTable<'m> {
    type Moved<'b> = TokenTable<'b>;

    fn move_into<'b>(self, target: &Scope<'b>) -> Result<TokenTable<'b>> {
        Ok(match self {
            TokenTable::Dense(e) => TokenTable::Dense(e.move_into(target)?),
            TokenTable::Quantized { table, dtype } => TokenTable::Quantized {
                table: table.move_into(target)?,
                dtype,
            },
        })
    }
}

impl<'m> MoveOut<'m> for TokenTable<'m> {
    fn move_out(self) -> Result<TokenTable<'static>> {
        Ok(match self {
            TokenTable::Dense(e) => TokenTable::Dense(e.move_out()?),
            TokenTable::Quantized { table, dtype } => TokenTable::Quantized {
                table: table.move_out()?,
                dtype,
            },
        })
    }
}
