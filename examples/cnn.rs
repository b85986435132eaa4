//! A small convolutional network on the bundled 8x8 handwritten digits, on the CPU by default
//! (`--device cuda:0` with the `cuda` feature).
//!
//! Two 3x3 convolutions with batch normalisation and ReLU, a 2x2 max pooling, a hidden linear layer
//! with dropout and a linear classifier; AdamW with a warm-up + cosine schedule; training images
//! shifted by up to a pixel. The model is a user struct declared with `ndscope::model!`; its parameters, optimizer state and batch-norm running statistics live in a
//! `model` scope (the statistics are updated in place), each step runs in a batch workspace.
//!
//! ```text
//! cargo run --release --example cnn -- --help
//! ```

use std::time::Instant;

use ndscope::data::{Batch, Dataset, Loader};
use ndscope::nn::{BatchNorm2d, Conv2d, Dropout, Init, Linear, Mode, Module, Parameters, Pool2d};
use ndscope::optim::{Adam, AdamConfig, Optimizer, Schedule, WarmupCosine};
use ndscope::{
    Conv2dOptions, DType, Device, Error, Result, Scope, Tape, Tensor, Var, Workspace, root,
};

mod common;

const USAGE: &str = "\
Train a small CNN on the bundled 8x8 digits with ndscope.

USAGE: cargo run --release --example cnn -- [OPTIONS]

OPTIONS:
  --epochs N        passes over the training set         [default: 30]
  --batch-size N    examples per step                    [default: 64]
  --lr X            peak learning rate                   [default: 0.003]
  --channels N      channels of the first convolution    [default: 32]
  --augment on|off  shift training images by up to a pixel [default: on]
  --dropout X       dropout before the classifier        [default: 0.3]
  --seed N          split, initialisation and shuffling  [default: 42]
  --device D        cpu, or cuda:N (needs --features cuda) [default: cpu]
  --dtype T         f32, or bf16 / f16 autocast (f16 with loss scaling) [default: f32]
  --help            this text";

/// Steps left out of the steps/s figure: the first ones compile the GPU kernels and grow the caches.
const WARM_UP_STEPS: u64 = 10;

#[derive(Debug)]
struct Options {
    epochs: u64,
    batch_size: usize,
    lr: f64,
    channels: usize,
    augment: bool,
    dropout: f64,
    seed: u64,
    device: Device,
    dtype: DType,
}

impl Options {
    fn parse(mut args: impl Iterator<Item = String>) -> std::result::Result<Options, String> {
        let mut o = Options {
            epochs: 30,
            batch_size: 64,
            lr: 0.003,
            channels: 32,
            augment: true,
            dropout: 0.3,
            seed: 42,
            device: Device::Cpu,
            dtype: DType::F32,
        };
        while let Some(flag) = args.next() {
            if flag == "--help" || flag == "-h" {
                return Err(String::new());
            }
            let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
            let bad = |what: &str| format!("{flag}: {value:?} is not {what}");
            match flag.as_str() {
                "--epochs" => o.epochs = value.parse().map_err(|_| bad("a count"))?,
                "--batch-size" => o.batch_size = value.parse().map_err(|_| bad("a count"))?,
                "--lr" => o.lr = value.parse().map_err(|_| bad("a number"))?,
                "--channels" => o.channels = value.parse().map_err(|_| bad("a count"))?,
                "--augment" => {
                    o.augment = match value.as_str() {
                        "on" => true,
                        "off" => false,
                        _ => return Err(bad("on or off")),
                    }
                }
                "--dropout" => o.dropout = value.parse().map_err(|_| bad("a number"))?,
                "--seed" => o.seed = value.parse().map_err(|_| bad("an integer"))?,
                "--device" => o.device = value.parse().map_err(|e: Error| e.to_string())?,
                "--dtype" => o.dtype = common::parse_dtype(&value)?,
                _ => return Err(format!("unknown option {flag}")),
            }
        }
        if o.epochs == 0 || o.batch_size == 0 || o.channels == 0 {
            return Err("--epochs, --batch-size and --channels must be at least 1".into());
        }
        Ok(o)
    }
}

ndscope::model! {
    /// conv 3x3 → batch norm → ReLU, twice; max pooling 2x2; linear → ReLU → dropout → linear.
    struct Cnn<'m> {
        conv1: Conv2d<'m>,
        bn1: BatchNorm2d<'m>,
        conv2: Conv2d<'m>,
        bn2: BatchNorm2d<'m>,
        pool: Pool2d,
        hidden: Linear<'m>,
        dropout: Dropout,
        head: Linear<'m>,
    }
}

impl<'m> Cnn<'m> {
    fn new(m: &Scope<'m>, channels: usize, classes: usize, dropout: f64) -> Result<Cnn<'m>> {
        let same = Conv2dOptions {
            padding: [1, 1],
            ..Conv2dOptions::default()
        };
        let init = Init::KaimingUniform;
        Ok(Cnn {
            conv1: Conv2d::new(m, 1, channels, [3, 3], same, init)?,
            bn1: BatchNorm2d::new(m, channels)?,
            conv2: Conv2d::new(m, channels, 2 * channels, [3, 3], same, init)?,
            bn2: BatchNorm2d::new(m, 2 * channels)?,
            pool: Pool2d::max([2, 2]),
            hidden: Linear::new(m, 2 * channels * 16, 128, init)?,
            dropout: Dropout::new(dropout)?,
            head: Linear::new(m, 128, classes, init)?,
        })
    }

    /// Logits `[batch, classes]` for images `[batch, 1, 8, 8]`.
    fn forward<'t, 's>(&self, x: &Var<'t, 's>, mode: Mode) -> Result<Var<'t, 's>>
    where
        'm: 's,
    {
        let x = self
            .bn1
            .forward(&self.conv1.forward(x, mode)?, mode)?
            .relu()?;
        let x = self
            .bn2
            .forward(&self.conv2.forward(&x, mode)?, mode)?
            .relu()?;
        let x = <Pool2d as Module<'m>>::forward(&self.pool, &x, mode)?;
        let batch = x.shape()[0];
        let x = x.reshape(&[batch, x.value().numel() / batch.max(1)])?;
        let x = self.hidden.forward(&x, mode)?.relu()?;
        let x = <Dropout as Module<'m>>::forward(&self.dropout, &x, mode)?;
        self.head.forward(&x, mode)
    }
}

/// The images of `features` (`[rows, 64]`) as `[rows, 1, 8, 8]` of `dtype` in scope `s`.
fn images<'s>(s: &Scope<'s>, features: &[f32], rows: usize, dtype: DType) -> Result<Tensor<'s>> {
    s.from_slice(features, &[rows, 1, 8, 8])?.to_dtype(dtype)
}

/// Copies `batch`'s images into `out`, each shifted by a random whole pixel in `-1..=1` on both
/// axes (zeros fill the edge): the network sees slightly different digits every epoch.
fn shifted(batch: &Batch, rng: &mut u64, out: &mut Vec<f32>) {
    out.clear();
    out.resize(batch.features().len(), 0.0);
    for (image, into) in batch.features().chunks(64).zip(out.chunks_mut(64)) {
        // xorshift64: two shifts per image from one draw.
        *rng ^= *rng << 13;
        *rng ^= *rng >> 7;
        *rng ^= *rng << 17;
        let (dy, dx) = ((*rng % 3) as isize - 1, ((*rng / 3) % 3) as isize - 1);
        for y in 0..8isize {
            for x in 0..8isize {
                let (sy, sx) = (y - dy, x - dx);
                if (0..8).contains(&sy) && (0..8).contains(&sx) {
                    into[(y * 8 + x) as usize] = image[(sy * 8 + sx) as usize];
                }
            }
        }
    }
}

fn train_step<'m: 'b, 'b>(
    b: &'b Scope<'b>,
    model: &mut Cnn<'m>,
    opt: &mut Adam<'m>,
    precision: &mut common::Precision,
    batch: &Batch,
    features: &[f32],
) -> Result<(f32, usize)> {
    precision.enter(b)?;
    let x = images(b, features, batch.rows(), precision.dtype())?;
    let labels = b.from_slice(batch.labels(), &[batch.rows()])?;
    let tape = Tape::new(b);
    let loss = model
        .forward(&tape.constant(&x), Mode::Train)?
        .cross_entropy(&labels)?;
    precision.backward_and_step(&tape, &loss, |grads| opt.step(model, grads))?;
    Ok((loss.value().to_scalar::<f32>()?, b.stats().peak_bytes))
}

fn accuracy<'m>(
    s: &Scope<'m>,
    model: &Cnn<'m>,
    data: &Dataset,
    precision: &common::Precision,
) -> Result<f64> {
    s.named_scope("eval", |e| {
        precision.enter(e)?;
        let x = images(e, data.features(), data.len(), precision.dtype())?;
        let tape = Tape::no_grad(e);
        let predicted = model
            .forward(&tape.constant(&x), Mode::Eval)?
            .value()
            .argmax(-1, false)?
            .to_vec::<i64>()?;
        let correct = predicted
            .iter()
            .zip(data.labels())
            .filter(|(p, l)| p == l)
            .count();
        Ok(correct as f64 / data.len() as f64)
    })
}

fn run(o: &Options) -> Result<()> {
    let started = Instant::now();
    let (train, test) = Dataset::digits()?.split(0.2, o.seed)?;
    println!(
        "data: bundled 8x8 digits, {} training and {} test images",
        train.len(),
        test.len()
    );
    let loader = Loader::new(&train, o.batch_size)?.shuffle(o.seed);
    let steps_per_epoch = loader.batches_per_epoch() as u64;
    let total = o.epochs * steps_per_epoch;
    let schedule = WarmupCosine::new(o.lr, total / 20, total)?.with_min(o.lr / 20.0);
    let mut ws = Workspace::planned("batch");
    let mut precision = common::Precision::new(o.dtype);
    root(o.device, |s| {
        s.set_seed(o.seed);
        s.named_scope("model", |m| {
            let mut model = Cnn::new(m, o.channels, train.classes(), o.dropout)?;
            model.name_by_path(""); // dumps list each parameter by its path
            let mut opt = Adam::new(m, &model, AdamConfig::adamw(o.lr, 1e-4))?;
            // From here on a tensor made in the model scope while a step runs is an error, not a leak.
            m.set_strict(true);
            println!(
                "model: conv3x3({0}) bn relu, conv3x3({1}) bn relu, maxpool2, linear({1}x4x4 -> 128) \
                 relu dropout {2}, linear(128 -> {3}); {4} parameters; AdamW, batch {5}, lr {6} \
                 (warm-up, cosine), {8}, seed {7}",
                o.channels,
                2 * o.channels,
                o.dropout,
                train.classes(),
                model.parameter_elements(),
                o.batch_size,
                o.lr,
                o.seed,
                precision.describe()
            );
            let mut step = 0u64;
            let mut training = std::time::Duration::ZERO;
            let (mut rng, mut augmented) = (o.seed | 1, Vec::new());
            for epoch in 1..=o.epochs {
                let (mut loss_sum, mut batch_peak) = (0.0f64, 0);
                let before = m.stats();
                loader.for_each_batch(epoch, false, |batch| {
                    opt.set_learning_rate(schedule.lr(step));
                    step += 1;
                    let features = if o.augment {
                        shifted(batch, &mut rng, &mut augmented);
                        &augmented[..]
                    } else {
                        batch.features()
                    };
                    let t = Instant::now();
                    let (loss, peak) = m.workspace(&mut ws, |b| {
                        train_step(b, &mut model, &mut opt, &mut precision, batch, features)
                    })?;
                    if step > WARM_UP_STEPS {
                        training += t.elapsed();
                    }
                    loss_sum += f64::from(loss);
                    batch_peak = batch_peak.max(peak);
                    Ok(())
                })?;
                let acc = accuracy(m, &model, &test, &precision)?;
                let after = m.stats();
                println!(
                    "epoch {epoch:>3}  loss {:.4}  test acc {:5.1}%  | model: {} tensors, {} B live | \
                     batch: peak {} B, {} allocs/step, {} from system this epoch",
                    loss_sum / steps_per_epoch as f64,
                    acc * 100.0,
                    after.live_tensors,
                    after.live_bytes,
                    batch_peak,
                    (after.allocations - before.allocations) / steps_per_epoch,
                    after.system_allocations - before.system_allocations,
                );
            }
            println!(
                "\ntraining: {:.0} steps/s after the first {WARM_UP_STEPS}; workspace arena {} B after {} cycles",
                step.saturating_sub(WARM_UP_STEPS) as f64 / training.as_secs_f64(),
                ws.capacity(),
                ws.cycles()
            );
            if let Some(line) = common::plan_summary(&ws) {
                println!("{line}");
            }
            if let Some(line) = precision.report() {
                println!("{line}");
            }
            println!(
                "final test accuracy: {:.1}%",
                accuracy(m, &model, &test, &precision)? * 100.0
            );
            println!("\nscope tree at the end of training:\n{}", s.dump());
            Ok::<_, Error>(())
        })
    })?;
    println!("done in {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}

fn main() {
    common::main_with(USAGE, Options::parse, run);
}
