//! One forward pass against KV caches: the new tokens' keys and values go into each cache's blocks,
//! and their queries attend to everything cached.

use super::cache::KvCache;
use super::pool::KvPool;
#[cfg(doc)]
use super::pool::KvShape;
use crate::autograd::{Tape, Var};
use crate::error::{Error, Result};
use crate::ops::paged::{PagedAttention, PagedWrite, paged_attention, write_pages};
use crate::scope::Child;
use crate::tensor::Tensor;

/// A causal language model that decodes against [`KvCache`]s: what `ndscope::serve` needs.
///
/// A model says only what is its own: the shape of its caches, its position table and vocabulary,
/// its forward pass over packed rows (the new tokens of every sequence one after the other, each
/// with its position, every layer's attention going through the [`KvStep`]) and its head. The
/// library drives it: [`decode`](Self::decode) checks the requests, packs them, grows the caches,
/// runs the forward pass, and scores only each sequence's last token (vLLM's model interface, where
/// a model writes `forward(ids, positions, caches)` and the engine does the rest).
pub trait CausalLm<'m> {
    /// What each token's cache holds for this model.
    fn kv_shape(&self) -> super::KvShape;

    /// The longest sequence the model computes (its position table).
    fn max_positions(&self) -> usize;

    /// The number of token ids the model reads and scores.
    fn vocab_size(&self) -> usize;

    /// The hidden states `[rows, width]` (before the final norm) of the packed new tokens `ids`
    /// (`[rows]`, `i64`) at `positions` (`[rows]`, `i64`), layer `l`'s attention reading and filling
    /// the caches through [`KvStep::attend`], [`KvStep::attend_grouped`] or
    /// [`KvStep::attend_in_window`] with `layer = l`, every layer once. Rows are sequence after sequence, as [`KvStep::new_tokens`] counts them. The ids
    /// are checked against the vocabulary and the positions against the position table before the
    /// call.
    ///
    /// # Errors
    /// As for the model's ops and [`KvStep`]'s.
    fn forward_packed<'t, 's>(
        &self,
        tape: &'t Tape<'s>,
        ids: &Tensor<'s>,
        positions: &Tensor<'s>,
        kv: &mut KvStep<'_, '_>,
    ) -> Result<Var<'t, 's>>
    where
        'm: 's;

    /// The logits `[rows, vocab]` of hidden states `[rows, width]` from
    /// [`forward_packed`](Self::forward_packed): the final norm and the output head.
    ///
    /// # Errors
    /// As for the model's ops.
    fn logits<'t, 's>(&self, hidden: &Var<'t, 's>) -> Result<Var<'t, 's>>
    where
        'm: 's;

    /// Runs `tokens[s]`, the new tokens of sequence `s`, through the model against `caches[s]`
    /// (which holds the sequence's earlier tokens and gains these), all sequences in one forward
    /// pass, and returns the logits `[sequences, vocab]` of each sequence's last new token, in
    /// `step`'s scope. `step` is a scope opened inside the requests' scope `'r`: the caches must
    /// belong to that very scope, so one request's cache cannot be used in another's forward.
    ///
    /// Models do not write this: it is the one driver every model shares (checks, packing, the
    /// caches' growth, the last rows' gather).
    ///
    /// # Errors
    /// [`Error::InvalidShape`] for mismatched lists, an empty token list, or a sequence past
    /// [`max_positions`](Self::max_positions); [`Error::IndexOutOfRange`] for an id outside the
    /// vocabulary; [`Error::KvCapacity`] when a cache cannot grow; [`Error::InvalidArgument`] when
    /// the model's forward pass skipped a layer's cache or returned other rows; as for the model's
    /// ops. On an error the caches count none of the new tokens.
    #[track_caller]
    fn decode<'s, 'r>(
        &self,
        step: &'s Child<'s, 'r>,
        pool: &KvPool<'_>,
        caches: &mut [&mut KvCache<'r>],
        tokens: &[&[i64]],
    ) -> Result<Tensor<'s>>
    where
        'm: 's,
    {
        const OP: &str = "CausalLm::decode";
        let (ids, counts, last) =
            decode_inputs(OP, caches, tokens, self.max_positions(), self.vocab_size())?;
        let rows: usize = counts.iter().sum();
        let mut kv = KvStep::new(pool, caches.iter_mut().map(|c| &mut **c).collect(), &counts)?;
        let positions: Vec<i64> = kv
            .starts()
            .iter()
            .zip(&counts)
            .flat_map(|(&s, &n)| (s..s + n).map(|p| p as i64))
            .collect();
        let tape = Tape::no_grad(step);
        let ids = step.from_slice(&ids, &[rows])?;
        let positions = step.from_slice(&positions, &[rows])?;
        let hidden = self.forward_packed(&tape, &ids, &positions, &mut kv)?;
        if hidden.shape().len() != 2 || hidden.shape()[0] != rows {
            return Err(Error::InvalidArgument {
                op: OP,
                reason: format!(
                    "the model's forward_packed returned hidden states {:?} for {rows} packed \
                     tokens; it must return [{rows}, width]",
                    hidden.shape()
                ),
            });
        }
        if let Some(layer) = kv.unwritten_layer() {
            return Err(Error::InvalidArgument {
                op: OP,
                reason: format!(
                    "the model's forward_packed never attended through the cache of layer {layer} \
                     (of {}); call KvStep::attend or attend_grouped once per layer",
                    self.kv_shape().layers
                ),
            });
        }
        kv.finish();
        // Only each sequence's last new token is scored.
        let last = step.from_slice(&last, &[last.len()])?;
        let last_rows = tape.constant(&hidden.value().index_select(0, &last)?);
        Ok(self.logits(&last_rows)?.value().clone())
    }
}

/// What [`CausalLm::decode`] checks before the model runs: one non-empty token list per
/// cache, no sequence past `max_positions`, every id in the vocabulary. Returns the ids packed
/// sequence after sequence, the count of each, and the packed row of each sequence's last token.
///
/// # Errors
/// As for [`CausalLm::decode`].
fn decode_inputs(
    op: &'static str,
    caches: &[&mut KvCache<'_>],
    tokens: &[&[i64]],
    max_positions: usize,
    vocab: usize,
) -> Result<(Vec<i64>, Vec<usize>, Vec<i64>)> {
    if tokens.len() != caches.len() || tokens.iter().any(|t| t.is_empty()) {
        return Err(Error::InvalidShape {
            op,
            shape: tokens.iter().map(|t| t.len()).collect(),
            reason: format!(
                "needs one non-empty list of new tokens per cache ({} caches)",
                caches.len()
            ),
        });
    }
    for (cache, t) in caches.iter().zip(tokens) {
        if cache.len() + t.len() > max_positions {
            return Err(Error::InvalidShape {
                op,
                shape: vec![cache.len(), t.len()],
                reason: format!(
                    "{} cached and {} new tokens pass the model's {max_positions} positions; end \
                     the sequence or start again from its last {max_positions} tokens",
                    cache.len(),
                    t.len(),
                ),
            });
        }
    }
    let ids: Vec<i64> = tokens.iter().flat_map(|t| t.iter().copied()).collect();
    if let Some(&bad) = ids.iter().find(|&&i| i < 0 || i as usize >= vocab) {
        return Err(Error::IndexOutOfRange {
            op,
            index: bad,
            size: vocab,
        });
    }
    let counts: Vec<usize> = tokens.iter().map(|t| t.len()).collect();
    let last = counts
        .iter()
        .scan(0usize, |end, &n| {
            *end += n;
            Some(*end as i64 - 1)
        })
        .collect();
    Ok((ids, counts, last))
}

/// The caches of one forward pass, grown for its new tokens. A model's `decode` makes one, calls
/// [`attend`](Self::attend) once per layer, then [`finish`](Self::finish); until then the caches
/// count none of the new tokens, so an error leaves them as they were (save for blocks taken).
#[derive(Debug)]
pub struct KvStep<'a, 'r> {
    pool: &'a KvPool<'a>,
    caches: Vec<&'a mut KvCache<'r>>,
    new: Vec<usize>,
    /// Which layers' caches this step has written.
    written: Vec<bool>,
}

impl<'a, 'r> KvStep<'a, 'r> {
    /// A step adding `new[s]` tokens to `caches[s]`: takes the blocks they need and makes every
    /// block they land in private to its cache.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] when the lists differ in length; [`Error::InvalidArgument`] when a
    /// cache is another pool's;
    /// [`Error::KvCapacity`] when a cache cannot take the blocks it needs.
    pub fn new(
        pool: &'a KvPool<'a>,
        caches: Vec<&'a mut KvCache<'r>>,
        new: &[usize],
    ) -> Result<KvStep<'a, 'r>> {
        if caches.len() != new.len() || caches.is_empty() {
            return Err(Error::InvalidShape {
                op: "KvStep::new",
                shape: vec![caches.len(), new.len()],
                reason: "needs at least one cache and one count of new tokens per cache".into(),
            });
        }
        let mut caches = caches;
        for (cache, &n) in caches.iter_mut().zip(new) {
            cache.check_pool(pool)?;
            cache.make_room(pool, n)?;
        }
        Ok(KvStep {
            pool,
            caches,
            new: new.to_vec(),
            written: vec![false; pool.shape().layers],
        })
    }

    /// The position of each sequence's first new token (the tokens it had cached).
    pub fn starts(&self) -> Vec<usize> {
        self.caches.iter().map(|c| c.tokens).collect()
    }

    /// The new tokens per sequence.
    pub fn new_tokens(&self) -> &[usize] {
        &self.new
    }

    /// `layer`'s attention: stores the new tokens' keys and values from `qkv` (`[rows, 3, heads,
    /// head width]`: queries, keys, values of every new token, sequence after sequence) in the caches
    /// and returns each new query's attention over its sequence's cached tokens up to its own
    /// position (`[rows, heads, head width]`, contiguous, in `qkv`'s dtype), scores scaled by
    /// `scale`.
    ///
    /// The pool may keep `f16` or `bf16` under a model of another float dtype ([`KvShape::dtype`]):
    /// the keys and values are then rounded to it as they are stored, the queries as they are
    /// read, and the attention (computed in `f32`) is rounded to it before it is widened back.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] for a `qkv` of another shape; [`Error::UnsupportedDType`] for an
    /// integer `qkv`; [`Error::DTypeMismatch`] for a `qkv` of another dtype than a pool that is not
    /// 16-bit; a device mismatch with the pool.
    #[track_caller]
    pub fn attend<'s>(&mut self, layer: usize, qkv: &Tensor<'s>, scale: f64) -> Result<Tensor<'s>> {
        let shape = self.pool.shape();
        let rows: usize = self.new.iter().sum();
        if qkv.shape() != [rows, 3, shape.heads, shape.head_width] {
            return Err(Error::InvalidShape {
                op: "KvStep::attend",
                shape: qkv.shape().to_vec(),
                reason: format!(
                    "needs queries, keys and values [{rows}, 3, {}, {}]",
                    shape.heads, shape.head_width
                ),
            });
        }
        let q = qkv.narrow(1, 0, 1)?.squeeze(1)?;
        self.attend_grouped(layer, &q, &qkv.narrow(1, 1, 2)?, scale)
    }

    /// As [`attend`](Self::attend), with the queries apart from the keys and values: `q` is
    /// `[rows, query heads, head width]` and `kv` `[rows, 2, heads, head width]` (the pool's heads),
    /// the query heads a multiple of the pool's: grouped-query attention, where query head `h`
    /// attends with key and value head `h / (query heads / heads)` and the cache holds only the
    /// key and value heads (Llama 3, Qwen2, Mistral).
    ///
    /// # Errors
    /// [`Error::InvalidShape`] for other shapes; [`Error::DTypeMismatch`] when `q` and `kv` differ
    /// in dtype, or differ from a pool that is not 16-bit; [`Error::UnsupportedDType`] for integer
    /// ones; a device mismatch with the pool.
    #[track_caller]
    pub fn attend_grouped<'s>(
        &mut self,
        layer: usize,
        q: &Tensor<'s>,
        kv: &Tensor<'s>,
        scale: f64,
    ) -> Result<Tensor<'s>> {
        self.attend_in_window(layer, q, kv, scale, None)
    }

    /// As [`attend_grouped`](Self::attend_grouped), each query seeing at most the last `window`
    /// tokens of its sequence, itself included (a sliding window: Mistral's `sliding_window`), or
    /// every token with `None`. The caches keep every token; only attention looks back no further.
    ///
    /// # Errors
    /// As for [`attend_grouped`](Self::attend_grouped); [`Error::InvalidArgument`] for a window of 0.
    #[track_caller]
    pub fn attend_in_window<'s>(
        &mut self,
        layer: usize,
        q: &Tensor<'s>,
        kv: &Tensor<'s>,
        scale: f64,
        window: Option<usize>,
    ) -> Result<Tensor<'s>> {
        if window == Some(0) {
            return Err(Error::InvalidArgument {
                op: "KvStep::attend_in_window",
                reason: "a sliding window of 0 tokens leaves every query nothing to see; give at \
                         least 1, or None for no window"
                    .into(),
            });
        }
        let shape = self.pool.shape();
        let rows: usize = self.new.iter().sum();
        let fits = kv.shape() == [rows, 2, shape.heads, shape.head_width]
            && q.rank() == 3
            && q.shape()[0] == rows
            && q.shape()[1] > 0
            && q.shape()[1].is_multiple_of(shape.heads)
            && q.shape()[2] == shape.head_width;
        if !fits {
            return Err(Error::InvalidShape {
                op: "KvStep::attend_grouped",
                shape: q.shape().to_vec(),
                reason: format!(
                    "needs queries [{rows}, query heads, {w}] (a multiple of {h} heads) and keys and \
                     values [{rows}, 2, {h}, {w}]; got {:?} and {:?}",
                    q.shape(),
                    kv.shape(),
                    h = shape.heads,
                    w = shape.head_width
                ),
            });
        }
        // A cache of another float dtype than the model's (a 16-bit cache under an f32 model, as
        // llama.cpp keeps by default): the new keys and values are rounded to it as they are
        // stored, the queries as they are read, and the output is widened back.
        let (model_dtype, cached) = (q.dtype(), shape.dtype);
        if kv.dtype() != model_dtype {
            return Err(Error::DTypeMismatch {
                op: "KvStep::attend_grouped",
                lhs: model_dtype,
                rhs: kv.dtype(),
            });
        }
        if cached != model_dtype && (!cached.is_half() || !model_dtype.is_float()) {
            // Only a 16-bit cache takes another dtype than the model's: a narrower cache on
            // purpose, never a model computing in one dtype against a pool made for another.
            return Err(Error::DTypeMismatch {
                op: "KvStep::attend_grouped",
                lhs: cached,
                rhs: model_dtype,
            });
        }
        if !model_dtype.is_float() {
            return Err(Error::UnsupportedDType {
                op: "KvStep::attend_grouped",
                dtype: model_dtype,
                expected: "float queries, keys and values (f32, f64, bf16 or f16)",
            });
        }
        let kv = &kv.to_dtype(cached)?;
        let q = &q.to_dtype(cached)?;
        let geometry = self.pool.geometry();
        let mut writes: Vec<PagedWrite<'_>> = self
            .caches
            .iter_mut()
            .zip(&self.new)
            .map(|(c, &count)| PagedWrite {
                from: c.tokens,
                count,
                table: &mut c.table,
            })
            .collect();
        write_pages(self.pool.slab(), geometry, layer, kv, &mut writes)?;
        drop(writes);
        if let Some(w) = self.written.get_mut(layer) {
            *w = true;
        }
        let tables: Vec<_> = self.caches.iter().map(|c| &c.table).collect();
        let lengths: Vec<usize> = self
            .caches
            .iter()
            .zip(&self.new)
            .map(|(c, n)| c.tokens + n)
            .collect();
        paged_attention(
            q,
            self.pool.slab(),
            geometry,
            PagedAttention {
                scale,
                layer,
                window,
            },
            &tables,
            &lengths,
            &self.new,
        )?
        .to_dtype(model_dtype)
    }

    /// The first layer whose cache this step has not written, if any.
    pub(crate) fn unwritten_layer(&self) -> Option<usize> {
        self.written.iter().position(|w| !w)
    }

    /// Counts the new tokens as cached in every cache.
    pub fn finish(self) {
        for (cache, &n) in self.caches.into_iter().zip(&self.new) {
            cache.commit(n);
        }
    }
}
