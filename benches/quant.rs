//! Products with block-quantized weights (`Tensor::matmul_quantized_t`) against the `f32` product
//! of the same shape, on Llama-3.2-1B's MLP shapes: `x [m, 2048] · W [8192, 2048]ᵀ` (gate and up)
//! and `x [m, 8192] · W [2048, 8192]ᵀ` (down), for one decoding row and for a batch of 8; streamed
//! from memory, also in `f32` both ways round and through GPT-2 small's tied head. The throughput
//! is the weight's stored bytes per second (what decoding is bound by). Run with
//! `cargo bench --bench quant -- --noplot`.

use std::hint::black_box;

mod common;

use criterion::measurement::WallTime;
use criterion::{
    BenchmarkGroup, BenchmarkId, Criterion, Throughput, criterion_group, criterion_main,
};
use ndscope::quant::QuantType;
use ndscope::{Device, QuantTensor, Result, Scope, Tensor, root};

/// A `[n, k]` matrix of `ty` with random levels and scales of a trained model's size (the K
/// formats, which ndscope does not quantize to, from random blocks with such scales).
fn weight<'s>(s: &Scope<'s>, ty: QuantType, n: usize, k: usize) -> Result<QuantTensor<'s>> {
    if ty.can_quantize() {
        return QuantTensor::quantize(&s.randn(&[n, k])?.mul_scalar(0.02)?, ty);
    }
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut bytes: Vec<u8> = (0..ty.bytes_for(n * k).expect("whole blocks"))
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect();
    let scales: &[usize] = match ty {
        QuantType::Q4_K | QuantType::Q5_K => &[0, 2],
        QuantType::Q6_K => &[208],
        QuantType::Q3_K => &[108],
        _ => &[80, 82],
    };
    let d = half::f16::from_f32(0.001).to_le_bytes();
    for block in bytes.chunks_exact_mut(ty.block_bytes()) {
        for &at in scales {
            block[at..at + 2].copy_from_slice(&d);
        }
    }
    QuantTensor::from_blocks(s, &bytes, ty, &[n, k])
}

/// `x · wᵀ` as `group`'s benchmark `{format}/{shape}`, its throughput the weight's stored bytes.
fn bench_product(
    group: &mut BenchmarkGroup<'_, WallTime>,
    s: &Scope<'_>,
    x: &Tensor<'_>,
    w: &QuantTensor<'_>,
    shape: &str,
) {
    group.throughput(Throughput::Bytes(w.nbytes() as u64));
    group.bench_function(BenchmarkId::new(w.ty().name(), shape), |b| {
        b.iter(|| {
            s.scope(|_| black_box(x.matmul_quantized_t(w)).map(drop))
                .unwrap()
        })
    });
}

fn products(c: &mut Criterion) {
    common::warn_if_cpu_busy("quant bench");
    let mut group = c.benchmark_group("quantized_product");
    group.sample_size(20);
    root(Device::Cpu, |s| -> Result<()> {
        for (n, k) in [(8192usize, 2048usize), (2048, 8192)] {
            let dense: Tensor<'_> = s.randn(&[n, k])?.mul_scalar(0.02)?;
            for m in [1usize, 8, 64, 512] {
                let x = s.randn(&[m, k])?;
                let shape = format!("{m}x{k}x{n}");
                group.throughput(Throughput::Bytes((n * k * 4) as u64));
                group.bench_function(BenchmarkId::new("f32", &shape), |b| {
                    b.iter(|| {
                        s.scope(|_| black_box(x.matmul(&dense.t()?)).map(drop))
                            .unwrap()
                    })
                });
                for ty in [
                    QuantType::Q8_0,
                    QuantType::Q4_0,
                    QuantType::Q4_1,
                    QuantType::Q5_0,
                    QuantType::Q4_K,
                    QuantType::Q5_K,
                    QuantType::Q6_K,
                ] {
                    let w = weight(s, ty, n, k)?;
                    bench_product(&mut group, s, &x, &w, &shape);
                }
            }
        }
        Ok(())
    })
    .unwrap();
    group.finish();
}

/// GPT-2 small's layer products (`[n, k]` of `c_attn`, `c_proj`, `c_fc` and the MLP's `c_proj`),
/// small enough that a product is 1 to 6 tasks of one token's size: how evenly two threads share
/// them at one token and at eight (a batched decoding step).
fn small_layers(c: &mut Criterion) {
    let mut group = c.benchmark_group("quantized_product_small");
    group.sample_size(30);
    root(Device::Cpu, |s| -> Result<()> {
        for (n, k) in [(2304usize, 768usize), (768, 768), (3072, 768), (768, 3072)] {
            for ty in [QuantType::Q8_0, QuantType::Q4_0] {
                let w = weight(s, ty, n, k)?;
                for m in [1usize, 8] {
                    let x = s.randn(&[m, k])?;
                    bench_product(&mut group, s, &x, &w, &format!("{m}x{k}x{n}"));
                }
            }
        }
        Ok(())
    })
    .unwrap();
    group.finish();
}

/// Weights that no cache holds: one pass over 8 distinct `[8192, 2048]` weights (38-107 MB
/// quantized, 512 MiB in `f32`, past the 32 MiB L3 of the machines measured), as decoding walks a
/// model's layers. What the in-cache figures above cannot show: whether a kernel keeps enough of
/// the weight's lines in flight while its tokens' arithmetic slows the walk.
fn streamed(c: &mut Criterion) {
    const LAYERS: usize = 8;
    let (n, k) = (8192usize, 2048usize);
    let mut group = c.benchmark_group("quantized_product_streamed");
    group.sample_size(10);
    root(Device::Cpu, |s| -> Result<()> {
        for ty in [
            QuantType::Q8_0,
            QuantType::Q4_0,
            QuantType::Q4_K,
            QuantType::Q5_K,
            QuantType::Q6_K,
        ] {
            let ws = (0..LAYERS)
                .map(|_| weight(s, ty, n, k))
                .collect::<Result<Vec<_>>>()?;
            group.throughput(Throughput::Bytes((ws[0].nbytes() * LAYERS) as u64));
            for m in [1usize, 8] {
                let x = s.randn(&[m, k])?;
                let shape = format!("{m}x{k}x{n}x{LAYERS}");
                group.bench_function(BenchmarkId::new(ty.name(), &shape), |b| {
                    b.iter(|| {
                        for w in &ws {
                            s.scope(|_| black_box(x.matmul_quantized_t(w)).map(drop))
                                .unwrap()
                        }
                    })
                });
            }
        }
        // The same walk over `f32` weights, read transposed (`[n, k]`, a `Linear`'s) and along
        // their outputs (`[k, n]`, GPT-2's `Conv1D`): 512 MiB a pass, what `f32` decoding streams.
        let dense = (0..LAYERS)
            .map(|_| s.randn(&[n, k]))
            .collect::<Result<Vec<_>>>()?;
        let in_out = (0..LAYERS)
            .map(|_| s.randn(&[k, n]))
            .collect::<Result<Vec<_>>>()?;
        // GPT-2 small's tied head, `[50257, 768]` read transposed (154 MB): the single product a
        // decoding step spends most on, with rows 3 KiB short.
        let (head_n, head_k) = (50_257usize, 768usize);
        let head = s.randn(&[head_n, head_k])?;
        group.throughput(Throughput::Bytes((head_n * head_k * 4) as u64));
        for m in [1usize, 8] {
            let x = s.randn(&[m, head_k])?;
            let shape = format!("{m}x{head_k}x{head_n}");
            group.bench_function(BenchmarkId::new("f32_head", &shape), |b| {
                b.iter(|| {
                    s.scope(|_| black_box(x.matmul(&head.t()?)).map(drop))
                        .unwrap()
                })
            });
        }
        group.throughput(Throughput::Bytes((n * k * 4 * LAYERS) as u64));
        for m in [1usize, 8] {
            let x = s.randn(&[m, k])?;
            let shape = format!("{m}x{k}x{n}x{LAYERS}");
            group.bench_function(BenchmarkId::new("f32", &shape), |b| {
                b.iter(|| {
                    for w in &dense {
                        s.scope(|_| black_box(x.matmul(&w.t()?)).map(drop)).unwrap()
                    }
                })
            });
            group.bench_function(BenchmarkId::new("f32_in_out", &shape), |b| {
                b.iter(|| {
                    for w in &in_out {
                        s.scope(|_| black_box(x.matmul(w)).map(drop)).unwrap()
                    }
                })
            });
        }
        Ok(())
    })
    .unwrap();
    group.finish();
}

criterion_group!(benches, products, small_layers, streamed);
criterion_main!(benches);
