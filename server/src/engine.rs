//! The engine thread: it owns the model's scope, the KV pool and an [`EngineCore`], and steps it
//! while requests run. Handlers talk to it through channels and get plain values back (token ids,
//! log-probabilities, why a sample ended): nothing of the scope — no tensor, no cache — can leave
//! this thread, and the compiler checks it (each is branded with a scope opened here).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Instant;

use ndscope::kv::{CausalLm, KvPool};
use ndscope::models::AutoModel;
use ndscope::serve::{CoreConfig, EngineCore, Event, Finish, GenerateOptions, RequestId};
use ndscope::{DType, Device, Error, root};
use tokio::sync::{mpsc as async_mpsc, oneshot};

use crate::metrics::{Blocks, Metrics};

/// What the engine is built from.
#[derive(Debug, Clone)]
pub struct EngineSettings {
    pub model: PathBuf,
    pub dtype: DType,
    pub device: Device,
    pub core: CoreConfig,
    /// Tokens the KV pool holds, all requests together.
    pub kv_tokens: Option<usize>,
    pub block_tokens: usize,
    /// Each step lasts at least this long (a throttle, so that a demo's or a test's streams can
    /// be watched and cut mid-way even on a tiny model).
    pub min_step: std::time::Duration,
}

/// The model's facts the handlers check requests against.
#[derive(Debug, Clone)]
pub struct ModelFacts {
    pub architecture: String,
    pub max_positions: usize,
    pub vocab_size: usize,
    pub end_tokens: Vec<i64>,
    pub kv_blocks: usize,
}

/// A request for the engine: `n` samples of one prompt.
#[derive(Debug)]
pub struct Job {
    pub prompt: Vec<i64>,
    pub options: GenerateOptions,
    pub n: usize,
}

/// What a handler hears about its request's samples.
#[derive(Debug, Clone, PartialEq)]
pub enum Update {
    Token {
        sample: usize,
        token: i64,
        logprob: f32,
    },
    Finished {
        sample: usize,
        finish: Finish,
    },
    Failed {
        sample: usize,
        message: String,
    },
}

pub enum Command {
    Submit {
        job: Job,
        updates: async_mpsc::UnboundedSender<Update>,
        reply: oneshot::Sender<Result<Vec<RequestId>, Error>>,
    },
    /// The handler is done with these samples (it met a stop string: `stop`; its client went away:
    /// `cancelled`): they end now and their blocks come back. Samples that ended already are
    /// skipped.
    End {
        ids: Vec<RequestId>,
        outcome: &'static str,
    },
    /// The scope tree, as `Scope::dump` writes it.
    Dump(oneshot::Sender<String>),
    /// Finish what runs, then end.
    Shutdown,
}

/// The handlers' side of the engine.
#[derive(Clone)]
pub struct EngineHandle {
    commands: mpsc::Sender<Command>,
}

impl EngineHandle {
    /// Sends `command`; false when the engine has ended.
    pub fn send(&self, command: Command) -> bool {
        self.commands.send(command).is_ok()
    }
}

/// A running sample: where its updates go, and its times.
struct Live {
    updates: async_mpsc::UnboundedSender<Update>,
    sample: usize,
    submitted: Instant,
    last: Option<Instant>,
}

/// Starts the engine thread, which loads the model; its facts once loaded.
///
/// # Errors
/// The load's error, as text.
pub fn spawn(
    settings: EngineSettings,
    metrics: Arc<Metrics>,
) -> Result<(EngineHandle, ModelFacts, JoinHandle<()>), String> {
    let (commands, inbox) = mpsc::channel();
    let (ready, loaded) = mpsc::channel();
    let thread = std::thread::Builder::new()
        .name("engine".into())
        .spawn(move || {
            let failed = ready.clone();
            if let Err(e) = serve(&settings, &metrics, inbox, ready) {
                // Before the facts were sent, this is the load's failure; after, a step's.
                if failed.send(Err(e.to_string())).is_err() {
                    eprintln!("engine: {e}");
                }
            }
        })
        .map_err(|e| format!("cannot start the engine thread: {e}"))?;
    match loaded.recv() {
        Ok(Ok(facts)) => Ok((EngineHandle { commands }, facts, thread)),
        Ok(Err(e)) => Err(e),
        Err(_) => Err("the engine thread ended while loading the model".into()),
    }
}

type Ready = mpsc::Sender<Result<ModelFacts, String>>;

fn serve(
    settings: &EngineSettings,
    metrics: &Metrics,
    inbox: mpsc::Receiver<Command>,
    ready: Ready,
) -> ndscope::Result<()> {
    root(settings.device, |model_scope| {
        let model = AutoModel::from_pretrained(model_scope, &settings.model, settings.dtype)?;
        let kv_tokens = settings
            .kv_tokens
            .unwrap_or_else(|| settings.core.max_batch * model.max_positions().min(2048));
        let pool = KvPool::for_tokens(
            model_scope,
            model.kv_shape(),
            settings.block_tokens,
            kv_tokens,
        )?;
        let facts = ModelFacts {
            architecture: model.architecture().to_string(),
            max_positions: model.max_positions(),
            vocab_size: model.vocab_size(),
            end_tokens: model.end_tokens().to_vec(),
            kv_blocks: pool.blocks(),
        };
        let _ = ready.send(Ok(facts));
        model_scope.named_scope("engine", |engine| {
            let mut core = EngineCore::new(&model, &pool, engine, settings.core);
            let mut live: HashMap<RequestId, Live> = HashMap::new();
            let mut ending = false;
            publish(metrics, &core);
            loop {
                // Idle, the thread sleeps until a command comes; busy, it takes what came.
                let first = if core.is_idle() {
                    if ending {
                        return Ok(());
                    }
                    match inbox.recv() {
                        Ok(command) => Some(command),
                        Err(_) => return Ok(()), // every handle is gone
                    }
                } else {
                    None
                };
                for command in first.into_iter().chain(inbox.try_iter()) {
                    match command {
                        Command::Submit {
                            job,
                            updates,
                            reply,
                        } => {
                            let submitted = Instant::now();
                            let result = core.submit_samples(&job.prompt, &job.options, job.n);
                            if let Ok(ids) = &result {
                                metrics.prompt_tokens(job.prompt.len());
                                for (sample, &id) in ids.iter().enumerate() {
                                    let updates = updates.clone();
                                    let last = None;
                                    live.insert(
                                        id,
                                        Live {
                                            updates,
                                            sample,
                                            submitted,
                                            last,
                                        },
                                    );
                                }
                            }
                            if reply.send(result.clone()).is_err() {
                                // The handler is gone already.
                                for id in result.unwrap_or_default() {
                                    cancel(&mut core, &mut live, metrics, id, "cancelled");
                                }
                            }
                        }
                        Command::End { ids, outcome } => {
                            for id in ids {
                                cancel(&mut core, &mut live, metrics, id, outcome);
                            }
                        }
                        Command::Dump(reply) => {
                            let _ = reply.send(model_scope.dump());
                        }
                        Command::Shutdown => ending = true,
                    }
                }
                if core.is_idle() {
                    publish(metrics, &core);
                    continue;
                }
                let started = Instant::now();
                match core.step() {
                    Ok(events) => {
                        for event in events {
                            dispatch(&mut core, &mut live, metrics, event);
                        }
                    }
                    Err(error) => {
                        // The logits did not reach the host: every running request fails.
                        let message = error.to_string();
                        for (id, l) in live.drain() {
                            core.cancel(id);
                            metrics.outcome("failed");
                            let sample = l.sample;
                            let _ = l.updates.send(Update::Failed {
                                sample,
                                message: message.clone(),
                            });
                        }
                    }
                }
                publish(metrics, &core);
                if let Some(rest) = settings.min_step.checked_sub(started.elapsed()) {
                    std::thread::sleep(rest);
                }
            }
        })
    })
}

/// Hands `event` to its request's handler; a handler that has gone (its client disconnected)
/// cancels the sample, and its blocks come back now.
fn dispatch<M>(
    core: &mut EngineCore<'_, '_, M>,
    live: &mut HashMap<RequestId, Live>,
    metrics: &Metrics,
    event: Event,
) {
    match event {
        Event::Token { id, token, logprob } => {
            let Some(l) = live.get_mut(&id) else { return };
            let now = Instant::now();
            metrics.token(now - l.last.unwrap_or(l.submitted), l.last.is_none());
            l.last = Some(now);
            let sample = l.sample;
            if l.updates
                .send(Update::Token {
                    sample,
                    token,
                    logprob,
                })
                .is_err()
            {
                live.remove(&id);
                core.cancel(id);
                metrics.outcome("cancelled");
            }
        }
        Event::Finished { id, generation, .. } => {
            let Some(l) = live.remove(&id) else { return };
            metrics.outcome(match generation.finish {
                Finish::Stop(_) => "stop",
                Finish::Length | Finish::Positions => "length",
            });
            let finish = generation.finish;
            let _ = l.updates.send(Update::Finished {
                sample: l.sample,
                finish,
            });
        }
        Event::Failed { id, error } => {
            let Some(l) = live.remove(&id) else { return };
            metrics.outcome("failed");
            let message = error.to_string();
            let _ = l.updates.send(Update::Failed {
                sample: l.sample,
                message,
            });
        }
    }
}

fn cancel<M>(
    core: &mut EngineCore<'_, '_, M>,
    live: &mut HashMap<RequestId, Live>,
    metrics: &Metrics,
    id: RequestId,
    outcome: &'static str,
) {
    if live.remove(&id).is_some() && core.cancel(id) {
        metrics.outcome(outcome);
    }
}

fn publish<M>(metrics: &Metrics, core: &EngineCore<'_, '_, M>) {
    let stats = core.pool().stats();
    let blocks = Blocks {
        used: stats.blocks_used(),
        free: stats.blocks_free,
        shared: stats.blocks_shared,
        promised: stats.blocks_promised,
    };
    metrics.engine(core.waiting(), core.running(), blocks);
}
