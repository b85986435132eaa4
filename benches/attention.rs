//! Long-sequence attention and the row kernels on the CPU, at GPT-2 small's shapes: one layer's
//! causal attention `[1, 12, 1024, 64]` fused (`Tensor::attention`) and unfused (the composition
//! `nn::scaled_dot_product_attention` makes), forward and forward+backward; one query against a
//! 1,024-token cache (decoding); softmax over `[12, 1024, 1024]`; log-softmax and cross-entropy
//! (forward+backward) over GPT-2's vocabulary `[1023, 50257]`. `benches/attention_reference.py`
//! runs the same shapes in PyTorch. And a decoding step's attention over paged KV caches kept in
//! `f32`, `f16` and `bf16`: eight sequences of 160 cached tokens, GPT-2 small's 12 layers of 12
//! heads (the cache bytes a step reads, as throughput), from cache and, for `f32` and `f16`, from
//! memory (64 MiB written between steps, as a model's weights pass between its steps). Run with
//!
//! ```text
//! RAYON_NUM_THREADS=2 cargo bench --bench attention -- --noplot
//! ```

use std::hint::black_box;

mod common;

use criterion::{BatchSize, BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use ndscope::kv::{KvCache, KvPool, KvShape, KvStep};
use ndscope::nn::{AttentionOptions, Mode, scaled_dot_product_attention};
use ndscope::{AttentionSpec, Causal, DType, Device, Result, Tape, root};

fn attention(c: &mut Criterion) {
    common::warn_if_cpu_busy("attention bench");
    let mut group = c.benchmark_group("attention_1x12x1024x64_causal");
    group.sample_size(20);
    root(Device::Cpu, |s| -> Result<()> {
        let shape = [1, 12, 1024, 64];
        let (q, k, v) = (s.randn(&shape)?, s.randn(&shape)?, s.randn(&shape)?);
        for dtype in [DType::F32, DType::BF16] {
            let (q, k, v) = (q.to_dtype(dtype)?, k.to_dtype(dtype)?, v.to_dtype(dtype)?);
            group.bench_function(BenchmarkId::new("fused_forward", dtype), |bench| {
                bench.iter(|| {
                    s.scope(|_| {
                        q.attention(&k, &v, AttentionSpec::CAUSAL, None)
                            .map(black_box)
                            .map(drop)
                    })
                    .unwrap()
                })
            });
            group.bench_function(BenchmarkId::new("fused_forward_backward", dtype), |bench| {
                bench.iter(|| {
                    s.scope(|b| {
                        let tape = Tape::new(b);
                        let (qv, kv, vv) = (tape.param(&q), tape.param(&k), tape.param(&v));
                        let out = qv.attention(&kv, &vv, AttentionSpec::CAUSAL, None)?;
                        tape.backward(&out.sum_all()?).map(|g| black_box(g.len()))
                    })
                    .unwrap()
                })
            });
        }
        let options = AttentionOptions {
            causal: true,
            dropout: 0.0,
        };
        group.bench_function(BenchmarkId::new("unfused_forward", DType::F32), |bench| {
            bench.iter(|| {
                s.scope(|b| {
                    let tape = Tape::no_grad(b);
                    let (qv, kv, vv) = (tape.constant(&q), tape.constant(&k), tape.constant(&v));
                    scaled_dot_product_attention(&qv, &kv, &vv, options, Mode::Eval)
                        .map(|a| black_box(a.output.shape()[0]))
                })
                .unwrap()
            })
        });
        group.bench_function(
            BenchmarkId::new("unfused_forward_backward", DType::F32),
            |bench| {
                bench.iter(|| {
                    s.scope(|b| {
                        let tape = Tape::new(b);
                        let (qv, kv, vv) = (tape.param(&q), tape.param(&k), tape.param(&v));
                        let a = scaled_dot_product_attention(&qv, &kv, &vv, options, Mode::Train)?;
                        tape.backward(&a.output.sum_all()?)
                            .map(|g| black_box(g.len()))
                    })
                    .unwrap()
                })
            },
        );
        // Decoding: one new query against 1,024 cached keys.
        let one = s.randn(&[1, 12, 1, 64])?;
        let decode = AttentionSpec {
            causal: Causal::BottomRight,
            scale: None,
            window: None,
        };
        group.bench_function("decode_1_query_1024_keys", |bench| {
            bench.iter(|| {
                s.scope(|_| one.attention(&k, &v, decode, None).map(black_box).map(drop))
                    .unwrap()
            })
        });
        Ok(())
    })
    .unwrap();
    group.finish();

    let mut group = c.benchmark_group("rows");
    group.sample_size(20);
    root(Device::Cpu, |s| -> Result<()> {
        let scores = s.randn(&[12, 1024, 1024])?;
        group.bench_function("softmax_12x1024x1024", |bench| {
            bench.iter(|| {
                s.scope(|_| scores.softmax(-1).map(black_box).map(drop))
                    .unwrap()
            })
        });
        let logits = s.randn(&[1023, 50257])?;
        let labels: Vec<i64> = (0..1023).map(|i| (i * 7919) % 50257).collect();
        let labels = s.from_slice(&labels, &[1023])?;
        group.bench_function("log_softmax_1023x50257", |bench| {
            bench.iter(|| {
                s.scope(|_| logits.log_softmax(-1).map(black_box).map(drop))
                    .unwrap()
            })
        });
        group.bench_function("cross_entropy_forward_backward_1023x50257", |bench| {
            bench.iter(|| {
                s.scope(|b| {
                    let tape = Tape::new(b);
                    let x = tape.param(&logits);
                    let loss = x.cross_entropy(&labels)?;
                    tape.backward(&loss).map(|g| black_box(g.len()))
                })
                .unwrap()
            })
        });
        Ok(())
    })
    .unwrap();
    group.finish();
}

/// One decoding step's attention, every layer, for eight sequences of 160 cached tokens each, with
/// the caches in each float dtype (the queries, keys and values computed in `f32`).
fn paged_decode(c: &mut Criterion) {
    const SEQUENCES: usize = 8;
    const CACHED: usize = 160;
    let mut group = c.benchmark_group("paged_decode_8x160_gpt2_small");
    group.sample_size(20);
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let shape = KvShape {
            layers: 12,
            heads: 12,
            head_width: 64,
            dtype,
        };
        root(Device::Cpu, |m| -> Result<()> {
            let pool = KvPool::for_tokens(m, shape, 16, SEQUENCES * (CACHED + 16))?;
            m.scope(|r| -> Result<()> {
                let mut caches: Vec<KvCache<'_>> = (0..SEQUENCES)
                    .map(|_| pool.cache(r, CACHED + 1))
                    .collect::<Result<_>>()?;
                r.scope(|fill| -> Result<()> {
                    let mut step =
                        KvStep::new(&pool, caches.iter_mut().collect(), &[CACHED; SEQUENCES])?;
                    let qkv = fill.randn(&[SEQUENCES * CACHED, 3, 12, 64])?;
                    for layer in 0..12 {
                        step.attend(layer, &qkv, 0.125)?;
                    }
                    step.finish();
                    Ok(())
                })?;
                let qkv = r.randn(&[SEQUENCES, 3, 12, 64])?;
                // Every layer reads the keys and values of each cached token and the new one.
                let read = SEQUENCES * (CACHED + 1) * shape.token_bytes();
                group.throughput(Throughput::Bytes(read as u64));
                let mut step = || {
                    r.scope(|_| -> Result<()> {
                        // The step is dropped unfinished: the caches keep their 160 tokens.
                        let mut step =
                            KvStep::new(&pool, caches.iter_mut().collect(), &[1; SEQUENCES])?;
                        for layer in 0..12 {
                            black_box(step.attend(layer, &qkv, 0.125)?);
                        }
                        Ok(())
                    })
                    .unwrap()
                };
                group.bench_function(BenchmarkId::from_parameter(dtype), |bench| {
                    bench.iter(&mut step)
                });
                // The caches (6-12 MB) stay in L3 from one step to the next above; in a model's
                // step the weights pass between, and the pages come from memory.
                if dtype != DType::BF16 {
                    let mut other = vec![0u64; EVICT_BYTES / 8];
                    group.bench_function(BenchmarkId::new("from_memory", dtype), |bench| {
                        bench.iter_batched(
                            || evict(&mut other),
                            |()| step(),
                            BatchSize::PerIteration,
                        )
                    });
                }
                Ok(())
            })
        })
        .unwrap();
    }
    group.finish();
}

/// Bytes written between samples of `from_memory`: twice the 32 MiB L3 of the machines measured.
const EVICT_BYTES: usize = 64 << 20;

/// Writes `other` through, so that what was in cache before is not.
fn evict(other: &mut [u64]) {
    for (i, x) in other.iter_mut().enumerate() {
        *x = x.wrapping_add(i as u64);
    }
    black_box(&other[..]);
}

criterion_group!(benches, attention, paged_decode);
criterion_main!(benches);
