//! ndscope side by side with candle-core on the same work in the same run, and the `gemm` crate's own
//! matrix product as the ceiling. Run with `cargo bench --bench versus_candle -- --noplot`; the numbers
//! and the machine are in BENCHMARKS.md.
//!
//! - `chain_20_ops`: twenty elementwise ops, each a new temporary, on 1 KiB and 4 MiB tensors;
//! - `matmul_f32`: square products, 512 and 1024;
//! - `matmul_bf16`, `matmul_f16`: the same in 16-bit floats (both libraries accumulate in `f32`);
//! - `mlp_step`: one training step of a 784-256-10 MLP at batch 128 — forward, cross-entropy, backward,
//!   AdamW — with candle's AdamW written from candle-core ops as candle-nn writes it.

use std::hint::black_box;

use candle_core as candle;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use ndscope::nn::{self, Activation, Init};
use ndscope::optim::{Adam, AdamConfig};
use ndscope::{DType, Device, Result, root};

mod common;
use common::{chain, train_step};

/// `common::chain(x, false)` in candle-core: `(y + 1) * 0.5`, `max(., x)`, `+ x`, five times.
fn candle_chain(x: &candle::Tensor) -> candle::Result<candle::Tensor> {
    let mut y = x.clone();
    for _ in 0..5 {
        let z = ((&y + 1.0)? * 0.5)?.maximum(x)?;
        y = (z + x)?;
    }
    Ok(y)
}

fn chains(c: &mut Criterion) {
    let mut group = c.benchmark_group("chain_20_ops");
    for (label, n) in [("1KiB", 256usize), ("4MiB", 1 << 20)] {
        group.throughput(Throughput::Bytes((n * 4 * 20) as u64));
        root(Device::Cpu, |s| -> Result<()> {
            let x = s.randn(&[n])?;
            group.bench_function(BenchmarkId::new("ndscope", label), |b| {
                b.iter(|| s.scope(|_| chain(black_box(&x), false).map(drop)).unwrap())
            });
            Ok(())
        })
        .unwrap();
        let x = candle::Tensor::randn(0f32, 1.0, n, &candle::Device::Cpu).unwrap();
        group.bench_function(BenchmarkId::new("candle", label), |b| {
            b.iter(|| candle_chain(black_box(&x)).map(drop).unwrap())
        });
    }
    group.finish();
}

/// `c = a b` for row-major `n x n` matrices with the `gemm` crate directly, on both cores: the
/// ceiling ndscope's `matmul` (which calls it) can reach.
fn gemm_ceiling(a: &[f32], b: &[f32], c: &mut [f32], n: usize) {
    assert!(a.len() == n * n && b.len() == n * n && c.len() == n * n);
    // SAFETY: all three slices hold n*n elements (checked above) and are row-major with row stride n
    // and column stride 1, so every index gemm computes from (m, n, k) = (n, n, n) is in bounds; `c`
    // does not overlap `a` or `b` (a `&mut` slice), and with `read_dst = false` its old contents are
    // not read.
    unsafe {
        gemm::gemm(
            n,
            n,
            n,
            c.as_mut_ptr(),
            1,
            n as isize,
            false,
            a.as_ptr(),
            1,
            n as isize,
            b.as_ptr(),
            1,
            n as isize,
            0.0f32,
            1.0f32,
            false,
            false,
            false,
            gemm::Parallelism::Rayon(0),
        );
    }
}

fn matmuls(c: &mut Criterion) {
    let mut group = c.benchmark_group("matmul_f32");
    group.sample_size(20);
    for n in [512usize, 1024] {
        group.throughput(Throughput::Elements(2 * (n as u64).pow(3))); // flops
        root(Device::Cpu, |s| -> Result<()> {
            let (a, b) = (s.randn(&[n, n])?, s.randn(&[n, n])?);
            group.bench_function(BenchmarkId::new("ndscope", n), |bench| {
                bench.iter(|| s.scope(|_| black_box(a.matmul(&b)).map(drop)).unwrap())
            });
            let (ha, hb) = (a.to_vec::<f32>()?, b.to_vec::<f32>()?);
            let mut hc = vec![0.0f32; n * n];
            group.bench_function(BenchmarkId::new("gemm_ceiling", n), |bench| {
                bench.iter(|| gemm_ceiling(black_box(&ha), black_box(&hb), &mut hc, n))
            });
            Ok(())
        })
        .unwrap();
        let dev = candle::Device::Cpu;
        let a = candle::Tensor::randn(0f32, 1.0, (n, n), &dev).unwrap();
        let b = candle::Tensor::randn(0f32, 1.0, (n, n), &dev).unwrap();
        group.bench_function(BenchmarkId::new("candle", n), |bench| {
            bench.iter(|| black_box(a.matmul(&b).unwrap()))
        });
    }
    group.finish();
}

/// Square 16-bit products: ndscope (`f16` through `gemm`'s f16 kernels, `bf16` widened to `f32`)
/// beside candle's.
fn matmuls_16_bit(c: &mut Criterion) {
    for (dtype, candle_dtype) in [
        (DType::BF16, candle::DType::BF16),
        (DType::F16, candle::DType::F16),
    ] {
        let mut group = c.benchmark_group(format!("matmul_{dtype}"));
        group.sample_size(20);
        for n in [512usize, 1024] {
            group.throughput(Throughput::Elements(2 * (n as u64).pow(3))); // flops
            root(Device::Cpu, |s| -> Result<()> {
                let a = s.randn(&[n, n])?.to_dtype(dtype)?;
                let b = s.randn(&[n, n])?.to_dtype(dtype)?;
                group.bench_function(BenchmarkId::new("ndscope", n), |bench| {
                    bench.iter(|| s.scope(|_| black_box(a.matmul(&b)).map(drop)).unwrap())
                });
                Ok(())
            })
            .unwrap();
            let dev = candle::Device::Cpu;
            let a = candle::Tensor::randn(0f32, 1.0, (n, n), &dev)
                .and_then(|t| t.to_dtype(candle_dtype))
                .unwrap();
            let b = candle::Tensor::randn(0f32, 1.0, (n, n), &dev)
                .and_then(|t| t.to_dtype(candle_dtype))
                .unwrap();
            group.bench_function(BenchmarkId::new("candle", n), |bench| {
                bench.iter(|| black_box(a.matmul(&b).unwrap()))
            });
        }
        group.finish();
    }
}

const SIZES: [usize; 3] = [784, 256, 10];
const BATCH: usize = 128;

/// A 784-256-10 MLP and AdamW in candle-core, written the way candle-nn writes them.
struct CandleMlp {
    params: Vec<candle::Var>,
    moments: Vec<(candle::Tensor, candle::Tensor)>,
    step: i32,
}

impl CandleMlp {
    fn new() -> candle::Result<CandleMlp> {
        let dev = candle::Device::Cpu;
        let mut params = Vec::new();
        for pair in SIZES.windows(2) {
            let bound = (6.0 / pair[0] as f64).sqrt();
            let w = candle::Tensor::rand(-bound as f32, bound as f32, (pair[1], pair[0]), &dev)?;
            params.push(candle::Var::from_tensor(&w)?);
            params.push(candle::Var::zeros(pair[1], candle::DType::F32, &dev)?);
        }
        let moments = params
            .iter()
            .map(|p| Ok((p.zeros_like()?, p.zeros_like()?)))
            .collect::<candle::Result<_>>()?;
        Ok(CandleMlp {
            params,
            moments,
            step: 0,
        })
    }

    fn step(&mut self, x: &candle::Tensor, y: &candle::Tensor) -> candle::Result<f32> {
        let p = &self.params;
        let h = x.matmul(&p[0].t()?)?.broadcast_add(&p[1])?.relu()?;
        let logits = h.matmul(&p[2].t()?)?.broadcast_add(&p[3])?;
        // Cross-entropy from logits: mean of logsumexp - logit[label].
        let lse = logits.log_sum_exp(1)?;
        let picked = logits.gather(&y.unsqueeze(1)?, 1)?.squeeze(1)?;
        let loss = (lse - picked)?.mean_all()?;
        let grads = loss.backward()?;
        // AdamW (lr 1e-3, betas 0.9/0.999, eps 1e-8, weight decay 1e-4).
        self.step += 1;
        let (lr, b1, b2, eps, wd) = (1e-3, 0.9f64, 0.999f64, 1e-8, 1e-4);
        let (c1, c2) = (1.0 - b1.powi(self.step), 1.0 - b2.powi(self.step));
        for (var, (m, v)) in self.params.iter().zip(self.moments.iter_mut()) {
            let Some(g) = grads.get(var) else { continue };
            *m = ((&*m * b1)? + (g * (1.0 - b1))?)?;
            *v = ((&*v * b2)? + (g.sqr()? * (1.0 - b2))?)?;
            let m_hat = (&*m / c1)?;
            let v_hat = (&*v / c2)?;
            let update = (m_hat / (v_hat.sqrt()? + eps)?)?;
            let decayed = (var.as_tensor() * (1.0 - lr * wd))?;
            var.set(&(decayed - (update * lr)?)?)?;
        }
        loss.to_scalar::<f32>()
    }
}

fn mlp_steps(c: &mut Criterion) {
    let mut group = c.benchmark_group("mlp_step_784-256-10_b128");
    let labels: Vec<i64> = (0..BATCH as i64).map(|i| i % 10).collect();
    root(Device::Cpu, |m| -> Result<()> {
        m.set_seed(1);
        let mut model = nn::mlp(m, &SIZES, Activation::Relu, Init::KaimingUniform)?;
        let mut opt = Adam::new(m, &model, AdamConfig::adamw(1e-3, 1e-4))?;
        let x = m.rand(&[BATCH, SIZES[0]])?;
        let y = m.from_slice(&labels, &[BATCH])?;
        group.bench_function("ndscope", |bench| {
            bench.iter(|| {
                m.scope(|b| train_step(b, &mut model, &mut opt, &x, &y))
                    .unwrap()
            })
        });
        Ok(())
    })
    .unwrap();
    let dev = candle::Device::Cpu;
    let x = candle::Tensor::rand(0f32, 1.0, (BATCH, SIZES[0]), &dev).unwrap();
    let y = candle::Tensor::from_slice(&labels, BATCH, &dev).unwrap();
    let mut mlp = CandleMlp::new().unwrap();
    group.bench_function("candle", |bench| bench.iter(|| mlp.step(&x, &y).unwrap()));
    group.finish();
}

criterion_group!(benches, chains, matmuls, matmuls_16_bit, mlp_steps);
criterion_main!(benches);
