//! Trains a multilayer perceptron on handwritten digits, on the CPU by default (`--device cuda:0` with
//! the `cuda` feature): the bundled 8x8 digits, or MNIST from IDX files with `--data DIR`.
//!
//! Parameters and optimizer state live in a `model` scope; each batch's inputs, activations, tape and
//! gradients live in a batch scope (an arena workspace by default) that closes after the step. The
//! per-epoch lines show that the model scope's memory stays the same and the batch scope's peak is
//! flat.
//!
//! With `--distributed` under `mpirun -np N` (and the `mpi` feature), each of the N processes
//! trains on its shard of every epoch and averages gradients with the others before each step:
//!
//! ```text
//! cargo run --release --example train -- --help
//! mpirun -np 2 cargo run --release --features mpi --example train -- --distributed
//! ```

use std::io::{IsTerminal, Write};
use std::time::Instant;

use ndscope::data::{Batch, Dataset, Loader};
use ndscope::dist::DataParallel;
use ndscope::nn::{self, Activation, Init, Mode, Module, Parameters, Sequential};
use ndscope::optim::{Adam, AdamConfig, Optimizer, Sgd, SgdConfig};
use ndscope::{DType, Device, Error, Result, Scope, Tape, Tensor, Workspace, root};

mod common;

const USAGE: &str = "\
Train an MLP on handwritten digits with ndscope.

USAGE: cargo run --release --example train -- [OPTIONS]

OPTIONS:
  --epochs N           passes over the training set        [default: 40]
  --batch-size N       examples per step                    [default: 64]
  --lr X               learning rate                        [default: 0.003]
  --hidden N           hidden units                         [default: 128]
  --optimizer NAME     adam, adamw or sgd (momentum 0.9)    [default: adamw]
  --workspace MODE     batch scopes in a reused arena: planned (offsets solved from
                       the first step), bump, or off (pool)  [default: planned]
  --seed N             initialisation, split and shuffling  [default: 42]
  --device D           cpu, or cuda:N (needs --features cuda) [default: cpu]
  --dtype T            f32, or bf16 / f16: batch scopes autocast to it (f32 master
                       weights; f16 with dynamic loss scaling)   [default: f32]
  --data DIR           MNIST IDX files in DIR instead of the bundled digits
  --checkpoint FILE    write the trained parameters as safetensors
  --timeline PREFIX    record the memory timeline: PREFIX.json and a chart, PREFIX.svg
                       (and the workspace's plan, PREFIX-plan.svg)
  --leak               keep every batch's logits in the model scope (with `move_to`),
                       to see what a leak looks like in the stats and the timeline
  --distributed        data-parallel over the ranks of `mpirun -np N` (needs --features
                       mpi): each rank trains on its shard, --batch-size per rank, and
                       gradients are averaged before every step; the loss printed is
                       the mean over every rank's shard
  --timeout SECONDS    with --distributed: how long a rank waits for a peer before the
                       job ends with an error naming it              [default: 300]
  --help               this text";

/// The command line, parsed.
#[derive(Debug)]
struct Options {
    epochs: u64,
    batch_size: usize,
    lr: f64,
    hidden: usize,
    optimizer: String,
    /// `planned`, `bump` or `off`.
    workspace: String,
    seed: u64,
    device: Device,
    /// f32, or the 16-bit dtype batch scopes autocast to.
    dtype: DType,
    data: Option<String>,
    checkpoint: Option<String>,
    timeline: Option<String>,
    leak: bool,
    distributed: bool,
    /// How long a rank waits for a peer (`--timeout`); the group's default when `None`.
    timeout: Option<f64>,
}

impl Options {
    fn parse(args: impl Iterator<Item = String>) -> std::result::Result<Options, String> {
        let mut o = Options {
            epochs: 40,
            batch_size: 64,
            lr: 0.003,
            hidden: 128,
            optimizer: "adamw".into(),
            workspace: "planned".into(),
            seed: 42,
            device: Device::Cpu,
            dtype: DType::F32,
            data: None,
            checkpoint: None,
            timeline: None,
            leak: false,
            distributed: false,
            timeout: None,
        };
        let mut args = args.peekable();
        while let Some(flag) = args.next() {
            if flag == "--help" || flag == "-h" {
                return Err(String::new());
            }
            if flag == "--leak" {
                o.leak = true;
                continue;
            }
            if flag == "--distributed" {
                o.distributed = true;
                continue;
            }
            let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
            let bad = |what: &str| format!("{flag}: {value:?} is not {what}");
            match flag.as_str() {
                "--epochs" => o.epochs = value.parse().map_err(|_| bad("a count"))?,
                "--batch-size" => o.batch_size = value.parse().map_err(|_| bad("a count"))?,
                "--lr" => o.lr = value.parse().map_err(|_| bad("a number"))?,
                "--hidden" => o.hidden = value.parse().map_err(|_| bad("a count"))?,
                "--optimizer" => {
                    if !["adam", "adamw", "sgd"].contains(&value.as_str()) {
                        return Err(bad("adam, adamw or sgd"));
                    }
                    o.optimizer = value;
                }
                "--workspace" => {
                    if !["planned", "bump", "off"].contains(&value.as_str()) {
                        return Err(bad("planned, bump or off"));
                    }
                    o.workspace = value;
                }
                "--seed" => o.seed = value.parse().map_err(|_| bad("an integer"))?,
                "--timeout" => o.timeout = Some(common::timeout_seconds(&value)?),
                "--device" => {
                    o.device = value.parse().map_err(|e: ndscope::Error| e.to_string())?
                }
                "--dtype" => o.dtype = common::parse_dtype(&value)?,
                "--data" => o.data = Some(value),
                "--checkpoint" => o.checkpoint = Some(value),
                "--timeline" => o.timeline = Some(value),
                _ => return Err(format!("unknown option {flag}")),
            }
        }
        if o.epochs == 0 || o.batch_size == 0 || o.hidden == 0 {
            return Err("--epochs, --batch-size and --hidden must be at least 1".into());
        }
        Ok(o)
    }
}

/// Either optimizer, chosen on the command line.
enum AnyOptimizer<'m> {
    Adam(Box<Adam<'m>>),
    Sgd(Sgd<'m>),
}

impl<'m> AnyOptimizer<'m> {
    fn step(&mut self, model: &mut Sequential<'m>, grads: &ndscope::Gradients<'_>) -> Result<()> {
        match self {
            AnyOptimizer::Adam(o) => o.step(model, grads),
            AnyOptimizer::Sgd(o) => o.step(model, grads),
        }
    }
}

/// What a step needs beside the model: the optimizer, the precision, and the data-parallel group.
struct Trainer<'m, 'g> {
    opt: AnyOptimizer<'m>,
    precision: common::Precision,
    ddp: Option<DataParallel<'g>>,
}

/// One training step in the batch scope `b` of the model scope `m`: forward, backward (and the
/// gradients' average over the ranks when distributed), update. Returns the loss and the batch
/// scope's peak bytes. With `leak`, the batch's logits are moved into the model scope and kept:
/// legal (the move is explicit), and exactly the leak the stats and timeline expose.
fn train_step<'m: 'b, 'b>(
    m: &Scope<'m>,
    b: &'b Scope<'b>,
    model: &mut Sequential<'m>,
    trainer: &mut Trainer<'m, '_>,
    batch: &Batch,
    leak: Option<&mut Vec<Tensor<'m>>>,
) -> Result<(f32, usize)> {
    let precision = &mut trainer.precision;
    precision.enter(b)?;
    // The features arrive as f32 and are stored in the compute dtype (the f32 copy dies at once).
    let x = b
        .from_slice(batch.features(), &batch.feature_shape())?
        .to_dtype(precision.dtype())?;
    let labels = b.from_slice(batch.labels(), &[batch.rows()])?;
    let tape = Tape::new(b);
    let mut outputs = None;
    let mut forward = || {
        let logits = model.forward(&tape.constant(&x), Mode::Train)?;
        let unscaled = logits.cross_entropy(&labels)?;
        let scaled = precision.scale(&unscaled)?;
        outputs = Some((logits, unscaled));
        Ok(scaled)
    };
    let mut grads = match &trainer.ddp {
        // Every rank learns whether every rank's forward and backward pass succeeded on as many
        // examples, then the gradients are averaged: the same bits everywhere, so every rank
        // takes (or, on overflow, skips) the same step.
        Some(ddp) => ddp.backward(&*model, &tape, batch.rows(), forward)?,
        None => tape.backward(&forward()?)?,
    };
    let (logits, loss) = outputs.expect("the forward pass ran");
    if precision.unscale(&mut grads)? {
        trainer.opt.step(model, &grads)?;
    }
    if let Some(kept) = leak {
        kept.push(logits.into_value().move_to(m)?.named("leaked logits"));
    }
    Ok((loss.value().to_scalar::<f32>()?, b.stats().peak_bytes))
}

/// Fraction of `data` the model classifies correctly, computed in a scope of `s` (with the training
/// steps' precision).
fn accuracy<'m>(
    s: &Scope<'m>,
    model: &Sequential<'m>,
    data: &Dataset,
    precision: &common::Precision,
) -> Result<f64> {
    s.named_scope("eval", |e| {
        precision.enter(e)?;
        let x = e.from_slice(data.features(), &[data.len(), data.dim()])?;
        let tape = Tape::no_grad(e);
        let logits = model.forward(&tape.constant(&x), Mode::Eval)?;
        let predicted = logits.value().argmax(-1, false)?.to_vec::<i64>()?;
        let correct = predicted
            .iter()
            .zip(data.labels())
            .filter(|(p, l)| p == l)
            .count();
        Ok(correct as f64 / data.len() as f64)
    })
}

/// Redraws a one-line progress bar on a terminal.
struct Progress {
    on_terminal: bool,
}

impl Progress {
    fn draw(&self, epoch: u64, epochs: u64, done: usize, total: usize) {
        if !self.on_terminal {
            return;
        }
        let width = 30;
        let filled = done * width / total.max(1);
        eprint!(
            "\r  epoch {epoch:>3}/{epochs} [{}{}] {done}/{total}",
            "#".repeat(filled),
            ".".repeat(width - filled)
        );
        let _ = std::io::stderr().flush();
    }

    fn clear(&self) {
        if self.on_terminal {
            eprint!("\r{:72}\r", "");
        }
    }
}

fn load_data(o: &Options) -> Result<(Dataset, Dataset, String)> {
    match &o.data {
        Some(dir) => {
            let (train, test) = Dataset::mnist(dir)?;
            Ok((train, test, format!("MNIST from {dir}")))
        }
        None => {
            let (train, test) = Dataset::digits()?.split(0.2, o.seed)?;
            Ok((train, test, "bundled 8x8 digits".into()))
        }
    }
}

fn run(o: &Options) -> Result<()> {
    let group = common::process_group(o.distributed, o.timeout)?;
    let (rank, world) = (group.rank(), group.world_size());
    // Rank 0 speaks for the job; every rank prints its own figures at the end.
    macro_rules! say {
        ($($arg:tt)*) => { if rank == 0 { println!($($arg)*) } };
    }
    let started = Instant::now();
    let (train, test, source) = load_data(o)?;
    say!(
        "data: {source}: {} training and {} test examples of {} features, {} classes",
        train.len(),
        test.len(),
        train.dim(),
        train.classes()
    );
    // Every rank shuffles with the same seed and takes its shard of each epoch.
    let loader = Loader::new(&train, o.batch_size)?
        .shuffle(o.seed)
        .shard(rank, world)?;
    if o.distributed {
        say!(
            "distributed: {world} ranks over {} ({} per machine); {} examples per rank and epoch, \
             global batch {}",
            group.transport_name(),
            group.local_size(),
            train.len().div_ceil(world),
            o.batch_size * world
        );
    }
    let steps_per_epoch = loader.batches_per_epoch();
    let progress = Progress {
        on_terminal: std::io::stderr().is_terminal(),
    };
    let mut ws = if o.workspace == "bump" {
        Workspace::new("batch")
    } else {
        Workspace::planned("batch")
    };
    let use_workspace = o.workspace != "off";

    let precision = common::Precision::new(o.dtype);
    root(o.device, |s| {
        s.set_seed(o.seed);
        s.named_scope("model", |m| {
            let sizes = [train.dim(), o.hidden, train.classes()];
            let mut model = nn::mlp(m, &sizes, Activation::Relu, Init::KaimingUniform)?;
            model.name_by_path(""); // dumps list each parameter by its path
            // Every rank built the same model; rank 0's initial values become everyone's.
            let ddp = if o.distributed {
                Some(DataParallel::new(&group, &mut model)?)
            } else {
                None
            };
            let opt = match o.optimizer.as_str() {
                "sgd" => AnyOptimizer::Sgd(Sgd::new(m, &model, SgdConfig::new(o.lr).momentum(0.9))?),
                "adam" => AnyOptimizer::Adam(Box::new(Adam::new(m, &model, AdamConfig::adam(o.lr))?)),
                _ => AnyOptimizer::Adam(Box::new(Adam::new(m, &model, AdamConfig::adamw(o.lr, 1e-4))?)),
            };
            let mut trainer = Trainer {
                opt,
                precision,
                ddp,
            };
            // From here on a tensor made in the model scope while a step runs is an error, not a leak.
            m.set_strict(true);
            say!(
                "model: MLP {sizes:?}, {} parameters, {}, batch {}, lr {}, {} batch scopes, {}, seed {}",
                model.parameter_elements(),
                o.optimizer,
                o.batch_size,
                o.lr,
                match o.workspace.as_str() {
                    "planned" => "planned workspace",
                    "bump" => "bump workspace",
                    _ => "pool",
                },
                trainer.precision.describe(),
                o.seed
            );
            let model_at_start = m.stats();
            let mut leaked: Vec<Tensor<'_>> = Vec::new();
            if o.timeline.is_some() {
                s.record_timeline();
            }
            for epoch in 1..=o.epochs {
                let mut loss_sum = 0.0f64;
                let mut batch_peak = 0;
                let mut sync_seconds = 0.0;
                let epoch_started = Instant::now();
                let before = m.stats();
                loader.for_each_batch(epoch, true, |batch| {
                    let leak = o.leak.then_some(&mut leaked);
                    let (loss, peak) = if use_workspace {
                        m.workspace(&mut ws, |b| {
                            train_step(m, b, &mut model, &mut trainer, batch, leak)
                        })?
                    } else {
                        m.named_scope("batch", |b| {
                            train_step(m, b, &mut model, &mut trainer, batch, leak)
                        })?
                    };
                    if let Some(ddp) = &trainer.ddp {
                        sync_seconds += ddp.last_sync().seconds;
                    }
                    m.mark_step();
                    batch_peak = batch_peak.max(peak);
                    loss_sum += f64::from(loss);
                    progress.draw(epoch, o.epochs, batch.index() + 1, steps_per_epoch);
                    Ok(())
                })?;
                let epoch_seconds = epoch_started.elapsed().as_secs_f64();
                // Each rank saw its own shard: the job's loss is the mean over the ranks, which
                // take the same number of steps.
                let mean_loss =
                    common::mean_over_ranks(&group, m, loss_sum / steps_per_epoch as f64)?;
                let acc = accuracy(m, &model, &test, &trainer.precision)?;
                progress.clear();
                let after = m.stats();
                let sync = if trainer.ddp.is_some() {
                    format!(
                        " | all-reduce {:.2} ms/step ({:.0}% of the step)",
                        sync_seconds * 1e3 / steps_per_epoch as f64,
                        sync_seconds / epoch_seconds * 100.0
                    )
                } else {
                    String::new()
                };
                say!(
                    "epoch {epoch:>3}  loss {:.4}  test acc {:5.1}%  | model: {} tensors, {} B live | \
                     batch: peak {} B, {} allocs/step, {} from system this epoch{sync}",
                    mean_loss,
                    acc * 100.0,
                    after.live_tensors,
                    after.live_bytes,
                    batch_peak,
                    (after.allocations - before.allocations) / steps_per_epoch as u64,
                    after.system_allocations - before.system_allocations,
                );
            }
            if o.distributed {
                // Each rank's own figures, in rank order.
                for r in 0..world {
                    if r == rank {
                        let sync = trainer.ddp.as_ref().map(DataParallel::last_sync);
                        println!(
                            "rank {rank}/{world}: model scope {} B live, {} B peak; last all-reduce: \
                             {} bucket(s), {} B, {:.2} ms ({:.2} ms waiting); {:.2} s in collectives",
                            m.stats().live_bytes,
                            m.stats().peak_bytes,
                            sync.map_or(0, |s| s.buckets),
                            sync.map_or(0, |s| s.bytes),
                            sync.map_or(0.0, |s| s.seconds * 1e3),
                            sync.map_or(0.0, |s| s.waited_seconds * 1e3),
                            group.waited_seconds()
                        );
                        let _ = std::io::stdout().flush();
                    }
                    group.barrier()?;
                }
            }
            let end = m.stats();
            say!(
                "\nmodel scope: {} live bytes at the start, {} at the end; workspace arena {} B after {} cycles ({} spills, {} in the last cycle)",
                model_at_start.live_bytes,
                end.live_bytes,
                ws.capacity(),
                ws.cycles(),
                ws.spills(),
                ws.last_cycle_spills()
            );
            if let Some(line) = common::plan_summary(&ws) {
                say!("{line}");
            }
            if let Some(line) = trainer.precision.report() {
                say!("{line}");
            }
            if let Some(prefix) = &o.timeline {
                let timeline = s.take_timeline();
                let title = if o.leak {
                    "live bytes per scope: a loop that keeps every batch's logits"
                } else {
                    "live bytes per scope: a healthy training loop"
                };
                write_file(&format!("{prefix}.json"), &timeline.to_json())?;
                write_file(&format!("{prefix}.svg"), &timeline.to_svg(title))?;
                if let Some(plan) = ws.plans().iter().max_by_key(|p| p.peak()) {
                    let title = "the batch workspace's plan: one rectangle per allocation of a step";
                    write_file(&format!("{prefix}-plan.svg"), &plan.to_svg(title))?;
                    println!("workspace plan: drawn in {prefix}-plan.svg");
                }
                println!(
                    "timeline: {} events in {prefix}.json, chart in {prefix}.svg",
                    timeline.events().len()
                );
            }
            if o.leak {
                println!(
                    "leak: {} batches of logits kept in the model scope ({} B)",
                    leaked.len(),
                    leaked.iter().map(|t| t.numel() * 4).sum::<usize>()
                );
            }
            if let Some(path) = &o.checkpoint {
                // Rank 0 writes; a failure to write reaches every rank.
                group.save_checkpoint(&model, path)?;
                say!("checkpoint: wrote {path} (safetensors; names {:?})", names(&model));
            }
            say!("\nscope tree at the end of training:\n{}", s.dump());
            Ok::<_, Error>(())
        })
    })?;
    say!("done in {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}

fn write_file(path: &str, text: &str) -> Result<()> {
    ndscope::checkpoint::write_atomically(path, text.as_bytes())
}

fn names(model: &Sequential<'_>) -> Vec<String> {
    let mut names = Vec::new();
    model.visit("", &mut |n, _| names.push(n.to_string()));
    names
}

fn main() {
    common::main_with(USAGE, Options::parse, run);
}
