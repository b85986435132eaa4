//! The engine as a stepper (`serve::EngineCore`): requests submitted, cancelled and stepped in any
//! order decode what `generate` decodes alone, chunked prompts included; samples of one prompt share
//! its blocks; a bad request is refused at `submit` and never touches the others; every block comes
//! back the moment its request ends.

use std::collections::{HashMap, HashSet};

use ndscope::kv::{CausalLm, KvPool};
use ndscope::models::Gpt2;
use ndscope::serve::{
    CoreConfig, EngineCore, Event, GenerateOptions, Generation, RequestId, Sampling, generate,
};
use ndscope::{DType, Device, Error, Scope, root};
use proptest::prelude::*;

const MODEL: &str = "data/gpt2-tiny";

/// What the events said of each request: its tokens and log-probabilities as they came, and how
/// it ended.
#[derive(Default)]
struct Seen {
    tokens: HashMap<RequestId, Vec<(i64, f32)>>,
    finished: HashMap<RequestId, Generation>,
    failed: HashMap<RequestId, Error>,
    cancelled: HashSet<RequestId>,
}

impl Seen {
    fn take(&mut self, events: Vec<Event>) {
        for event in events {
            match event {
                Event::Token { id, token, logprob } => {
                    assert!(!self.finished.contains_key(&id), "a token after the end");
                    self.tokens.entry(id).or_default().push((token, logprob));
                }
                Event::Finished { id, generation, .. } => {
                    let streamed: Vec<i64> = self
                        .tokens
                        .get(&id)
                        .map(|t| t.iter().map(|p| p.0).collect())
                        .unwrap_or_default();
                    assert_eq!(streamed, generation.tokens, "the stream is the generation");
                    assert!(self.finished.insert(id, generation).is_none());
                }
                Event::Failed { id, error } => {
                    assert!(self.failed.insert(id, error).is_none());
                }
            }
        }
    }
}

fn prompt(len: usize, salt: i64) -> Vec<i64> {
    (0..len as i64)
        .map(|i| (i * 37 + salt * 11) % 90 + 3)
        .collect()
}

fn drain<'r, 'm: 'r, M: CausalLm<'m>>(core: &mut EngineCore<'r, '_, M>, seen: &mut Seen) {
    while !core.is_idle() {
        seen.take(core.step().unwrap());
    }
}

/// Requests arriving while others decode, with prompts cut into chunks of a small step budget,
/// produce exactly `generate`'s tokens and log-probabilities; the prompt tokens of a step never
/// pass the budget left by the decoding requests.
#[test]
fn chunked_and_interleaved_requests_decode_what_each_decodes_alone() {
    root(Device::Cpu, |s| {
        let gpt2 = Gpt2::from_pretrained(s, MODEL, DType::F32)?;
        let pool = KvPool::new(s, gpt2.kv_shape(), 4, 96)?;
        let requests: Vec<(Vec<i64>, GenerateOptions)> = vec![
            (prompt(23, 1), GenerateOptions::greedy(9)),
            (prompt(3, 2), GenerateOptions::greedy(14)),
            (
                prompt(17, 3),
                GenerateOptions::sampled(11, Sampling::with_temperature(0.9), 7),
            ),
            (prompt(1, 4), GenerateOptions::greedy(5)),
        ];
        let alone: Vec<Generation> = requests
            .iter()
            .map(|(p, o)| generate(&gpt2, s, &pool, p, o))
            .collect::<ndscope::Result<_>>()?;
        let config = CoreConfig {
            max_batch: 3,
            step_tokens: 6,
            max_waiting: 8,
        };
        let mut seen = Seen::default();
        let mut ids = Vec::new();
        s.named_scope("engine", |engine| {
            let mut core = EngineCore::new(&gpt2, &pool, engine, config);
            // Two at once, the others joining while those decode.
            for (p, o) in &requests[..2] {
                ids.push(core.submit(p, o)?);
            }
            for step in 0.. {
                if step == 2 || step == 5 {
                    let (p, o) = &requests[ids.len()];
                    ids.push(core.submit(p, o)?);
                }
                if core.is_idle() && ids.len() == requests.len() {
                    break;
                }
                seen.take(core.step()?);
                let report = core.last_step().expect("a pass ran");
                assert!(report.batch <= 3);
                assert!(report.prompt_tokens <= 6, "{report:?}");
            }
            Ok::<_, Error>(())
        })?;
        for (i, id) in ids.iter().enumerate() {
            let got = &seen.finished[id];
            assert_eq!(got.tokens, alone[i].tokens, "request {i}");
            assert_eq!(got.logprobs, alone[i].logprobs, "request {i}");
            assert_eq!(got.finish, alone[i].finish);
        }
        assert_eq!(pool.stats().blocks_free, 96);
        assert_eq!(pool.stats().blocks_promised, 0);
        Ok::<_, Error>(())
    })
    .unwrap();
}

/// `n` samples of one prompt run it once and share its full blocks; each draws from its own seed,
/// as `generate` with that seed does.
#[test]
fn samples_of_one_prompt_share_its_blocks_and_draw_their_own_tokens() {
    root(Device::Cpu, |s| {
        let gpt2 = Gpt2::from_pretrained(s, MODEL, DType::F32)?;
        let pool = KvPool::new(s, gpt2.kv_shape(), 4, 64)?;
        let p = prompt(18, 5);
        let options = GenerateOptions::sampled(6, Sampling::with_temperature(1.0), 100);
        let alone: Vec<Generation> = (0..3)
            .map(|i| {
                let o = GenerateOptions {
                    seed: 100 + i,
                    ..options.clone()
                };
                generate(&gpt2, s, &pool, &p, &o)
            })
            .collect::<ndscope::Result<_>>()?;
        let mut seen = Seen::default();
        let ids = s.named_scope("engine", |engine| {
            let mut core = EngineCore::new(&gpt2, &pool, engine, CoreConfig::default());
            let ids = core.submit_samples(&p, &options, 3)?;
            seen.take(core.step()?);
            let report = core.last_step().expect("ran");
            assert_eq!(report.prompt_tokens, 18, "the prompt runs once");
            // Four full blocks of the prompt, held by all three.
            assert_eq!(pool.stats().blocks_shared, 4);
            drain(&mut core, &mut seen);
            Ok::<_, Error>(ids)
        })?;
        for (i, id) in ids.iter().enumerate() {
            assert_eq!(seen.finished[id].tokens, alone[i].tokens, "sample {i}");
        }
        assert_ne!(alone[0].tokens, alone[1].tokens, "the seeds differ");
        assert_eq!(pool.stats().blocks_free, 64);
        Ok::<_, Error>(())
    })
    .unwrap();
}

/// What a request could fail on is refused at `submit`, and the refused request costs the others
/// nothing; a full queue refuses with `Overloaded`.
#[test]
fn bad_requests_are_refused_at_submit_and_others_go_on() {
    root(Device::Cpu, |s| {
        let gpt2 = Gpt2::from_pretrained(s, MODEL, DType::F32)?;
        let vocab = gpt2.vocab_size() as i64;
        let pool = KvPool::new(s, gpt2.kv_shape(), 4, 8)?;
        let alone = generate(&gpt2, s, &pool, &[5, 6, 7], &GenerateOptions::greedy(5))?;
        s.named_scope("engine", |engine| {
            // Two places in the batch, two more requests may wait.
            let config = CoreConfig {
                max_batch: 2,
                max_waiting: 2,
                ..CoreConfig::default()
            };
            let mut core = EngineCore::new(&gpt2, &pool, engine, config);
            let good = core.submit(&[5, 6, 7], &GenerateOptions::greedy(5))?;
            let err = |r: ndscope::Result<RequestId>| r.expect_err("refused");
            let greedy = GenerateOptions::greedy(4);
            assert!(matches!(
                err(core.submit(&[1, vocab], &greedy)),
                Error::IndexOutOfRange { index, .. } if index == vocab
            ));
            assert!(matches!(
                err(core.submit(&[-1], &greedy)),
                Error::IndexOutOfRange { .. }
            ));
            assert!(matches!(
                err(core.submit(&[], &greedy)),
                Error::InvalidShape { .. }
            ));
            let long = vec![1; gpt2.max_positions() + 1];
            assert!(matches!(
                err(core.submit(&long, &greedy)),
                Error::InvalidShape { .. }
            ));
            let hot = GenerateOptions::sampled(4, Sampling::with_temperature(-1.0), 1);
            assert!(matches!(
                err(core.submit(&[1], &hot)),
                Error::InvalidArgument { .. }
            ));
            assert!(matches!(
                err(core.submit(&[1], &GenerateOptions::greedy(10_000))),
                Error::KvCapacity { .. }
            ));
            assert!(core.submit_samples(&[1], &greedy, 0).is_err());
            for _ in 0..3 {
                core.submit(&[9], &greedy)?;
            }
            let refused = err(core.submit(&[9], &greedy));
            assert_eq!(
                refused,
                Error::Overloaded {
                    waiting: 2,
                    limit: 2
                }
            );
            assert!(refused.to_string().contains("retry"), "{refused}");
            let mut seen = Seen::default();
            drain(&mut core, &mut seen);
            assert!(seen.failed.is_empty());
            assert_eq!(seen.finished[&good].tokens, alone.tokens);
            Ok::<_, Error>(())
        })?;
        assert_eq!(pool.stats().blocks_free, 8);
        Ok::<_, Error>(())
    })
    .unwrap();
}

/// Cancelling gives a request's blocks back at once, whether it waits, is halfway through its
/// prompt, decodes, or is a sample waiting for its prompt's fork (whose sibling then goes on).
#[test]
fn cancel_gives_the_blocks_back_at_once_wherever_the_request_is() {
    root(Device::Cpu, |s| {
        let gpt2 = Gpt2::from_pretrained(s, MODEL, DType::F32)?;
        let pool = KvPool::new(s, gpt2.kv_shape(), 4, 64)?;
        s.named_scope("engine", |engine| {
            let config = CoreConfig {
                max_batch: 4,
                step_tokens: 8,
                max_waiting: 16,
            };
            let mut core = EngineCore::new(&gpt2, &pool, engine, config);
            let mut seen = Seen::default();
            let long = core.submit(&prompt(30, 1), &GenerateOptions::greedy(8))?;
            seen.take(core.step()?); // 8 of its 30 prompt tokens ran
            let held = pool.stats();
            assert!(held.blocks_used() > 0 && held.blocks_promised > 0);
            assert!(core.cancel(long));
            assert!(!core.cancel(long), "cancelled once");
            assert_eq!(
                (pool.stats().blocks_free, pool.stats().blocks_promised),
                (64, 0)
            );
            // Samples: the prompt's own sample cancelled mid-prompt, its sibling inherits it.
            let ids = core.submit_samples(&prompt(12, 2), &GenerateOptions::greedy(5), 2)?;
            seen.take(core.step()?);
            assert!(core.cancel(ids[0]));
            drain(&mut core, &mut seen);
            assert_eq!(seen.finished[&ids[1]].tokens.len(), 5);
            assert!(!seen.finished.contains_key(&ids[0]));
            assert_eq!(pool.stats().blocks_free, 64);
            // A request that waits.
            let a = core.submit(&prompt(4, 3), &GenerateOptions::greedy(3))?;
            assert!(core.cancel(a) && core.is_idle());
            assert!(!seen.tokens.contains_key(&long));
            Ok::<_, Error>(())
        })?;
        Ok::<_, Error>(())
    })
    .unwrap();
}

#[derive(Debug, Clone)]
enum Op {
    Submit { len: usize, new: usize, n: usize },
    Cancel(usize),
    Step,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (1usize..20, 0usize..8, 1usize..3).prop_map(|(len, new, n)| Op::Submit { len, new, n }),
        (0usize..16).prop_map(Op::Cancel),
        Just(Op::Step),
        Just(Op::Step),
    ]
}

/// Checks the pool against the requests alive in `core` after every operation: blocks held or
/// promised only while requests live, and every block back when none does.
fn run_ops(s: &Scope<'_>, ops: &[Op]) {
    let gpt2 = Gpt2::from_pretrained(s, MODEL, DType::F32).unwrap();
    let pool = KvPool::new(s, gpt2.kv_shape(), 4, 24).unwrap();
    s.named_scope("engine", |engine| {
        let config = CoreConfig {
            max_batch: 3,
            step_tokens: 5,
            max_waiting: 4,
        };
        let mut core = EngineCore::new(&gpt2, &pool, engine, config);
        let mut ids: Vec<RequestId> = Vec::new();
        let mut seen = Seen::default();
        for op in ops {
            match *op {
                Op::Submit { len, new, n } => {
                    let o = GenerateOptions::greedy(new);
                    if let Ok(new_ids) = core.submit_samples(&prompt(len, len as i64), &o, n) {
                        ids.extend(new_ids);
                    }
                }
                Op::Cancel(i) => {
                    if let Some(&id) = ids.get(i) {
                        let live = !seen.finished.contains_key(&id);
                        // Cancelling succeeds exactly for requests that have not ended.
                        let was = live && !seen.cancelled.contains(&id);
                        assert_eq!(core.cancel(id), was);
                        if was {
                            seen.cancelled.insert(id);
                        }
                    }
                }
                Op::Step => seen.take(core.step().unwrap()),
            }
            let stats = pool.stats();
            assert!(stats.blocks_used() + stats.blocks_promised <= stats.blocks);
            if core.is_idle() {
                assert_eq!((stats.blocks_free, stats.blocks_promised), (24, 0));
            }
            assert!(core.running() <= 3 && core.waiting() <= 4 * 2);
        }
        drain(&mut core, &mut seen);
        // Every request ended once: finished (with `max_new_tokens` or fewer tokens) or cancelled.
        for id in &ids {
            assert!(seen.failed.is_empty());
            assert!(seen.finished.contains_key(id) ^ seen.cancelled.contains(id));
        }
    });
    assert_eq!(pool.stats().blocks_free, 24);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    /// Interleaved submits, cancels and steps keep the pool's block count exact.
    #[test]
    fn any_sequence_of_submit_cancel_and_step_keeps_the_pool_exact(ops in prop::collection::vec(op(), 1..40)) {
        root(Device::Cpu, |s| {
            run_ops(s, &ops);
            Ok::<_, Error>(())
        })
        .unwrap();
    }
}
