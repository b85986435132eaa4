//! GPU benchmarks (`--features cuda`, on a machine with an NVIDIA GPU): the MLP training step of the
//! digits/MNIST size (eager, and through a `StepGraph` eager and captured) and a large matrix product, with the numbers PyTorch's
//! `benches/pytorch_reference.py` prints for the same work on the same GPU.
//!
//! `cargo bench --features cuda --bench cuda`. Besides criterion's timings it prints the step's GPU
//! allocator calls (after warm-up), the tree's peak bytes and the driver-level peak of reserved GPU
//! memory. Without a usable GPU it says why and measures nothing.

mod common;

use std::time::Instant;

use criterion::{BenchmarkId, Criterion, Throughput};
use ndscope::nn::{self, Activation, Init, Mode, Module};
use ndscope::optim::{Adam, AdamConfig, Optimizer, Sgd, SgdConfig};
use ndscope::{
    Device, Error, Input, Result, StepGraph, Tape, Workspace, gpu_memory, reset_gpu_memory_peak,
    root,
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
            println!(
                "graph_step 784-256-10 b128 SGD momentum {label} on {GPU}: {:.0} steps/s over {steps} \
                 steps (host inputs copied in, loss read every step)",
                steps as f64 / start.elapsed().as_secs_f64(),
            );
            let name = format!(
                "graph_step_784_256_10_b128_sgd_{}",
                if capture { "captured" } else { "eager" }
            );
            group.bench_function(name, |bench| bench.iter(|| run().expect("a step runs")));
            Ok::<_, Error>(())
        })?;
    }
    group.finish();
    Ok(())
}

/// Square f32 products through cuBLAS.
fn matmul(c: &mut Criterion) -> Result<()> {
    root(GPU, |s| {
        let mut group = c.benchmark_group("cuda_matmul");
        for n in [1024usize, 4096] {
            let a = s.randn(&[n, n])?;
            let b = s.randn(&[n, n])?;
            group.throughput(Throughput::Elements((2 * n * n * n) as u64));
            group.bench_with_input(BenchmarkId::from_parameter(n), &n, |bench, _| {
                bench.iter(|| {
                    // The product's block goes back to the pool when it drops, for the next one.
                    drop(a.matmul(&b).expect("matmul runs"));
                    GPU.synchronize().expect("the GPU finishes");
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
    for (name, run) in [
        ("mlp_step", mlp_step as fn(&mut Criterion) -> Result<()>),
        ("graph_step", graph_step),
        ("matmul", matmul),
    ] {
        if let Err(e) = run(&mut c) {
            eprintln!("benches/cuda: {name} failed: {e}");
            std::process::exit(1);
        }
    }
    c.final_summary();
}
