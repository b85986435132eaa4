//! A soak of the serving paths: 2,000 requests of random prompt and output lengths through the
//! continuous-batching engine, and 2,000 through 4 threads sharing one model and one pool. After each
//! request its blocks are back in the pool; the model's and the pool's memory stay constant; no
//! tensor storage comes from the system after warm-up; a request that errors or panics halfway gives
//! its blocks back. `NDSCOPE_SOAK_REQUESTS` sets the count (CI's valgrind run uses 16).
//!
//! One test per binary: the allocator's counters are process-wide.

use std::sync::Barrier;
use std::sync::atomic::Ordering;

use ndscope::kv::{CausalLm, KvPool, KvStep};
use ndscope::models::Gpt2;
use ndscope::serve::{Engine, EngineConfig, GenerateOptions, Request, Sampling, generate};
use ndscope::{DType, Device, Error, MoveOut, root};

mod common;
use common::Lcg;
use common::counting::{Counting, STORAGE};
use common::reference::DIR;

#[global_allocator]
static GLOBAL: Counting = Counting;
const THREADS: usize = 4;

fn requests() -> usize {
    std::env::var("NDSCOPE_SOAK_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2_000)
}

/// Below this many requests (CI's valgrind run) the warm-up sweep and the system-allocation check
/// are skipped: the sweep is most of the work, and memcheck is there for the memory errors.
const COUNTED: usize = 200;

/// `n` requests: prompts of 1 to 24 tokens, 1 to 16 new tokens, sampled or greedy.
fn workload(n: usize, seed: u64) -> Vec<Request> {
    let mut rng = Lcg(seed);
    (0..n)
        .map(|i| {
            let prompt: Vec<i64> = (0..1 + rng.below(24))
                .map(|_| rng.below(1000) as i64)
                .collect();
            let new = 1 + rng.below(16);
            let options = if i % 2 == 0 {
                GenerateOptions::greedy(new)
            } else {
                GenerateOptions::sampled(
                    new,
                    Sampling {
                        top_k: 40,
                        top_p: 0.9,
                        temperature: 0.9,
                    },
                    i as u64,
                )
            };
            Request {
                prompt,
                options,
                arrival: rng.below(4),
            }
        })
        .collect()
}

fn engine_soak(n: usize) {
    root(Device::Cpu, |root_scope| {
        root_scope.named_scope("model", |m| {
            let gpt2 = Gpt2::from_pretrained(m, DIR, DType::F32)?;
            // Room for 8 requests of the longest length (40 tokens = 3 blocks of 16) and no more.
            let pool = KvPool::new(m, gpt2.kv_shape(), 16, 24)?;
            let model_bytes = m.stats().live_bytes;
            let counted = n >= COUNTED;
            // Warm-up, as a server profiles itself before taking traffic: one step of every batch
            // size and row count the workload can make (a step's temporaries depend on those two
            // only), so the tree's cache holds a block of every size a step asks for.
            for batch in (1..=8usize).filter(|_| counted) {
                for rows in batch..=24 * batch {
                    let mut engine = Engine::new(&gpt2, &pool, EngineConfig { max_batch: 8 });
                    for i in 0..batch {
                        let len = rows / batch + usize::from(i < rows % batch);
                        engine.submit(Request {
                            prompt: vec![7; len],
                            options: GenerateOptions::greedy(1),
                            arrival: 0,
                        })?;
                    }
                    engine.run(m, |_| {})?;
                }
            }
            let warm = STORAGE.load(Ordering::Relaxed);
            let chunks = n.div_ceil(100);
            for chunk in 0..chunks {
                let count = 100.min(n - chunk * 100);
                let mut engine = Engine::new(&gpt2, &pool, EngineConfig { max_batch: 8 });
                for r in workload(count, chunk as u64) {
                    engine.submit(r)?;
                }
                let mut most_used = 0;
                let done = engine.run(m, |step| {
                    most_used = most_used.max(step.pool.blocks_used());
                    assert!(step.batch <= 8);
                })?;
                assert_eq!(done.len(), count);
                assert!(most_used > 0 && most_used <= 24);
                let stats = pool.stats();
                assert_eq!(
                    (
                        stats.blocks_free,
                        stats.blocks_promised,
                        stats.tokens_cached
                    ),
                    (24, 0, 0)
                );
                assert_eq!(m.stats().live_bytes, model_bytes, "the model scope grew");
                if counted {
                    assert_eq!(
                        STORAGE.load(Ordering::Relaxed),
                        warm,
                        "storage came from the system after warm-up (chunk {chunk})"
                    );
                }
            }
            Ok::<_, Error>(())
        })
    })
    .unwrap();
}

fn thread_soak(n: usize) {
    let gpt2 = root(Device::Cpu, |m| {
        Gpt2::from_pretrained(m, DIR, DType::F32)?.move_out()
    })
    .unwrap();
    let pool = KvPool::detached(Device::Cpu, gpt2.kv_shape(), 16, 4 * 3).unwrap();
    let warmed = Barrier::new(THREADS + 1);
    let measured = Barrier::new(THREADS + 1);
    let per_thread = n.div_ceil(THREADS);
    let warm = std::thread::scope(|threads| {
        for t in 0..THREADS {
            let (gpt2, pool, warmed, measured) = (&gpt2, &pool, &warmed, &measured);
            threads.spawn(move || {
                root(Device::Cpu, |s| {
                    // Warm-up: every prompt length once (a single request's steps depend on it only).
                    for len in (1..=24).filter(|_| n >= COUNTED) {
                        generate(gpt2, s, pool, &vec![7; len], &GenerateOptions::greedy(2))?;
                    }
                    warmed.wait();
                    measured.wait();
                    for (i, r) in workload(per_thread, 100 + t as u64).into_iter().enumerate() {
                        let out = generate(gpt2, s, pool, &r.prompt, &r.options)?;
                        assert!(
                            !out.tokens.is_empty() && out.tokens.len() <= r.options.max_new_tokens
                        );
                        // The pool holds 3 blocks per thread: every finished request gave its back.
                        assert!(pool.stats().blocks_used() <= 3 * (THREADS - 1) + 3);
                        if i % 50 == 2 {
                            // An error halfway (a token outside the vocabulary, after the prompt ran).
                            let err = s.scope(|request| {
                                let mut cache = pool.cache(request, 40)?;
                                request.scope(|step| {
                                    gpt2.decode(step, pool, &mut [&mut cache], &[&r.prompt])
                                        .map(drop)
                                })?;
                                request.scope(|step| {
                                    gpt2.decode(step, pool, &mut [&mut cache], &[&[5000]])
                                        .map(drop)
                                })
                            });
                            assert!(matches!(err, Err(Error::IndexOutOfRange { .. })));
                            // A panic halfway.
                            let caught =
                                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                                    s.scope(|request| {
                                        let mut cache = pool.cache(request, 40).unwrap();
                                        KvStep::new(pool, vec![&mut cache], &[20])
                                            .unwrap()
                                            .finish();
                                        panic!("a request fails");
                                    })
                                }));
                            assert!(caught.is_err());
                        }
                    }
                    Ok::<_, Error>(())
                })
                .unwrap();
            });
        }
        warmed.wait();
        let warm = STORAGE.load(Ordering::Relaxed);
        measured.wait();
        warm // the threads are joined when the scope ends
    });
    let stats = pool.stats();
    assert_eq!(
        (
            stats.blocks_free,
            stats.blocks_promised,
            stats.tokens_cached
        ),
        (12, 0, 0)
    );
    // Each thread's tree served its requests from its cache after warm-up; the panicking and failing
    // requests allocate nothing new either.
    if n >= COUNTED {
        assert_eq!(
            STORAGE.load(Ordering::Relaxed),
            warm,
            "storage came from the system after warm-up"
        );
    }
}

#[test]
fn thousands_of_requests_leave_memory_flat() {
    let n = requests();
    engine_soak(n);
    thread_soak(n);
}
