//! Generation on the CPU: the bundled tiny GPT-2 generating 100 greedy tokens (one request, and eight
//! through the continuous-batching engine), GPT-2 small's shape decoding one token against a cache of
//! 128 (batch 1 and 8), and the machine's read bandwidth, which bounds batch-1 decoding (every token
//! reads every weight once). `benches/generate_reference.py` measures transformers' `generate` on the
//! same models. Run with
//!
//! ```text
//! RAYON_NUM_THREADS=2 cargo bench --bench generate -- --noplot
//! ```

mod common;

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use ndscope::kv::{CausalLm, KvPool};
use ndscope::models::Gpt2;
use ndscope::serve::{Engine, EngineConfig, GenerateOptions, Request, generate};
use ndscope::{DType, Device, Result, root};

const TINY: &str = "data/gpt2-tiny";

/// The prompt of `benches/generate_reference.py`: 16 token ids.
fn prompt(len: usize, vocab: i64) -> Vec<i64> {
    (0..len as i64).map(|i| (i * 7919 + 13) % vocab).collect()
}

/// Sums 256 MiB of f32 with `threads` threads, each its own half: the bytes a decode step streams.
fn read_bandwidth(c: &mut Criterion) {
    common::warn_if_cpu_busy("generate bench");
    let data = vec![1.0f32; 64 << 20];
    let threads = std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2usize);
    let mut group = c.benchmark_group("read_bandwidth");
    group.sample_size(20);
    group.bench_function("sum_256MiB", |b| {
        b.iter(|| black_box(common::streamed_sum(&data, threads)))
    });
    group.finish();
}

fn tiny(c: &mut Criterion) {
    let mut group = c.benchmark_group("generate_tiny");
    group.sample_size(20);
    root(Device::Cpu, |m| -> Result<()> {
        let gpt2 = Gpt2::from_pretrained(m, TINY, DType::F32)?;
        let pool = KvPool::for_tokens(m, gpt2.kv_shape(), 16, 8 * 128)?;
        let p = prompt(16, 1000);
        group.bench_function("greedy_100_tokens", |b| {
            b.iter(|| generate(&gpt2, m, &pool, &p, &GenerateOptions::greedy(100)).unwrap())
        });
        group.bench_function("greedy_100_tokens_8_requests_batched", |b| {
            b.iter(|| {
                let mut engine = Engine::new(&gpt2, &pool, EngineConfig { max_batch: 8 });
                for i in 0..8 {
                    let mut p = p.clone();
                    p[0] = i;
                    engine
                        .submit(Request {
                            prompt: p,
                            options: GenerateOptions::greedy(100),
                            arrival: 0,
                        })
                        .unwrap();
                }
                engine.run(m, |_| {}).unwrap()
            })
        });
        Ok(())
    })
    .unwrap();
    group.finish();
}

fn small(c: &mut Criterion) {
    common::ensure_gpt2_small().unwrap();
    let mut group = c.benchmark_group("decode_gpt2_small");
    group.sample_size(20);
    group.measurement_time(Duration::from_secs(10));
    root(Device::Cpu, |m| -> Result<()> {
        let gpt2 = Gpt2::from_pretrained(m, common::GPT2_SMALL, DType::F32)?;
        let pool = KvPool::for_tokens(m, gpt2.kv_shape(), 16, 16 * 256)?;
        let p = prompt(128, 50257);
        m.scope(|session| -> Result<()> {
            // The prompt's 128 tokens, cached once; each sample decodes one token on a fork of it
            // (128 is a whole number of blocks, so forking copies nothing).
            let mut cache = pool.cache(session, 128)?;
            session.scope(|s| gpt2.decode(s, &pool, &mut [&mut cache], &[&p]).map(drop))?;
            for batch in [1usize, 8] {
                group.bench_function(format!("batch_{batch}_at_128_tokens"), |b| {
                    b.iter(|| {
                        session
                            .scope(|request| -> Result<f32> {
                                let mut forks = (0..batch)
                                    .map(|_| cache.fork(request, &pool, 129))
                                    .collect::<Result<Vec<_>>>()?;
                                let mut caches: Vec<_> = forks.iter_mut().collect();
                                let tokens: Vec<[i64; 1]> =
                                    (0..batch as i64).map(|i| [i]).collect();
                                let tokens: Vec<&[i64]> = tokens.iter().map(|t| &t[..]).collect();
                                request.scope(|s| {
                                    let logits = gpt2.decode(s, &pool, &mut caches, &tokens)?;
                                    logits.narrow(1, 0, 1)?.sum_all()?.to_scalar::<f32>()
                                })
                            })
                            .unwrap()
                    })
                });
            }
            Ok(())
        })
    })
    .unwrap();
    group.finish();
}

criterion_group!(benches, read_bandwidth, tiny, small);
criterion_main!(benches);
