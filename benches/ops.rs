//! CPU op throughput: elementwise chains on small and large tensors (with and without a
//! transcendental function), square matrix products, and the `x Wᵀ` products of a `Linear` over a
//! prompt (GPT-2 small's head, a Llama-1B-shaped model's projections). Run with
//! `cargo bench --bench ops -- --noplot`.

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use ndscope::{Device, Result, root};

mod common;
use common::chain;

fn ops(c: &mut Criterion) {
    let mut group = c.benchmark_group("chain_20_ops");
    root(Device::Cpu, |s| -> Result<()> {
        for (label, n) in [("1KiB", 256usize), ("4MiB", 1 << 20)] {
            let x = s.randn(&[n])?;
            group.throughput(Throughput::Bytes((n * 4 * 20) as u64));
            for tanh in [false, true] {
                let name = if tanh { "with_tanh" } else { "arithmetic" };
                group.bench_function(BenchmarkId::new(name, label), |b| {
                    b.iter(|| s.scope(|_| chain(black_box(&x), tanh).map(drop)).unwrap())
                });
            }
        }
        Ok(())
    })
    .unwrap();
    group.finish();

    let mut group = c.benchmark_group("matmul_f32");
    group.sample_size(20);
    root(Device::Cpu, |s| -> Result<()> {
        for n in [512usize, 1024] {
            let (a, b) = (s.randn(&[n, n])?, s.randn(&[n, n])?);
            group.throughput(Throughput::Elements(2 * (n as u64).pow(3))); // flops
            group.bench_function(BenchmarkId::from_parameter(n), |bench| {
                bench.iter(|| black_box(a.matmul(&b).unwrap()))
            });
        }
        Ok(())
    })
    .unwrap();
    group.finish();

    // `x Wᵀ` with `W` stored `[out, in]`, as a `Linear` reads it: (tokens, in, out).
    let mut group = c.benchmark_group("linear_f32");
    group.sample_size(10);
    root(Device::Cpu, |s| -> Result<()> {
        for (label, (m, k, n)) in [
            ("gpt2_head_128", (128usize, 768usize, 50257usize)),
            ("gpt2_mlp_128", (128, 768, 3072)),
            ("gpt2_mlp_1024", (1024, 768, 3072)),
            ("llama1b_qo_512", (512, 2048, 2048)),
            ("llama1b_up_512", (512, 2048, 8192)),
            ("llama1b_down_512", (512, 8192, 2048)),
        ] {
            let (x, w) = (s.randn(&[m, k])?, s.randn(&[n, k])?);
            let wt = w.t()?;
            group.throughput(Throughput::Elements(2 * (m * k * n) as u64)); // flops
            group.bench_function(BenchmarkId::from_parameter(label), |bench| {
                bench.iter(|| s.scope(|_| black_box(x.matmul(&wt)).map(drop)).unwrap())
            });
        }
        Ok(())
    })
    .unwrap();
    group.finish();
}

criterion_group!(benches, ops);
criterion_main!(benches);
