//! One training step (forward, backward, AdamW) of an MLP, in pool and in workspace mode: the
//! digits example's 64-128-10 at batch 64, and an MNIST-sized 784-256-10 at batch 128 (about 160
//! MFLOP a step). Run with `cargo bench --bench train -- --noplot`.

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use ndscope::nn::{self, Activation, Init};
use ndscope::optim::{Adam, AdamConfig};
use ndscope::{Device, Result, Workspace, root};

mod common;
use common::train_step;

fn train(c: &mut Criterion) {
    let mut group = c.benchmark_group("train_step");
    for (label, sizes, batch) in [
        ("digits_64-128-10_b64", [64usize, 128, 10], 64usize),
        ("mnist_784-256-10_b128", [784, 256, 10], 128),
    ] {
        // Multiply-adds of forward and backward: three matmuls per layer, two flops each.
        let flops = 6 * batch * (sizes[0] * sizes[1] + sizes[1] * sizes[2]);
        group.throughput(Throughput::Elements(flops as u64));
        root(Device::Cpu, |m| -> Result<()> {
            m.set_seed(1);
            let mut model = nn::mlp(m, &sizes, Activation::Relu, Init::KaimingUniform)?;
            let mut opt = Adam::new(m, &model, AdamConfig::adamw(1e-3, 1e-4))?;
            let x = m.rand(&[batch, sizes[0]])?;
            let labels: Vec<i64> = (0..batch as i64).map(|i| i % 10).collect();
            let y = m.from_slice(&labels, &[batch])?;
            let mut ws = Workspace::new("batch");
            group.bench_function(BenchmarkId::new("pool", label), |bench| {
                bench.iter(|| {
                    m.scope(|b| train_step(b, &mut model, &mut opt, &x, &y))
                        .map(black_box)
                        .unwrap()
                })
            });
            group.bench_function(BenchmarkId::new("workspace", label), |bench| {
                bench.iter(|| {
                    m.workspace(&mut ws, |b| train_step(b, &mut model, &mut opt, &x, &y))
                        .map(black_box)
                        .unwrap()
                })
            });
            Ok(())
        })
        .unwrap();
    }
    group.finish();
}

criterion_group!(benches, train);
criterion_main!(benches);
