//! Continuous batching: one engine decodes every active request in one forward pass per step;
//! requests join and leave between steps (Yu et al., OSDI 2022, "Orca"; vLLM's scheduler).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::generate::{Decoding, Finish, GenerateOptions, Generation, host_rows};
use crate::error::{Error, Result};
use crate::kv::{CausalLm, KvCache, KvPool, KvPoolStats};
use crate::scope::Scope;

/// A request for the engine.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// The prompt's tokens.
    pub prompt: Vec<i64>,
    /// What to generate.
    pub options: GenerateOptions,
    /// The engine step at which the request arrives (0: at once); it joins at the first step from
    /// then on at which the batch and the pool have room.
    pub arrival: usize,
}

/// What the engine may run at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineConfig {
    /// Requests decoded together, at most.
    pub max_batch: usize,
}

impl Default for EngineConfig {
    fn default() -> EngineConfig {
        EngineConfig { max_batch: 8 }
    }
}

/// A request the engine finished.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    /// The id [`Engine::submit`] returned.
    pub id: usize,
    /// The prompt's length.
    pub prompt_tokens: usize,
    /// What it generated.
    pub generation: Generation,
    /// From its arrival to its first token.
    pub first_token: Duration,
    /// From its arrival to its last token.
    pub latency: Duration,
    /// The steps it waited for room after arriving.
    pub steps_waited: usize,
}

/// What one engine step did (for [`Engine::run`]'s observer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepReport {
    /// The step's index.
    pub step: usize,
    /// Requests in the forward pass.
    pub batch: usize,
    /// Prompt tokens run (requests that joined this step).
    pub prompt_tokens: usize,
    /// Requests that joined this step.
    pub joined: usize,
    /// Requests that finished this step.
    pub finished: usize,
    /// The pool after the forward pass, before finished requests gave their blocks back.
    pub pool: KvPoolStats,
}

/// Admission policy: a request is admitted only when the pool can promise the blocks of its whole
/// length (prompt plus `max_new_tokens`), so an admitted request never finds the pool empty and no
/// request is ever preempted or starved of memory by another. A request that fits the pool but not
/// now waits (first come, first served: later requests do not overtake it); one that could never fit
/// is refused by [`submit`](Engine::submit) with [`Error::KvCapacity`], and so is a run whose next
/// request cannot be admitted while the engine runs nothing (caches outside the engine hold the pool). Blocks are taken as tokens
/// arrive, so promised-but-untaken blocks hold no data and cost no waste.
pub struct Engine<'p, M> {
    model: &'p M,
    pool: &'p KvPool<'p>,
    config: EngineConfig,
    waiting: VecDeque<Queued>,
    next_id: usize,
}

/// A submitted request, checked: its decoding state is made once, at `submit`.
struct Queued {
    id: usize,
    arrival: usize,
    prompt_tokens: usize,
    decoding: Decoding,
}

impl<M> std::fmt::Debug for Engine<'_, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("pool", self.pool)
            .field("config", &self.config)
            .field("waiting", &self.waiting.len())
            .finish()
    }
}

struct Active<'r> {
    id: usize,
    prompt_tokens: usize,
    cache: KvCache<'r>,
    decoding: Decoding,
    arrived: Instant,
    steps_waited: usize,
    first_token: Option<Duration>,
}

impl<'p, M> Engine<'p, M> {
    /// An engine serving `model` with caches from `pool`.
    pub fn new(model: &'p M, pool: &'p KvPool<'p>, config: EngineConfig) -> Engine<'p, M> {
        Engine {
            model,
            pool,
            config: EngineConfig {
                max_batch: config.max_batch.max(1),
            },
            waiting: VecDeque::new(),
            next_id: 0,
        }
    }

    /// Requests submitted and not run yet.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }
}

impl<'p, 'm, M: CausalLm<'m>> Engine<'p, M> {
    /// Queues `request`; its id.
    ///
    /// # Errors
    /// As for [`generate`](super::generate) for a bad prompt or sampling rule;
    /// [`Error::KvCapacity`] for a request whose tokens need more blocks than the pool has.
    pub fn submit(&mut self, request: Request) -> Result<usize> {
        let decoding = Decoding::new(
            &request.prompt,
            &request.options,
            self.model.max_positions(),
        )?;
        let needed = decoding.cache_tokens().div_ceil(self.pool.block_tokens());
        if needed > self.pool.blocks() {
            return Err(Error::KvCapacity {
                tokens: decoding.cache_tokens(),
                needed,
                available: self.pool.stats().blocks_free,
                total: self.pool.blocks(),
            });
        }
        let id = self.next_id;
        self.next_id += 1;
        self.waiting.push_back(Queued {
            id,
            arrival: request.arrival,
            prompt_tokens: request.prompt.len(),
            decoding,
        });
        Ok(id)
    }

    /// Runs every queued request to its end in a scope opened under `scope`, one forward pass per
    /// step over all active requests (the prompts of those joining, one token of the others), each
    /// step's temporaries in a scope of its own. `observe` sees each step's figures. Completions
    /// come in the order requests finished.
    ///
    /// # Errors
    /// As for the model's [`decode`](CausalLm::decode); [`Error::KvCapacity`] when the next request
    /// cannot be admitted while the engine runs nothing (the pool is held outside the engine). The
    /// requests running and waiting are then dropped, and their blocks given back.
    pub fn run<'a>(
        &mut self,
        scope: &Scope<'a>,
        mut observe: impl FnMut(&StepReport),
    ) -> Result<Vec<Completion>>
    where
        'm: 'a,
    {
        let (model, pool) = (self.model, self.pool);
        let max_positions = model.max_positions();
        let mut arrivals: Vec<Queued> = self.waiting.drain(..).collect();
        arrivals.sort_by_key(|p| (p.arrival, p.id));
        let mut arrivals: VecDeque<Queued> = arrivals.into();
        let config = self.config;
        scope.named_scope("engine", |engine| {
            let mut done = Vec::new();
            let mut active: Vec<Active<'_>> = Vec::new();
            // Requests that have arrived, with the step and time they arrived at.
            let mut queue: VecDeque<(Queued, usize, Instant)> = VecDeque::new();
            let mut step = 0;
            while !(arrivals.is_empty() && queue.is_empty() && active.is_empty()) {
                while arrivals.front().is_some_and(|p| p.arrival <= step) {
                    let p = arrivals.pop_front().expect("checked");
                    // A request that arrives at a later step is timed from its step's start.
                    queue.push_back((p, step, Instant::now()));
                }
                let mut joined = 0;
                let mut prompt_tokens = 0;
                while active.len() < config.max_batch {
                    let Some((pending, _, _)) = queue.front() else {
                        break;
                    };
                    let Ok(cache) = pool.cache(engine, pending.decoding.cache_tokens()) else {
                        break; // waits for blocks
                    };
                    let (pending, arrived_step, arrived) = queue.pop_front().expect("checked");
                    let a = Active {
                        id: pending.id,
                        prompt_tokens: pending.prompt_tokens,
                        cache,
                        decoding: pending.decoding,
                        arrived,
                        steps_waited: step - arrived_step,
                        first_token: None,
                    };
                    if a.decoding.is_done_at_start() {
                        done.push(complete(a, Finish::Length));
                        continue;
                    }
                    joined += 1;
                    prompt_tokens += a.decoding.next.len();
                    active.push(a);
                }
                if active.is_empty() {
                    if let Some((pending, _, _)) = queue.front() {
                        // Nothing of this engine holds a block, so waiting cannot help: the pool is
                        // held by caches outside the engine.
                        let tokens = pending.decoding.cache_tokens();
                        return Err(
                            pool.capacity_error(tokens, tokens.div_ceil(pool.block_tokens()))
                        );
                    }
                    // Nothing can run: requests are still to arrive.
                    step += 1;
                    continue;
                }
                let inputs: Vec<Vec<i64>> = active
                    .iter_mut()
                    .map(|a| std::mem::take(&mut a.decoding.next))
                    .collect();
                let rows = engine.scope(|s| -> Result<Vec<f32>> {
                    let mut caches: Vec<&mut KvCache<'_>> =
                        active.iter_mut().map(|a| &mut a.cache).collect();
                    let tokens: Vec<&[i64]> = inputs.iter().map(Vec::as_slice).collect();
                    host_rows(&model.decode(s, pool, &mut caches, &tokens)?)
                })?;
                let vocab = rows.len() / active.len();
                let pool_stats = pool.stats();
                let mut finished = 0;
                let mut i = 0;
                let mut still = Vec::with_capacity(active.len());
                for mut a in active.drain(..) {
                    let logits = &rows[i * vocab..(i + 1) * vocab];
                    i += 1;
                    a.first_token.get_or_insert_with(|| a.arrived.elapsed());
                    match a.decoding.choose(logits, a.cache.len(), max_positions) {
                        Some(finish) => {
                            finished += 1;
                            done.push(complete(a, finish));
                        }
                        None => still.push(a),
                    }
                }
                active = still;
                observe(&StepReport {
                    step,
                    batch: i,
                    prompt_tokens,
                    joined,
                    finished,
                    pool: pool_stats,
                });
                step += 1;
            }
            Ok(done)
        })
    }
}

/// The completion of `a`, whose cache is dropped here (its blocks go back to the pool).
fn complete(a: Active<'_>, finish: Finish) -> Completion {
    let latency = a.arrived.elapsed();
    Completion {
        id: a.id,
        prompt_tokens: a.prompt_tokens,
        first_token: a.first_token.unwrap_or(latency),
        latency,
        steps_waited: a.steps_waited,
        generation: a.decoding.finish(finish, a.cache.usage()),
    }
}
