//! GPU benchmarks (`--features cuda`, on a machine with an NVIDIA GPU): the MLP training step of the
//! digits/MNIST size (eager, and through a `StepGraph` eager and captured), a wide MLP's step in f32,
//! TF32, bf16 and f16 autocast, large matrix products (f32, TF32, bf16, f16), with the numbers
//! PyTorch's `benches/pytorch_reference.py` prints for the same work on the same GPU, and the
//! quantized products of a Llama-3.2-1B-shaped layer's matrices for one and eight rows (bytes of
//! weight read per second, beside the same product with the weight in `f32` and `bf16`), one
//! layer's causal attention at GPT-2 small's shape `[1, 12, 1024, 64]` and a Llama-3-8B layer's
//! (32 query heads over 8 key and value heads, 128 wide; fused, forward and forward+backward, `f32`
//! and `bf16`), and GPT-2 small's forward and forward+backward passes at
//! 1,024 tokens (`f32` and bf16 autocast; random weights). `benches/pytorch_reference.py attention`
//! and `... gpt2` measure the same work in PyTorch on the same GPU.
//!
//! `cargo bench --features cuda --bench cuda`. Besides criterion's timings it prints the step's GPU
//! allocator calls (after warm-up), the tree's peak bytes and the driver-level peak of reserved GPU
//! memory. Without a usable GPU it says why and measures nothing.

mod common;

use std::time::Instant;

use criterion::{BenchmarkId, Criterion, Throughput};
use ndscope::nn::{self, Activation, Init, Mode, Module};
use ndscope::optim::{Adam, AdamConfig, LossScaler, Optimizer, Sgd, SgdConfig};
use ndscope::{
    DType, Device, Error, Input, Result, StepGraph, Tape, Workspace, gpu_memory,
    reset_gpu_memory_peak, root,
};

const GPU: Device = Device::Cuda(0);

/// The MLP step: 784-256-10, batch 128, AdamW, batch tensors in a workspace on the GPU.
fn mlp_step(c: &mut Criterion) -> Result<()> {
    root(GPU, |m| {
        m.set_seed(1);
        let mut model = nn::mlp(m, &[784, 256, 10], Activation::Relu, Init::KaimingUniform)?;
        let mut opt = Adam::new(m, &model, AdamConfig::adamw(1e-3, 1e-2))?;
        let x = m.randn(&[128, 784])?;
        let labels: Vec<i64> = (0..128).map(|i| i % 10).collect();
        let y = m.from_slice(&labels, &[128])?;
        let mut ws = Workspace::new("batch");
        let mut step = || {
            m.workspace(&mut ws, |b| {
                common::train_step(b, &mut model, &mut opt, &x, &y)
            })
        };
        for _ in 0..20 {
            step()?;
        }
        GPU.synchronize()?;
        reset_gpu_memory_peak(GPU)?;
        m.reset_peak();
        let (calls, allocs) = (
            gpu_memory(GPU)?.allocator_calls,
            m.stats().device_allocations,
        );
        let steps = 1000;
        let start = Instant::now();
        for _ in 0..steps {
            step()?;
        }
        GPU.synchronize()?;
        let elapsed = start.elapsed();
        let mem = gpu_memory(GPU)?;
        println!(
            "mlp_step 784-256-10 b128 AdamW on {GPU}: {:.0} steps/s over {steps} steps; GPU allocator \
             calls per step {:.3} (driver) / {:.3} (tree); tree peak {} B; reserved peak {} B",
            steps as f64 / elapsed.as_secs_f64(),
            (mem.allocator_calls - calls) as f64 / steps as f64,
            (m.stats().device_allocations - allocs) as f64 / steps as f64,
            m.stats().peak_bytes,
            mem.peak_reserved_bytes,
        );
        let mut group = c.benchmark_group("cuda");
        group.bench_function("mlp_step_784_256_10_b128_adamw", |bench| {
            bench.iter(|| step().expect("a step runs"))
        });
        group.finish();
        Ok::<_, Error>(())
    })
}

/// The MLP step through a [`StepGraph`], new host inputs every step and the loss read back every
/// step, eager and captured as a CUDA graph, with AdamW and with SGD momentum.
fn graph_step(c: &mut Criterion) -> Result<()> {
    let batches: Vec<(Vec<f32>, Vec<i64>)> = (0..4)
        .map(|i| {
            let x = (0..128 * 784)
                .map(|k| ((k * 31 + i * 17) % 101) as f32 / 50.0 - 1.0)
                .collect();
            let y = (0..128).map(|r| ((r * 7 + i) % 10) as i64).collect();
            (x, y)
        })
        .collect();
    let mut group = c.benchmark_group("cuda");
    for (adam, capture) in [(true, false), (true, true), (false, false), (false, true)] {
        root(GPU, |m| {
            m.set_seed(1);
            let mut model = nn::mlp(m, &[784, 256, 10], Activation::Relu, Init::KaimingUniform)?;
            let mut adamw = Adam::new(m, &model, AdamConfig::adamw(1e-3, 1e-2))?;
            let mut sgd = Sgd::new(m, &model, SgdConfig::new(0.05).momentum(0.9))?;
            let mut step = StepGraph::new("batch", |b, inputs| {
                let tape = Tape::new(b);
                let loss = model
                    .forward(&tape.constant(&inputs[0]), Mode::Train)?
                    .cross_entropy(&inputs[1])?;
                let grads = tape.backward(&loss)?;
                if adam {
                    adamw.step(&mut model, &grads)?;
                } else {
                    sgd.step(&mut model, &grads)?;
                }
                Ok(loss.value().clone())
            });
            if !capture {
                step = step.without_capture();
            }
            let mut i = 0;
            let mut run = || {
                let (x, y) = &batches[i % batches.len()];
                i += 1;
                step.run(m, &[Input::new(x, &[128, 784]), Input::new(y, &[128])])
            };
            for _ in 0..20 {
                run()?;
            }
            let steps = 2000;
            let start = Instant::now();
            for _ in 0..steps {
                run()?;
            }
            let label = if capture { "CUDA graph" } else { "eager" };
            let optimizer = if adam { "AdamW" } else { "SGD momentum" };
            println!(
                "graph_step 784-256-10 b128 {optimizer} {label} on {GPU}: {:.0} steps/s over {steps} \
                 steps (host inputs copied in, loss read every step)",
                steps as f64 / start.elapsed().as_secs_f64(),
            );
            let name = format!(
                "graph_step_784_256_10_b128_{}_{}",
                if adam { "adamw" } else { "sgd" },
                if capture { "captured" } else { "eager" }
            );
            group.bench_function(name, |bench| bench.iter(|| run().expect("a step runs")));
            Ok::<_, Error>(())
        })?;
    }
    group.finish();
    Ok(())
}

/// How the wide MLP's step computes.
#[derive(Clone, Copy)]
enum Precision {
    F32,
    Tf32,
    Autocast(DType),
}

impl Precision {
    fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Tf32 => "tf32",
            Precision::Autocast(DType::BF16) => "bf16 autocast",
            Precision::Autocast(_) => "f16 autocast + loss scaling",
        }
    }
}

/// The wide MLP's step: 4096-4096-4096-10, batch 1024, AdamW, in each precision; steps/s over 200
/// steps with the loss read every step, and the workspace's arena.
fn wide_mlp_step() -> Result<()> {
    for precision in [
        Precision::F32,
        Precision::Tf32,
        Precision::Autocast(DType::BF16),
        Precision::Autocast(DType::F16),
    ] {
        root(GPU, |m| {
            m.set_seed(1);
            m.allow_tf32(matches!(precision, Precision::Tf32));
            let sizes = [4096, 4096, 4096, 10];
            let mut model = nn::mlp(m, &sizes, Activation::Relu, Init::KaimingUniform)?;
            let mut opt = Adam::new(m, &model, AdamConfig::adamw(1e-4, 1e-2))?;
            let mut scaler = LossScaler::new();
            let dtype = match precision {
                Precision::Autocast(d) => d,
                _ => DType::F32,
            };
            // The batch arrives in the dtype the step computes in, as a loader would deliver it.
            let x = m.randn(&[1024, 4096])?.to_dtype(dtype)?;
            let labels: Vec<i64> = (0..1024).map(|i| i % 10).collect();
            let y = m.from_slice(&labels, &[1024])?;
            let mut ws = Workspace::planned("batch");
            let mut step = || {
                m.workspace(&mut ws, |b| {
                    let tape = Tape::new(b);
                    if let Precision::Autocast(d) = precision {
                        b.autocast(d)?;
                    }
                    let loss = model
                        .forward(&tape.constant(&x), Mode::Train)?
                        .cross_entropy(&y)?;
                    if dtype == DType::F16 {
                        let mut grads = tape.backward(&scaler.scale_loss(&loss)?)?;
                        scaler.step(&mut opt, &mut model, &mut grads)?;
                    } else {
                        opt.step(&mut model, &tape.backward(&loss)?)?;
                    }
                    loss.value().to_scalar::<f32>()
                })
            };
            for _ in 0..10 {
                step()?;
            }
            GPU.synchronize()?;
            let steps = 200;
            let start = Instant::now();
            let mut last = 0.0;
            for _ in 0..steps {
                last = step()?;
            }
            GPU.synchronize()?;
            let elapsed = start.elapsed();
            let flops = 6.0 * 1024.0 * (4096.0 * 4096.0 * 2.0 + 4096.0 * 10.0);
            println!(
                "wide_mlp_step 4096-4096-4096-10 b1024 AdamW {} on {GPU}: {:.0} steps/s over {steps} \
                 steps ({:.0} TFLOP/s in products); workspace arena {} B; last loss {last:.4}",
                precision.name(),
                steps as f64 / elapsed.as_secs_f64(),
                flops * steps as f64 / elapsed.as_secs_f64() / 1e12,
                ws.capacity(),
            );
            Ok::<_, Error>(())
        })?;
    }
    Ok(())
}

/// Square products through cuBLAS: f32, f32 read as TF32, bf16 and f16 (f32 accumulation).
fn matmul(c: &mut Criterion) -> Result<()> {
    root(GPU, |s| {
        let mut group = c.benchmark_group("cuda_matmul");
        for (name, dtype, tf32) in [
            ("f32", DType::F32, false),
            ("tf32", DType::F32, true),
            ("bf16", DType::BF16, false),
            ("f16", DType::F16, false),
        ] {
            s.allow_tf32(tf32);
            for n in [1024usize, 4096] {
                let a = s.randn(&[n, n])?.to_dtype(dtype)?;
                let b = s.randn(&[n, n])?.to_dtype(dtype)?;
                group.throughput(Throughput::Elements((2 * n * n * n) as u64));
                group.bench_with_input(BenchmarkId::new(name, n), &n, |bench, _| {
                    bench.iter(|| {
                        // The product's block goes back to the pool when it drops, for the next one.
                        drop(a.matmul(&b).expect("matmul runs"));
                        GPU.synchronize().expect("the GPU finishes");
                    })
                });
            }
        }
        group.finish();
        Ok::<_, Error>(())
    })
}

/// Stored blocks of `ty` for an `n × k` matrix: random levels, and every block's `f16` scale and
/// minimum fields set to a small finite value (random bits could be infinities or NaN).
fn blocks_of(ty: ndscope::quant::QuantType, n: usize, k: usize) -> Vec<u8> {
    use ndscope::quant::QuantType as Q;
    let fields: &[usize] = match ty {
        Q::Q4_K => &[0, 2],
        Q::Q6_K => &[208],
        _ => &[0],
    };
    let len = ty.bytes_for(n * k).expect("whole blocks");
    let mut bytes: Vec<u8> = (0..len as u64)
        .map(|i| (i.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 56) as u8)
        .collect();
    for block in bytes.chunks_exact_mut(ty.block_bytes()) {
        for &at in fields {
            block[at..at + 2].copy_from_slice(&half_bits(0.004).to_le_bytes());
        }
    }
    bytes
}

/// The `f16` bits of a value `f16` holds exactly (a power of two times a short significand).
fn half_bits(v: f32) -> u16 {
    let bits = v.to_bits();
    let exponent = ((bits >> 23) & 0xff) as i32 - 127 + 15;
    ((exponent as u16) << 10) | ((bits >> 13) & 0x3ff) as u16
}

/// `x Wᵀ` for a Llama-3.2-1B layer's matrix shapes (q/o, gate/up, down) and 1, 8 or 128 rows of
/// `x`: the weight in Q8_0, Q4_0, Q4_K, Q6_K blocks (`matmul_quantized_t`), and in `f32` and
/// `bf16` through cuBLAS. Throughput is the weight's bytes, so criterion's rate is the bandwidth
/// the product reads its weight at.
fn quant_product(c: &mut Criterion) -> Result<()> {
    use ndscope::QuantTensor;
    use ndscope::quant::QuantType as Q;
    root(GPU, |s| {
        let mut group = c.benchmark_group("cuda_quant_product");
        for (n, k) in [(2048usize, 2048usize), (8192, 2048), (2048, 8192)] {
            for m in [1usize, 8, 128] {
                let x = s.randn(&[m, k])?;
                for ty in [Q::Q8_0, Q::Q4_0, Q::Q4_K, Q::Q6_K] {
                    let w = QuantTensor::from_blocks(s, &blocks_of(ty, n, k), ty, &[n, k])?;
                    group.throughput(Throughput::Bytes(w.nbytes() as u64));
                    let id = BenchmarkId::new(ty.name(), format!("{n}x{k}/m{m}"));
                    group.bench_function(id, |bench| {
                        bench.iter(|| {
                            drop(x.matmul_quantized_t(&w).expect("the product runs"));
                            GPU.synchronize().expect("the GPU finishes");
                        })
                    });
                }
                for dtype in [DType::F32, DType::BF16] {
                    let w = s.randn(&[n, k])?.to_dtype(dtype)?;
                    let xd = x.to_dtype(dtype)?;
                    group.throughput(Throughput::Bytes((n * k * dtype.size()) as u64));
                    let id = BenchmarkId::new(dtype.to_string(), format!("{n}x{k}/m{m}"));
                    group.bench_function(id, |bench| {
                        bench.iter(|| {
                            drop(
                                xd.matmul(&w.t().expect("a view"))
                                    .expect("the product runs"),
                            );
                            GPU.synchronize().expect("the GPU finishes");
                        })
                    });
                }
            }
        }
        group.finish();
        Ok::<_, Error>(())
    })
}

/// One layer's causal attention, fused (`Tensor::attention`): the forward pass, and the forward and
/// backward passes of `sum(attention(q, k, v))`, in `f32` and `bf16`, at GPT-2 small's shape
/// (`[1, 12, 1024, 64]`, the 64-wide tiles) and at a Llama-3-8B layer's (32 query heads over 8 key
/// and value heads, 128 wide: grouped-query attention on the 128-wide tiles).
fn attention(c: &mut Criterion) -> Result<()> {
    use ndscope::AttentionSpec;
    root(GPU, |s| {
        for (name, heads, kv_heads, width) in [
            ("cuda_attention_1x12x1024x64_causal", 12, 12, 64),
            ("cuda_attention_1x32x1024x128_gqa8_causal", 32, 8, 128),
        ] {
            let mut group = c.benchmark_group(name);
            let q = s.randn(&[1, heads, 1024, width])?;
            let (k, v) = (
                s.randn(&[1, kv_heads, 1024, width])?,
                s.randn(&[1, kv_heads, 1024, width])?,
            );
            for dtype in [DType::F32, DType::BF16] {
                let (q, k, v) = (q.to_dtype(dtype)?, k.to_dtype(dtype)?, v.to_dtype(dtype)?);
                group.bench_function(BenchmarkId::new("fused_forward", dtype), |bench| {
                    bench.iter(|| {
                        drop(
                            q.attention(&k, &v, AttentionSpec::CAUSAL, None)
                                .expect("attention runs"),
                        );
                        GPU.synchronize().expect("the GPU finishes");
                    })
                });
                let id = BenchmarkId::new("fused_forward_backward", dtype);
                group.bench_function(id, |bench| {
                    bench.iter(|| {
                        s.scope(|b| -> Result<()> {
                            let tape = Tape::new(b);
                            let (qv, kv, vv) = (tape.param(&q), tape.param(&k), tape.param(&v));
                            let out = qv.attention(&kv, &vv, AttentionSpec::CAUSAL, None)?;
                            drop(tape.backward(&out.sum_all()?)?);
                            GPU.synchronize()
                        })
                        .expect("a pass runs")
                    })
                });
            }
            group.finish();
        }
        Ok::<_, Error>(())
    })
}

/// GPT-2 small (random weights, Hugging Face's shape) at 1,024 tokens, batch 1: the forward pass to
/// the last position's logits, and forward+backward of the language-model loss, in `f32` and with
/// bf16 autocast (products and attention in bf16, norms and the loss in `f32`).
fn gpt2(c: &mut Criterion) -> Result<()> {
    use ndscope::models::{Gpt2, Gpt2Config};
    root(GPU, |m| {
        m.set_seed(7);
        let model = Gpt2::new(m, Gpt2Config::new(50257, 1024, 768, 12, 12))?;
        let mut group = c.benchmark_group("cuda_gpt2_small");
        let len = 1024;
        let ids: Vec<i64> = (0..len as i64).map(|i| (i * 7919) % 50257).collect();
        for (suffix, autocast) in [("", None), ("_bf16_autocast", Some(DType::BF16))] {
            group.bench_function(BenchmarkId::new(format!("forward{suffix}"), len), |bench| {
                bench.iter(|| {
                    common::gpt2_pass(m, &model, &ids, autocast, false).expect("a pass runs")
                })
            });
            let name = format!("forward_backward{suffix}");
            group.bench_function(BenchmarkId::new(name, len), |bench| {
                bench.iter(|| {
                    common::gpt2_pass(m, &model, &ids, autocast, true).expect("a pass runs")
                })
            });
        }
        group.finish();
        Ok::<_, Error>(())
    })
}

fn main() {
    if let Err(e) = GPU.check_available() {
        eprintln!("benches/cuda: nothing measured: {e}");
        return;
    }
    let mut c = Criterion::default().configure_from_args();
    if let Err(e) = wide_mlp_step() {
        eprintln!("benches/cuda: wide_mlp_step failed: {e}");
        std::process::exit(1);
    }
    for (name, run) in [
        ("mlp_step", mlp_step as fn(&mut Criterion) -> Result<()>),
        ("graph_step", graph_step),
        ("matmul", matmul),
        ("quant_product", quant_product),
        ("attention", attention),
        ("gpt2", gpt2),
    ] {
        if let Err(e) = run(&mut c) {
            eprintln!("benches/cuda: {name} failed: {e}");
            std::process::exit(1);
        }
    }
    c.final_summary();
}
