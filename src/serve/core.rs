//! The engine as a stepper: requests are submitted and cancelled at any time, and each [`step`]
//! runs one forward pass over the running requests and says what happened to each of them as
//! [`Event`]s (vLLM's `EngineCore`: `add_request`, `abort_request`, `step`). A server drives it from
//! the thread that owns the model's scope; [`Engine::run`](super::Engine::run) is a loop over it.
//!
//! [`step`]: EngineCore::step

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::generate::{Decoding, Finish, GenerateOptions, Generation, host_rows};
use super::sample::Summary;
use crate::error::{Error, Result};
use crate::kv::{CausalLm, KvCache, KvPool, KvPoolStats};
use crate::scope::Scope;

/// What [`EngineCore::submit`] returns: the request's name in the events.
pub type RequestId = u64;

/// How much an [`EngineCore`] takes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CoreConfig {
    /// Requests running at once (each sample of a request counts), at most.
    pub max_batch: usize,
    /// Tokens one forward pass runs, at most: each decoding request's one token first, then chunks
    /// of the prompts still to run, first come first served (chunked prefill: a long prompt joins
    /// over several steps while the others keep decoding). Raised to `max_batch` if lower.
    pub step_tokens: usize,
    /// Requests (samples) that may wait for room in the batch, at most: those the batch's free
    /// places can take at the next step do not count. Past it [`submit`](EngineCore::submit)
    /// refuses with [`Error::Overloaded`] (a bounded queue: overload is refused at once, not turned
    /// into everyone's timeout).
    pub max_waiting: usize,
}

impl Default for CoreConfig {
    fn default() -> CoreConfig {
        CoreConfig {
            max_batch: 8,
            step_tokens: 512,
            max_waiting: 256,
        }
    }
}

/// What happened to a request in a [`step`](EngineCore::step).
#[derive(Debug)]
pub enum Event {
    /// It chose its next token.
    Token {
        /// The request.
        id: RequestId,
        /// The token.
        token: i64,
        /// Its log-probability under the model (before temperature and filters).
        logprob: f32,
    },
    /// It ended; its blocks are back in the pool. Its last [`Token`](Event::Token) came before,
    /// in the same step.
    Finished {
        /// The request.
        id: RequestId,
        /// Everything it generated, why it ended, and its cache's figures at the end.
        generation: Generation,
        /// How long it took.
        timing: Timing,
    },
    /// It failed, and holds nothing any more; the other requests go on.
    Failed {
        /// The request.
        id: RequestId,
        /// Why.
        error: Error,
    },
}

/// A finished request's times and sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    /// The prompt's tokens.
    pub prompt_tokens: usize,
    /// From [`submit`](EngineCore::submit) to the first token.
    pub first_token: Duration,
    /// From `submit` to the last token.
    pub latency: Duration,
    /// The steps it waited for room before it started.
    pub steps_waited: usize,
}

/// What one step did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepReport {
    /// The step's index (steps that ran a forward pass, from 0).
    pub step: usize,
    /// Requests in the forward pass.
    pub batch: usize,
    /// Prompt tokens run (whole prompts and chunks of them).
    pub prompt_tokens: usize,
    /// Requests that started this step.
    pub joined: usize,
    /// Requests that finished this step.
    pub finished: usize,
    /// The pool after the forward pass, before finished requests gave their blocks back.
    pub pool: KvPoolStats,
}

/// A submitted request, checked, waiting for room: one prompt and the decoding state of each of
/// its samples.
struct Waiting {
    samples: Vec<(RequestId, Decoding)>,
    prompt_tokens: usize,
    submitted: Instant,
    submitted_step: usize,
}

/// A sample that forks the prompt's cache once the prompt has run, and the empty cache that holds
/// the blocks its fork will need promised until then.
struct Sibling<'r> {
    id: RequestId,
    decoding: Decoding,
    promise: KvCache<'r>,
}

struct Running<'r> {
    id: RequestId,
    cache: KvCache<'r>,
    /// Its state; `decoding.next` holds the prompt tokens still to run, then the last token chosen.
    decoding: Decoding,
    /// Whether the whole prompt has run (the next pass runs one token and samples from it).
    decoding_started: bool,
    siblings: Vec<Sibling<'r>>,
    prompt_tokens: usize,
    submitted: Instant,
    steps_waited: usize,
    first_token: Option<Duration>,
}

impl Running<'_> {
    fn timing(&self) -> Timing {
        let latency = self.submitted.elapsed();
        Timing {
            prompt_tokens: self.prompt_tokens,
            first_token: self.first_token.unwrap_or(latency),
            latency,
            steps_waited: self.steps_waited,
        }
    }
}

/// Continuous batching as a stepper, with every running request's cache in the scope `'r` it is
/// given (one brand for all caches, so one forward pass can take them all; a cache can leave that
/// scope neither through an event nor into the model's): [`submit`](Self::submit) checks a request
/// and queues it, [`cancel`](Self::cancel) drops it wherever it is, [`step`](Self::step) runs one
/// forward pass and reports what happened as [`Event`]s. A request's blocks go back to the pool
/// the moment it finishes, fails or is cancelled.
///
/// Admission promises a request the blocks of its whole length (prompt plus `max_new_tokens`, for
/// each sample), so a running request never finds the pool empty and none is preempted; requests
/// start first come, first served. The samples of one prompt run the prompt once and share its
/// full blocks ([`KvCache::fork`]).
///
/// ```
/// use ndscope::kv::{CausalLm, KvPool};
/// use ndscope::models::Gpt2;
/// use ndscope::serve::{CoreConfig, EngineCore, Event, GenerateOptions};
/// use ndscope::{DType, Device, root};
///
/// root(Device::Cpu, |model_scope| {
///     let gpt2 = Gpt2::from_pretrained(model_scope, "data/gpt2-tiny", DType::F32)?;
///     let pool = KvPool::new(model_scope, gpt2.kv_shape(), 16, 32)?;
///     model_scope.named_scope("engine", |engine| {
///         let mut core = EngineCore::new(&gpt2, &pool, engine, CoreConfig::default());
///         let a = core.submit(&[33, 292, 482], &GenerateOptions::greedy(4))?;
///         let b = core.submit(&[308, 33], &GenerateOptions::greedy(50))?;
///         let mut tokens = 0;
///         while !core.is_idle() {
///             for event in core.step()? {
///                 match event {
///                     Event::Token { id, .. } => {
///                         tokens += 1;
///                         if id == b && tokens == 6 {
///                             assert!(core.cancel(b)); // its blocks are back at once
///                         }
///                     }
///                     Event::Finished { id, generation, .. } => assert_eq!((id, generation.tokens.len()), (a, 4)),
///                     Event::Failed { error, .. } => return Err(error),
///                 }
///             }
///         }
///         assert_eq!(pool.stats().blocks_free, 32);
///         Ok(())
///     })
/// })?;
/// # Ok::<(), ndscope::Error>(())
/// ```
pub struct EngineCore<'r, 'p, M> {
    model: &'p M,
    pool: &'p KvPool<'p>,
    scope: &'r Scope<'r>,
    config: CoreConfig,
    waiting: VecDeque<Waiting>,
    running: Vec<Running<'r>>,
    next_id: RequestId,
    steps: usize,
    report: Option<StepReport>,
}

impl<M> std::fmt::Debug for EngineCore<'_, '_, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineCore")
            .field("pool", self.pool)
            .field("config", &self.config)
            .field("waiting", &self.waiting())
            .field("running", &self.running())
            .field("steps", &self.steps)
            .finish()
    }
}

impl<'r, 'p, M> EngineCore<'r, 'p, M> {
    /// The settings in force (`max_batch` at least 1, `step_tokens` at least `max_batch`).
    pub fn config(&self) -> CoreConfig {
        self.config
    }

    /// Drops request `id` wherever it is, giving its blocks back at once; whether it was there (a
    /// request that finished or failed is not). Its other samples go on.
    pub fn cancel(&mut self, id: RequestId) -> bool {
        if let Some(w) = self
            .waiting
            .iter()
            .position(|w| w.samples.iter().any(|(s, _)| *s == id))
        {
            let samples = &mut self.waiting[w].samples;
            samples.retain(|(s, _)| *s != id);
            if samples.is_empty() {
                self.waiting.remove(w);
            }
            return true;
        }
        for r in 0..self.running.len() {
            let running = &mut self.running[r];
            if let Some(s) = running.siblings.iter().position(|s| s.id == id) {
                running.siblings.remove(s);
                return true;
            }
            if running.id == id {
                if running.siblings.is_empty() {
                    self.running.remove(r);
                } else {
                    // A sample still waiting for the prompt takes over its cache and the prompt's
                    // rest; its own promise is no longer needed (the cache has the full one).
                    let heir = running.siblings.remove(0);
                    let mut decoding = heir.decoding;
                    decoding.next = std::mem::take(&mut running.decoding.next);
                    running.id = heir.id;
                    running.decoding = decoding;
                }
                return true;
            }
        }
        false
    }

    /// Requests waiting to start (each sample counts).
    pub fn waiting(&self) -> usize {
        self.waiting.iter().map(|w| w.samples.len()).sum()
    }

    /// Requests running (each sample counts, those waiting for their prompt's fork too).
    pub fn running(&self) -> usize {
        self.running.iter().map(|r| 1 + r.siblings.len()).sum()
    }

    /// Whether nothing waits or runs: [`step`](Self::step) would do nothing.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    /// The pool the caches come from.
    pub fn pool(&self) -> &KvPool<'p> {
        self.pool
    }

    /// The last step that ran a forward pass.
    pub fn last_step(&self) -> Option<StepReport> {
        self.report
    }
}

impl<'r, 'p, 'm, M: CausalLm<'m>> EngineCore<'r, 'p, M>
where
    'm: 'r,
{
    /// An engine serving `model` with caches from `pool`, held in `scope`.
    pub fn new(
        model: &'p M,
        pool: &'p KvPool<'p>,
        scope: &'r Scope<'r>,
        config: CoreConfig,
    ) -> EngineCore<'r, 'p, M> {
        let max_batch = config.max_batch.max(1);
        EngineCore {
            model,
            pool,
            scope,
            config: CoreConfig {
                max_batch,
                step_tokens: config.step_tokens.max(max_batch),
                max_waiting: config.max_waiting,
            },
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_id: 0,
            steps: 0,
            report: None,
        }
    }

    /// Queues a request for `options.max_new_tokens` tokens after `prompt`; its id.
    ///
    /// # Errors
    /// Everything a request could fail on is checked here, so an accepted request fails later only
    /// if the model's forward pass does: [`Error::InvalidShape`] for an empty prompt or one longer
    /// than the model's positions; [`Error::IndexOutOfRange`] for a token outside the vocabulary;
    /// [`Error::InvalidArgument`] for sampling settings out of range; [`Error::KvCapacity`] for a
    /// request that needs more blocks than the pool has; [`Error::Overloaded`] when it would make
    /// more than `max_waiting` requests wait for room in the batch.
    pub fn submit(&mut self, prompt: &[i64], options: &GenerateOptions) -> Result<RequestId> {
        Ok(self.submit_samples(prompt, options, 1)?[0])
    }

    /// Queues `n` samples of one prompt, which run the prompt once and share its blocks; their
    /// ids. Sample `i` draws from seed `options.seed + i`.
    ///
    /// # Errors
    /// As for [`submit`](Self::submit); [`Error::InvalidArgument`] for `n` of 0 or more than
    /// `max_batch`; [`Error::KvCapacity`] when the samples together need more blocks than the pool
    /// has.
    pub fn submit_samples(
        &mut self,
        prompt: &[i64],
        options: &GenerateOptions,
        n: usize,
    ) -> Result<Vec<RequestId>> {
        if n == 0 || n > self.config.max_batch {
            return Err(Error::InvalidArgument {
                op: "EngineCore::submit_samples",
                reason: format!(
                    "asks for {n} samples; ask for 1 to {} (the engine's max_batch)",
                    self.config.max_batch
                ),
            });
        }
        let first = check_request(self.model, self.pool, prompt, options)?;
        let blocks = self.blocks_of(&first, prompt.len(), n);
        if blocks > self.pool.blocks() {
            return Err(Error::KvCapacity {
                tokens: first.cache_tokens() * n,
                needed: blocks,
                available: self.pool.stats().blocks_free,
                total: self.pool.blocks(),
            });
        }
        let places = self.config.max_batch.saturating_sub(self.running());
        let would_wait = (self.waiting() + n).saturating_sub(places);
        if would_wait > self.config.max_waiting {
            return Err(Error::Overloaded {
                waiting: self.waiting().saturating_sub(places),
                limit: self.config.max_waiting,
            });
        }
        let mut samples = vec![(self.take_id(), first)];
        for i in 1..n {
            let seeded = GenerateOptions {
                seed: options.seed.wrapping_add(i as u64),
                ..options.clone()
            };
            let decoding = Decoding::new(prompt, &seeded, self.model.max_positions())?;
            samples.push((self.take_id(), decoding));
        }
        let ids = samples.iter().map(|(id, _)| *id).collect();
        self.waiting.push_back(Waiting {
            samples,
            prompt_tokens: prompt.len(),
            submitted: Instant::now(),
            submitted_step: self.steps,
        });
        Ok(ids)
    }

    /// Starts the waiting requests there is room for, runs one forward pass over the running ones
    /// (one token of each decoding request, chunks of prompts within `step_tokens`) in a scope of
    /// its own, and chooses each finished prompt's or decoding request's next token. Does nothing
    /// when [`is_idle`](Self::is_idle).
    ///
    /// # Errors
    /// None of a request's own making: those are [`Event::Failed`]. A failed forward pass fails
    /// the requests in it (as events); the call returns `Err` only when the host copy of the
    /// logits fails, leaving every request where it was.
    pub fn step(&mut self) -> Result<Vec<Event>> {
        let mut events = Vec::new();
        let joined = self.admit(&mut events);
        if self.running.is_empty() {
            return Ok(events);
        }
        // Decoding requests first, one token each; then prompt chunks in order within the budget.
        let decoding = self.running.iter().filter(|r| r.decoding_started).count();
        let mut budget = self.config.step_tokens.saturating_sub(decoding);
        let mut inputs: Vec<(usize, Vec<i64>)> = Vec::new();
        let mut prompt_tokens = 0;
        for (i, r) in self.running.iter_mut().enumerate() {
            if r.decoding_started {
                inputs.push((i, std::mem::take(&mut r.decoding.next)));
            } else if budget > 0 {
                let take = r.decoding.next.len().min(budget);
                budget -= take;
                prompt_tokens += take;
                inputs.push((i, r.decoding.next.drain(..take).collect()));
            }
        }
        let (model, pool) = (self.model, self.pool);
        let result = {
            let mut caches: Vec<&mut KvCache<'r>> = Vec::with_capacity(inputs.len());
            let mut j = 0;
            for (i, r) in self.running.iter_mut().enumerate() {
                if inputs.get(j).is_some_and(|(k, _)| *k == i) {
                    caches.push(&mut r.cache);
                    j += 1;
                }
            }
            let tokens: Vec<&[i64]> = inputs.iter().map(|(_, t)| t.as_slice()).collect();
            self.scope
                .scope(|s| host_rows(&model.decode(s, pool, &mut caches, &tokens)?))
        };
        let pool_stats = pool.stats();
        let rows = match result {
            Ok(rows) => rows,
            Err(error) => {
                // The caches count none of the pass's tokens: the requests in it fail, the
                // others go on.
                let failed: Vec<usize> = inputs.iter().map(|(i, _)| *i).collect();
                let mut i = 0;
                self.running.retain_mut(|r| {
                    let keep = !failed.contains(&i);
                    i += 1;
                    if !keep {
                        for id in std::iter::once(r.id).chain(r.siblings.iter().map(|s| s.id)) {
                            events.push(Event::Failed {
                                id,
                                error: error.clone(),
                            });
                        }
                    }
                    keep
                });
                return Ok(events);
            }
        };
        let vocab = rows.len() / inputs.len();
        let summaries = self.summaries(&rows, vocab, &inputs);
        let max_positions = model.max_positions();
        let mut finished_at = Vec::new();
        let mut forks = Vec::new();
        for (row, (i, _)) in inputs.iter().enumerate() {
            let r = &mut self.running[*i];
            if !r.decoding.next.is_empty() {
                continue; // the prompt's next chunk runs in a later step
            }
            r.decoding_started = true;
            let logits = &rows[row * vocab..(row + 1) * vocab];
            r.first_token.get_or_insert_with(|| r.submitted.elapsed());
            // The prompt has run: its other samples fork its cache and choose from its logits.
            for sibling in std::mem::take(&mut r.siblings) {
                let Sibling {
                    id,
                    mut decoding,
                    promise,
                } = sibling;
                drop(promise); // its blocks are promised again to the fork, at once
                let cache = match r.cache.fork(self.scope, pool, decoding.cache_tokens()) {
                    Ok(cache) => cache,
                    Err(error) => {
                        events.push(Event::Failed { id, error });
                        continue;
                    }
                };
                let finish =
                    decoding.choose_summarized(logits, summaries[row], cache.len(), max_positions);
                let fork = Running {
                    id,
                    cache,
                    decoding,
                    decoding_started: true,
                    siblings: Vec::new(),
                    prompt_tokens: r.prompt_tokens,
                    submitted: r.submitted,
                    steps_waited: r.steps_waited,
                    first_token: r.first_token,
                };
                match finish {
                    Some(finish) => events.extend(finished_event(fork, finish)),
                    None => {
                        events.push(token_event(&fork));
                        forks.push(fork);
                    }
                }
            }
            match r
                .decoding
                .choose_summarized(logits, summaries[row], r.cache.len(), max_positions)
            {
                Some(finish) => finished_at.push((*i, finish)),
                None => events.push(token_event(r)),
            }
        }
        let mut finished = 0;
        for (i, finish) in finished_at.into_iter().rev() {
            finished += 1;
            events.extend(finished_event(self.running.remove(i), finish));
        }
        self.running.extend(forks);
        self.report = Some(StepReport {
            step: self.steps,
            batch: inputs.len(),
            prompt_tokens,
            joined,
            finished,
            pool: pool_stats,
        });
        self.steps += 1;
        Ok(events)
    }

    /// The [`Summary`] of each row of the step's logits (`vocab` a row, one row per input) whose
    /// request chooses a token now (its prompt has run), on every thread when several do: eight
    /// requests' rows of GPT-2's 50,257 logits took 7 % of the calling thread's time in their
    /// decoding, while the other thread waited.
    fn summaries(
        &self,
        rows: &[f32],
        vocab: usize,
        inputs: &[(usize, Vec<i64>)],
    ) -> Vec<Option<Summary>> {
        use rayon::prelude::*;
        let choosing: Vec<bool> = inputs
            .iter()
            .map(|(i, _)| self.running[*i].decoding.next.is_empty())
            .collect();
        let summary = |(row, &chooses): (usize, &bool)| {
            chooses.then(|| Summary::of(&rows[row * vocab..(row + 1) * vocab]))
        };
        if choosing.iter().filter(|&&c| c).count() > 1 {
            choosing.par_iter().enumerate().map(summary).collect()
        } else {
            choosing.iter().enumerate().map(summary).collect()
        }
    }

    /// Starts waiting requests, first come first served, while the batch and the pool have room;
    /// the number started. A request that cannot start while nothing runs fails: caches outside
    /// the engine hold the pool, and waiting would not help.
    fn admit(&mut self, events: &mut Vec<Event>) -> usize {
        let mut joined = 0;
        while let Some(head) = self.waiting.front() {
            if self.running() + head.samples.len() > self.config.max_batch {
                break;
            }
            let head = self.waiting.pop_front().expect("checked");
            let (caches, promises) = match self.promise(&head) {
                Ok(blocks) => blocks,
                Err(error) if self.running.is_empty() => {
                    for (id, _) in head.samples {
                        events.push(Event::Failed {
                            id,
                            error: error.clone(),
                        });
                    }
                    continue;
                }
                Err(_) => {
                    self.waiting.push_front(head); // waits for blocks
                    break;
                }
            };
            let mut samples = head.samples.into_iter();
            let (id, decoding) = samples.next().expect("a request has a sample");
            let running = Running {
                id,
                cache: caches,
                decoding,
                decoding_started: false,
                siblings: samples
                    .zip(promises)
                    .map(|((id, decoding), promise)| Sibling {
                        id,
                        decoding,
                        promise,
                    })
                    .collect(),
                prompt_tokens: head.prompt_tokens,
                submitted: head.submitted,
                steps_waited: self.steps - head.submitted_step,
                first_token: None,
            };
            if running.decoding.is_done_at_start() {
                let timing = running.timing();
                let kv = running.cache.usage();
                events.push(Event::Finished {
                    id: running.id,
                    generation: running.decoding.finish(Finish::Length, kv),
                    timing,
                });
                for s in running.siblings {
                    events.push(Event::Finished {
                        id: s.id,
                        generation: s.decoding.finish(Finish::Length, kv),
                        timing,
                    });
                }
                continue;
            }
            joined += 1 + running.siblings.len();
            self.running.push(running);
        }
        joined
    }

    /// The blocks `w` needs, promised: the prompt's cache, and for each further sample an empty
    /// cache holding what its fork will need until the prompt has run.
    fn promise(&self, w: &Waiting) -> Result<(KvCache<'r>, Vec<KvCache<'r>>)> {
        let first = &w.samples[0].1;
        let cache = self.pool.cache(self.scope, first.cache_tokens())?;
        let fork_tokens = self.fork_blocks(first, w.prompt_tokens) * self.pool.block_tokens();
        let promises = (1..w.samples.len())
            .map(|_| self.pool.cache(self.scope, fork_tokens))
            .collect::<Result<_>>()?;
        Ok((cache, promises))
    }

    /// The blocks a fork of the prompt's cache needs of its own: those past the prompt's full
    /// ones ([`KvCache::fork`]).
    fn fork_blocks(&self, decoding: &Decoding, prompt_tokens: usize) -> usize {
        let block = self.pool.block_tokens();
        decoding.cache_tokens().div_ceil(block) - prompt_tokens / block
    }

    /// Blocks `n` samples of `decoding`'s request need at most.
    fn blocks_of(&self, decoding: &Decoding, prompt_tokens: usize, n: usize) -> usize {
        decoding.cache_tokens().div_ceil(self.pool.block_tokens())
            + (n - 1) * self.fork_blocks(decoding, prompt_tokens)
    }

    fn take_id(&mut self) -> RequestId {
        let id = self.next_id;
        self.next_id += 1;
        id
    }
}

/// Checks `prompt` and `options` against `model` and `pool`: the request's decoding state.
pub(crate) fn check_request<'m, M: CausalLm<'m>>(
    model: &M,
    pool: &KvPool<'_>,
    prompt: &[i64],
    options: &GenerateOptions,
) -> Result<Decoding> {
    let decoding = Decoding::new(prompt, options, model.max_positions())?;
    let vocab = model.vocab_size();
    if let Some(&bad) = prompt
        .iter()
        .find(|&&t| usize::try_from(t).map_or(true, |t| t >= vocab))
    {
        return Err(Error::IndexOutOfRange {
            op: "submit",
            index: bad,
            size: vocab,
        });
    }
    let needed = decoding.cache_tokens().div_ceil(pool.block_tokens());
    if needed > pool.blocks() {
        return Err(Error::KvCapacity {
            tokens: decoding.cache_tokens(),
            needed,
            available: pool.stats().blocks_free,
            total: pool.blocks(),
        });
    }
    Ok(decoding)
}

fn token_event(r: &Running<'_>) -> Event {
    let (token, logprob) = r.decoding.last();
    Event::Token {
        id: r.id,
        token,
        logprob,
    }
}

/// The last token's event and the end's: the request's cache is dropped here (its blocks go back).
fn finished_event(r: Running<'_>, finish: Finish) -> [Event; 2] {
    let token = token_event(&r);
    let timing = r.timing();
    let kv = r.cache.usage();
    [
        token,
        Event::Finished {
            id: r.id,
            generation: r.decoding.finish(finish, kv),
            timing,
        },
    ]
}
