//! One request: a prompt's continuation, decoded against its own KV cache.

use super::sample::{Sampler, Sampling, Summary};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::kv::{CausalLm, KvCache, KvPool, KvUsage};
use crate::rng::DEFAULT_SEED;
use crate::scope::Scope;

/// What to generate.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateOptions {
    /// The most tokens to add after the prompt.
    pub max_new_tokens: usize,
    /// How each token is chosen.
    pub sampling: Sampling,
    /// Tokens that end the generation (kept as its last token).
    pub stop: Vec<i64>,
    /// Stop tokens cannot be chosen before this many new tokens (their logits count as `-inf`, as
    /// transformers' `min_new_tokens` does with its end-of-sequence token).
    pub min_new_tokens: usize,
    /// The seed of the draws (unused by greedy decoding).
    pub seed: u64,
}

impl GenerateOptions {
    /// Up to `max_new_tokens` greedy tokens, no stop token.
    pub fn greedy(max_new_tokens: usize) -> GenerateOptions {
        GenerateOptions {
            max_new_tokens,
            sampling: Sampling::GREEDY,
            stop: Vec::new(),
            min_new_tokens: 0,
            seed: DEFAULT_SEED,
        }
    }

    /// Up to `max_new_tokens` tokens drawn with `sampling` from `seed`.
    pub fn sampled(max_new_tokens: usize, sampling: Sampling, seed: u64) -> GenerateOptions {
        GenerateOptions {
            sampling,
            seed,
            ..GenerateOptions::greedy(max_new_tokens)
        }
    }

    /// The same, ending at `stop`.
    pub fn stopping_at(mut self, stop: i64) -> GenerateOptions {
        self.stop.push(stop);
        self
    }

    /// The same, with no stop token before `min_new_tokens` new tokens (transformers'
    /// `min_new_tokens`).
    pub fn with_min_new_tokens(mut self, min_new_tokens: usize) -> GenerateOptions {
        self.min_new_tokens = min_new_tokens;
        self
    }

    /// The old name of [`with_min_new_tokens`](Self::with_min_new_tokens), which read as a bound
    /// on something else.
    #[deprecated(note = "use `with_min_new_tokens`, the same setting under transformers' name")]
    pub fn at_least(self, min_new_tokens: usize) -> GenerateOptions {
        self.with_min_new_tokens(min_new_tokens)
    }
}

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// It produced this stop token.
    Stop(i64),
    /// It produced `max_new_tokens` tokens.
    Length,
    /// The sequence reached the model's last position.
    Positions,
}

/// A finished generation: plain values, free of any scope.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    /// The new tokens (the prompt is not repeated).
    pub tokens: Vec<i64>,
    /// Each new token's log-probability under the model (before temperature and filters, after
    /// masking stop tokens before `min_new_tokens`).
    pub logprobs: Vec<f32>,
    /// Why it ended.
    pub finish: Finish,
    /// The request's cache when it ended: tokens, blocks, bytes.
    pub kv: KvUsage,
}

/// One request's decoding state: its sampler and what it produced so far.
pub(crate) struct Decoding {
    sampler: Sampler,
    options: GenerateOptions,
    /// The tokens the next forward pass runs: the prompt first, then the last token chosen.
    pub(crate) next: Vec<i64>,
    tokens: Vec<i64>,
    logprobs: Vec<f32>,
    budget: usize,
    /// The logits with stop tokens masked, while they may not be chosen.
    masked: Vec<f32>,
}

impl Decoding {
    /// Checks a request against the model; the decoding state and how many tokens its cache can reach.
    pub(crate) fn new(
        prompt: &[i64],
        options: &GenerateOptions,
        max_positions: usize,
    ) -> Result<Decoding> {
        if prompt.is_empty() || prompt.len() > max_positions {
            return Err(Error::InvalidShape {
                op: "generate",
                shape: vec![prompt.len()],
                reason: format!(
                    "needs a prompt of 1 to {max_positions} tokens (the model's positions); \
                     shorten it to its last {max_positions} tokens"
                ),
            });
        }
        Ok(Decoding {
            sampler: Sampler::new(options.sampling, options.seed)?,
            options: options.clone(),
            next: prompt.to_vec(),
            tokens: Vec::new(),
            logprobs: Vec::new(),
            masked: Vec::new(),
            // The last token chosen is never run through the model.
            budget: (prompt.len() + options.max_new_tokens)
                .min(max_positions + 1)
                .saturating_sub(1)
                .max(prompt.len()),
        })
    }

    /// Tokens the cache holds at most.
    pub(crate) fn cache_tokens(&self) -> usize {
        self.budget
    }

    /// Whether it ends before running anything (`max_new_tokens == 0`).
    pub(crate) fn is_done_at_start(&self) -> bool {
        self.options.max_new_tokens == 0
    }

    /// Chooses the next token from `logits`; `Some(finish)` when the generation ends with it.
    pub(crate) fn choose(
        &mut self,
        logits: &[f32],
        cached: usize,
        max_positions: usize,
    ) -> Option<Finish> {
        self.choose_summarized(logits, None, cached, max_positions)
    }

    /// Whether the next choice masks the stop tokens (the minimum count of new tokens is not
    /// reached yet): it then chooses from other logits than the model's row.
    fn masks_stops(&self) -> bool {
        self.tokens.len() < self.options.min_new_tokens && !self.options.stop.is_empty()
    }

    /// [`choose`](Self::choose) with the [`Summary`] of `logits` when the caller has it (unused
    /// where the choice [`masks_stops`](Self::masks_stops)).
    pub(crate) fn choose_summarized(
        &mut self,
        logits: &[f32],
        summary: Option<Summary>,
        cached: usize,
        max_positions: usize,
    ) -> Option<Finish> {
        let choice = if self.masks_stops() {
            self.masked.clear();
            self.masked.extend_from_slice(logits);
            for &t in &self.options.stop {
                if let Some(x) = usize::try_from(t).ok().and_then(|t| self.masked.get_mut(t)) {
                    *x = f32::NEG_INFINITY;
                }
            }
            self.sampler.choose(&self.masked)
        } else {
            let summary = summary.unwrap_or_else(|| Summary::of(logits));
            self.sampler.choose_summarized(logits, summary)
        };
        self.tokens.push(choice.token);
        self.logprobs.push(choice.logprob);
        self.next.clear();
        self.next.push(choice.token);
        if self.options.stop.contains(&choice.token) {
            Some(Finish::Stop(choice.token))
        } else if self.tokens.len() >= self.options.max_new_tokens {
            Some(Finish::Length)
        } else if cached >= max_positions {
            Some(Finish::Positions)
        } else {
            None
        }
    }

    /// The last token chosen and its log-probability.
    pub(crate) fn last(&self) -> (i64, f32) {
        match (self.tokens.last(), self.logprobs.last()) {
            (Some(&t), Some(&l)) => (t, l),
            _ => unreachable!("asked for the last token before any was chosen"),
        }
    }

    pub(crate) fn finish(self, finish: Finish, kv: KvUsage) -> Generation {
        Generation {
            tokens: self.tokens,
            logprobs: self.logprobs,
            finish,
            kv,
        }
    }
}

/// One step's logits as `f32` rows on the host.
pub(crate) fn host_rows(logits: &crate::tensor::Tensor<'_>) -> Result<Vec<f32>> {
    if logits.dtype() == DType::F32 {
        logits.to_vec::<f32>()
    } else {
        logits.to_dtype(DType::F32)?.to_vec::<f32>()
    }
}

/// Runs one decoding step of `cache` in a scope of its own: the step's temporaries are freed when it
/// returns, so a request's memory is its cache plus one step's.
fn step<'m, 'r, M: CausalLm<'m>>(
    model: &M,
    request: &Scope<'r>,
    pool: &KvPool<'_>,
    cache: &mut KvCache<'r>,
    tokens: &[i64],
) -> Result<Vec<f32>>
where
    'm: 'r,
{
    request.scope(|s| host_rows(&model.decode(s, pool, &mut [cache], &[tokens])?))
}

/// `prompt`'s continuation by `model`, decoded against a KV cache of its own taken from `pool`, in a
/// request scope opened under `scope`: the prompt runs through the model once, then each new token
/// alone. The request's blocks go back to the pool when it returns, whether it succeeded, failed or
/// panicked.
///
/// ```
/// use ndscope::models::Gpt2;
/// use ndscope::kv::{CausalLm, KvPool};
/// use ndscope::serve::{GenerateOptions, generate};
/// use ndscope::{DType, Device, root};
///
/// root(Device::Cpu, |model_scope| {
///     let gpt2 = Gpt2::from_pretrained(model_scope, "data/gpt2-tiny", DType::F32)?;
///     let pool = KvPool::new(model_scope, gpt2.kv_shape(), 16, 32)?;
///     let prompt = [33i64, 292, 482, 308];
///     let out = generate(&gpt2, model_scope, &pool, &prompt, &GenerateOptions::greedy(8))?;
///     assert_eq!(out.tokens.len(), 8);
///     assert_eq!(out.kv.tokens, 4 + 7); // the last token chosen is not cached
///     assert_eq!(pool.stats().blocks_free, 32); // the request's blocks are back
///     Ok::<_, ndscope::Error>(())
/// })?;
/// # Ok::<(), ndscope::Error>(())
/// ```
///
/// # Errors
/// [`Error::InvalidShape`] for an empty prompt or one longer than the model's positions;
/// [`Error::InvalidArgument`] for sampling settings out of range ([`Sampling::check`]);
/// [`Error::KvCapacity`] when the pool cannot promise the blocks of `prompt + max_new_tokens`
/// tokens; as for the model's [`decode`](CausalLm::decode).
pub fn generate<'m, 'a, M: CausalLm<'m>>(
    model: &M,
    scope: &Scope<'a>,
    pool: &KvPool<'_>,
    prompt: &[i64],
    options: &GenerateOptions,
) -> Result<Generation>
where
    'm: 'a,
{
    let max_positions = model.max_positions();
    let decoding = Decoding::new(prompt, options, max_positions)?;
    scope.scope(|request| {
        let mut cache = pool.cache(request, decoding.cache_tokens())?;
        decode_all(model, request, pool, &mut cache, decoding)
    })
}

/// Continues the sequence `cache` holds: `prompt`, the tokens that follow the cached ones, runs
/// through the model once, then each new token alone, each step in a scope of its own under `scope`
/// (whose brand the cache carries). The cache keeps every token the model ran: afterwards it holds
/// its earlier tokens, the prompt, and every new token but the last, which is not run (the next
/// call's prompt starts with it). A conversation keeps one cache across its turns this way, so
/// each turn runs only its new tokens (DJL's predictor keeps its context so); a cache can also be
/// [`fork`](KvCache::fork)ed first, to try two continuations of one context.
///
/// ```
/// use ndscope::models::Gpt2;
/// use ndscope::kv::{CausalLm, KvPool};
/// use ndscope::serve::{GenerateOptions, generate, generate_in};
/// use ndscope::{DType, Device, root};
///
/// root(Device::Cpu, |model_scope| {
///     let gpt2 = Gpt2::from_pretrained(model_scope, "data/gpt2-tiny", DType::F32)?;
///     let pool = KvPool::new(model_scope, gpt2.kv_shape(), 16, 32)?;
///     let options = GenerateOptions::greedy(4);
///     model_scope.scope(|conversation| {
///         let mut cache = pool.cache(conversation, 64)?;
///         let first = generate_in(&gpt2, conversation, &pool, &mut cache, &[33, 292], &options)?;
///         assert_eq!(cache.len(), 2 + 3);
///         // The next turn: the last token chosen, then new tokens; only these run.
///         let turn = [*first.tokens.last().unwrap(), 482, 308];
///         let second = generate_in(&gpt2, conversation, &pool, &mut cache, &turn, &options)?;
///         // The same as generating from the whole sequence at once.
///         let mut whole = vec![33, 292];
///         whole.extend(&first.tokens[..3]);
///         whole.extend(turn);
///         let again = generate(&gpt2, conversation, &pool, &whole, &options)?;
///         assert_eq!(second.tokens, again.tokens);
///         Ok::<_, ndscope::Error>(())
///     })
/// })?;
/// # Ok::<(), ndscope::Error>(())
/// ```
///
/// # Errors
/// [`Error::InvalidShape`] for an empty prompt, or when the cached and new tokens pass the model's
/// positions; [`Error::InvalidArgument`] for sampling settings out of range and a cache of another
/// pool; [`Error::KvCapacity`] when the cache cannot grow; as for the model's
/// [`decode`](CausalLm::decode). A failed step leaves the cache with the tokens run before it.
pub fn generate_in<'m, 'r, M: CausalLm<'m>>(
    model: &M,
    scope: &Scope<'r>,
    pool: &KvPool<'_>,
    cache: &mut KvCache<'r>,
    prompt: &[i64],
    options: &GenerateOptions,
) -> Result<Generation>
where
    'm: 'r,
{
    let max_positions = model.max_positions();
    let room = max_positions.saturating_sub(cache.len());
    if prompt.len() > room {
        return Err(Error::InvalidShape {
            op: "generate_in",
            shape: vec![cache.len(), prompt.len()],
            reason: format!(
                "{} cached and {} new tokens pass the model's {max_positions} positions; start a \
                 new cache from the sequence's last tokens",
                cache.len(),
                prompt.len()
            ),
        });
    }
    let decoding = Decoding::new(prompt, options, max_positions)?;
    decode_all(model, scope, pool, cache, decoding)
}

/// Runs `decoding` against `cache` until it finishes.
fn decode_all<'m, 'r, M: CausalLm<'m>>(
    model: &M,
    request: &Scope<'r>,
    pool: &KvPool<'_>,
    cache: &mut KvCache<'r>,
    mut decoding: Decoding,
) -> Result<Generation>
where
    'm: 'r,
{
    let max_positions = model.max_positions();
    if decoding.is_done_at_start() {
        return Ok(decoding.finish(Finish::Length, cache.usage()));
    }
    loop {
        let next = std::mem::take(&mut decoding.next);
        let logits = step(model, request, pool, cache, &next)?;
        if let Some(finish) = decoding.choose(&logits, cache.len(), max_positions) {
            return Ok(decoding.finish(finish, cache.usage()));
        }
    }
}
