//! The small GPT that `tests/model_soak.rs` and `tests/planned_workspace.rs` train: token and
//! position embeddings, two pre-norm blocks of width 16 with causal attention and dropout 0.1, on
//! batches of sequences `a, a+1, a+2, ...` (mod the vocabulary), whose next token is predictable.

use ndscope::nn::{
    AttentionOptions, Embedding, Init, LayerNorm, Linear, Mode, Module, PositionalEmbedding,
    TransformerBlock,
};
use ndscope::{Result, Scope, Tape, Var};

pub const VOCAB: usize = 12;
pub const LEN: usize = 8;
pub const BATCH: usize = 8;

ndscope::model! {
    pub struct Gpt<'m> {
        tokens: Embedding<'m>,
        positions: PositionalEmbedding<'m>,
        blocks: Vec<TransformerBlock<'m>>,
        ln: LayerNorm<'m>,
        head: Linear<'m>,
    }
}

impl<'m> Gpt<'m> {
    /// The model, initialised in the model scope `m`.
    pub fn new(m: &Scope<'m>) -> Result<Gpt<'m>> {
        let init = Init::Normal(0.02);
        let opts = AttentionOptions {
            causal: true,
            dropout: 0.1,
        };
        Ok(Gpt {
            tokens: Embedding::new(m, VOCAB, 16, init)?,
            positions: PositionalEmbedding::new(m, LEN, 16, init)?,
            blocks: vec![
                TransformerBlock::new(m, 16, 2, opts, init)?,
                TransformerBlock::new(m, 16, 2, opts, init)?,
            ],
            ln: LayerNorm::new(m, 16)?,
            head: Linear::new(m, 16, VOCAB, init)?,
        })
    }

    /// The mean next-token cross-entropy on batch `step`, recorded on `tape` in the batch scope `b`.
    pub fn loss<'t, 'b>(
        &self,
        tape: &'t Tape<'b>,
        b: &'b Scope<'b>,
        step: u64,
    ) -> Result<Var<'t, 'b>>
    where
        'm: 'b,
    {
        let ids = b.from_slice(&batch_ids(step), &[BATCH, LEN + 1])?;
        let mut x = self
            .positions
            .forward(&self.tokens.forward(tape, &ids.narrow(1, 0, LEN)?)?)?;
        for block in &self.blocks {
            x = block.forward(&x, Mode::Train)?;
        }
        let logits = self
            .head
            .forward(&self.ln.forward(&x, Mode::Train)?, Mode::Train)?;
        let next = ids
            .narrow(1, 1, LEN)?
            .contiguous()?
            .reshape(&[BATCH * LEN])?;
        logits.reshape(&[BATCH * LEN, VOCAB])?.cross_entropy(&next)
    }
}

/// Batch `step`: `BATCH` sequences of `LEN + 1` tokens.
pub fn batch_ids(step: u64) -> Vec<i64> {
    (0..BATCH * (LEN + 1))
        .map(|i| {
            let (row, col) = (i / (LEN + 1), i % (LEN + 1));
            ((row as u64 * 5 + step + col as u64) % VOCAB as u64) as i64
        })
        .collect()
}
