//! The layers of real models, forward and backward, in ndscope and in candle-core in the same run.
//! Run with `cargo bench --bench layers_versus_candle -- --noplot`; the numbers and the machine are in
//! BENCHMARKS.md.
//!
//! - `conv2d_fwd_bwd`: a 3x3 convolution (padding 1) of a 32x3x32x32 batch to 16 channels, the loss
//!   the sum of the output, gradients for the input and the kernel;
//! - `transformer_block_fwd_bwd`: one pre-norm block (layer norm, 4-head causal attention, a 4x GELU
//!   MLP, residuals) on batch 16, sequence 128, width 256, gradients for the input and every
//!   parameter. candle's block is written from candle-core ops as candle-nn writes its layers
//!   (layer norm from means, softmax from `exp` and a sum, exact GELU).

use std::hint::black_box;

use candle_core as candle;
use criterion::{Criterion, criterion_group, criterion_main};
use ndscope::nn::{AttentionOptions, Init, Mode, Module, TransformerBlock};
use ndscope::{Conv2dOptions, Device, Result, Tape, root};

const CONV_X: [usize; 4] = [32, 3, 32, 32];
const CONV_W: [usize; 4] = [16, 3, 3, 3];

fn conv(c: &mut Criterion) {
    let mut group = c.benchmark_group("conv2d_fwd_bwd_32x3x32x32_k3_c16");
    group.sample_size(20);
    root(Device::Cpu, |m| -> Result<()> {
        let (x, w) = (m.randn(&CONV_X)?, m.randn(&CONV_W)?);
        let same = Conv2dOptions {
            padding: [1, 1],
            ..Conv2dOptions::default()
        };
        group.bench_function("ndscope", |bench| {
            bench.iter(|| {
                m.scope(|b| {
                    let tape = Tape::new(b);
                    let (xv, wv) = (tape.param(&x), tape.param(&w));
                    let loss = xv.conv2d(&wv, None, &same)?.sum_all()?;
                    let grads = tape.backward(&loss)?;
                    black_box(grads.len());
                    Ok::<_, ndscope::Error>(())
                })
                .unwrap()
            })
        });
        Ok(())
    })
    .unwrap();
    let dev = candle::Device::Cpu;
    let x = candle::Var::randn(0f32, 1.0, CONV_X.to_vec(), &dev).unwrap();
    let w = candle::Var::randn(0f32, 1.0, CONV_W.to_vec(), &dev).unwrap();
    group.bench_function("candle", |bench| {
        bench.iter(|| {
            let loss = x.conv2d(&w, 1, 1, 1, 1).unwrap().sum_all().unwrap();
            black_box(loss.backward().unwrap());
        })
    });
    group.finish();
}

const BATCH: usize = 16;
const LEN: usize = 128;
const WIDTH: usize = 256;
const HEADS: usize = 4;

/// A pre-norm block in candle-core ops: the same math as `ndscope::nn::TransformerBlock`.
struct CandleBlock {
    ln1: (candle::Var, candle::Var),
    qkv: (candle::Var, candle::Var),
    proj: (candle::Var, candle::Var),
    ln2: (candle::Var, candle::Var),
    fc1: (candle::Var, candle::Var),
    fc2: (candle::Var, candle::Var),
    mask: candle::Tensor,
}

fn linear_params(inp: usize, out: usize) -> candle::Result<(candle::Var, candle::Var)> {
    let dev = candle::Device::Cpu;
    let bound = 1.0 / (inp as f64).sqrt();
    Ok((
        candle::Var::rand(-bound as f32, bound as f32, (out, inp), &dev)?,
        candle::Var::zeros(out, candle::DType::F32, &dev)?,
    ))
}

fn linear(
    x: &candle::Tensor,
    (w, b): &(candle::Var, candle::Var),
) -> candle::Result<candle::Tensor> {
    let (n, t, c) = x.dims3()?;
    x.reshape((n * t, c))?
        .matmul(&w.t()?)?
        .broadcast_add(b)?
        .reshape((n, t, w.dims()[0]))
}

fn layer_norm(
    x: &candle::Tensor,
    (w, b): &(candle::Var, candle::Var),
) -> candle::Result<candle::Tensor> {
    let mean = x.mean_keepdim(2)?;
    let centred = x.broadcast_sub(&mean)?;
    let var = centred.sqr()?.mean_keepdim(2)?;
    centred
        .broadcast_div(&(var + 1e-5)?.sqrt()?)?
        .broadcast_mul(w)?
        .broadcast_add(b)
}

impl CandleBlock {
    fn new() -> candle::Result<CandleBlock> {
        let dev = candle::Device::Cpu;
        let norm = || -> candle::Result<(candle::Var, candle::Var)> {
            Ok((
                candle::Var::ones(WIDTH, candle::DType::F32, &dev)?,
                candle::Var::zeros(WIDTH, candle::DType::F32, &dev)?,
            ))
        };
        let mask: Vec<f32> = (0..LEN * LEN)
            .map(|i| {
                if i % LEN > i / LEN {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        Ok(CandleBlock {
            ln1: norm()?,
            qkv: linear_params(WIDTH, 3 * WIDTH)?,
            proj: linear_params(WIDTH, WIDTH)?,
            ln2: norm()?,
            fc1: linear_params(WIDTH, 4 * WIDTH)?,
            fc2: linear_params(4 * WIDTH, WIDTH)?,
            mask: candle::Tensor::from_vec(mask, (LEN, LEN), &dev)?,
        })
    }

    fn forward(&self, x: &candle::Tensor) -> candle::Result<candle::Tensor> {
        let head = WIDTH / HEADS;
        let qkv = linear(&layer_norm(x, &self.ln1)?, &self.qkv)?
            .reshape((BATCH, LEN, 3, HEADS, head))?
            .permute((2, 0, 3, 1, 4))?;
        let (q, k, v) = (
            qkv.get(0)?.contiguous()?,
            qkv.get(1)?.contiguous()?,
            qkv.get(2)?.contiguous()?,
        );
        let scores =
            (q.matmul(&k.t()?)? * (1.0 / (head as f64).sqrt()))?.broadcast_add(&self.mask)?;
        let max = scores.max_keepdim(3)?;
        let e = scores.broadcast_sub(&max)?.exp()?;
        let weights = e.broadcast_div(&e.sum_keepdim(3)?)?;
        let attended = weights
            .matmul(&v)?
            .permute((0, 2, 1, 3))?
            .reshape((BATCH, LEN, WIDTH))?;
        let x = (x + linear(&attended, &self.proj)?)?;
        let hidden = linear(&layer_norm(&x, &self.ln2)?, &self.fc1)?.gelu_erf()?;
        x + linear(&hidden, &self.fc2)?
    }
}

fn block(c: &mut Criterion) {
    let mut group = c.benchmark_group("transformer_block_fwd_bwd_b16_t128_w256");
    group.sample_size(10);
    root(Device::Cpu, |m| -> Result<()> {
        let options = AttentionOptions {
            causal: true,
            dropout: 0.0,
        };
        let block = TransformerBlock::new(m, WIDTH, HEADS, options, Init::XavierUniform)?;
        let x = m.randn(&[BATCH, LEN, WIDTH])?;
        group.bench_function("ndscope", |bench| {
            bench.iter(|| {
                m.scope(|b| {
                    let tape = Tape::new(b);
                    let loss = block.forward(&tape.param(&x), Mode::Train)?.sum_all()?;
                    let grads = tape.backward(&loss)?;
                    black_box(grads.len());
                    Ok::<_, ndscope::Error>(())
                })
                .unwrap()
            })
        });
        Ok(())
    })
    .unwrap();
    let candle_block = CandleBlock::new().unwrap();
    let x = candle::Var::randn(0f32, 1.0, (BATCH, LEN, WIDTH), &candle::Device::Cpu).unwrap();
    group.bench_function("candle", |bench| {
        bench.iter(|| {
            let loss = candle_block.forward(&x).unwrap().sum_all().unwrap();
            black_box(loss.backward().unwrap());
        })
    });
    group.finish();
}

criterion_group!(benches, conv, block);
criterion_main!(benches);
