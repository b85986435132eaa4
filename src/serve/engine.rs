//! Continuous batching: one engine decodes every active request in one forward pass per step;
//! requests join and leave between steps (Yu et al., OSDI 2022, "Orca"; vLLM's scheduler).

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use super::core::{CoreConfig, EngineCore, Event, StepReport, check_request};
use super::generate::{GenerateOptions, Generation};
#[cfg(doc)]
use crate::error::Error;
use crate::error::Result;
use crate::kv::{CausalLm, KvPool};
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
    waiting: Vec<(usize, Request)>,
    next_id: usize,
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

impl<'p, M> Engine<'p, M> {
    /// An engine serving `model` with caches from `pool`.
    pub fn new(model: &'p M, pool: &'p KvPool<'p>, config: EngineConfig) -> Engine<'p, M> {
        Engine {
            model,
            pool,
            config: EngineConfig {
                max_batch: config.max_batch.max(1),
            },
            waiting: Vec::new(),
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
        check_request(self.model, self.pool, &request.prompt, &request.options)?;
        let id = self.next_id;
        self.next_id += 1;
        self.waiting.push((id, request));
        Ok(id)
    }

    /// Runs every queued request to its end in a scope opened under `scope`, one forward pass per
    /// step over all active requests (the prompts of those joining, one token of the others), each
    /// step's temporaries in a scope of its own: an [`EngineCore`] given each request at its
    /// arrival step. `observe` sees each step's figures. Completions come in the order requests
    /// finished.
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
        let mut arrivals = std::mem::take(&mut self.waiting);
        arrivals.sort_by_key(|(id, r)| (r.arrival, *id));
        let mut arrivals: VecDeque<(usize, Request)> = arrivals.into();
        let config = CoreConfig {
            max_batch: self.config.max_batch,
            step_tokens: usize::MAX,
            max_waiting: usize::MAX,
        };
        scope.named_scope("engine", |engine| {
            let mut core = EngineCore::new(model, pool, engine, config);
            let mut ids = HashMap::new();
            let mut done = Vec::new();
            let mut step = 0;
            loop {
                while arrivals.front().is_some_and(|(_, r)| r.arrival <= step) {
                    let (id, request) = arrivals.pop_front().expect("checked");
                    ids.insert(core.submit(&request.prompt, &request.options)?, id);
                }
                if core.is_idle() && arrivals.is_empty() {
                    return Ok(done);
                }
                let ran = core.last_step().map(|r| r.step);
                for event in core.step()? {
                    match event {
                        Event::Token { .. } => {}
                        Event::Finished {
                            id,
                            generation,
                            timing,
                        } => done.push(Completion {
                            id: ids[&id],
                            prompt_tokens: timing.prompt_tokens,
                            generation,
                            first_token: timing.first_token,
                            latency: timing.latency,
                            steps_waited: timing.steps_waited,
                        }),
                        Event::Failed { error, .. } => return Err(error),
                    }
                }
                if let Some(report) = core.last_step().filter(|r| Some(r.step) != ran) {
                    observe(&StepReport { step, ..report });
                }
                step += 1;
            }
        })
    }
}
