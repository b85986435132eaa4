//! A character-level decoder-only transformer, trained from scratch on the CPU by default
//! (`--device cuda:0` with the `cuda` feature).
//!
//! By default it learns two-digit addition: every problem `ab+cd=sum` (operands and sum zero-padded
//! to a fixed width, `37+45=082`) is generated in code, a seeded tenth of the 10,000 problems is held
//! out, and the model must complete the held-out sums it never saw. `--text FILE` trains on any UTF-8
//! text instead and samples from it.
//!
//! The model is a user struct declared with `ndscope::model!`, its parameters and AdamW state live
//! in a `model` scope, each step runs in a batch workspace; the progress lines show the model scope
//! staying the same size while the batch scope's arena is reused.
//!
//! ```text
//! cargo run --release --example gpt -- --help
//! ```

use std::time::Instant;

use ndscope::dist::DataParallel;
use ndscope::nn::{
    AttentionOptions, Embedding, Init, LayerNorm, Linear, Mode, Module, Parameters,
    PositionalEmbedding, Recomputed, TransformerBlock,
};
use ndscope::optim::{Adam, AdamConfig, Optimizer, Schedule, WarmupCosine};
use ndscope::{DType, Device, Error, Result, Scope, Tape, Tensor, Var, Workspace, root};

mod common;
use common::Rng;

const USAGE: &str = "\
Train a small GPT with ndscope: two-digit addition by default, or any text.

USAGE: cargo run --release --example gpt -- [OPTIONS]

OPTIONS:
  --steps N         optimizer steps                          [default: 1000; text: 3000]
  --batch-size N    sequences per step                       [default: 64]
  --lr X            peak learning rate (warm-up, cosine)     [default: 0.002]
  --width N         model width                              [default: 128]
  --heads N         attention heads                          [default: 4]
  --layers N        transformer blocks                       [default: 2]
  --dropout X       attention and residual dropout           [default: 0]
  --context N       context length for --text                [default: 64]
  --seed N          problems, split, initialisation, batches [default: 42]
  --device D        cpu, or cuda:N (needs --features cuda)   [default: cpu]
  --dtype T         f32, or bf16 / f16 autocast (f16 with loss scaling) [default: f32]
  --text FILE       train on the characters of FILE and sample from it
  --recompute       recompute each block's activations in the backward pass instead of keeping them
                    (activation checkpointing; --checkpoint is the old spelling)
  --workspace W     the batch scope: planned, bump, or none (the pool)  [default: planned]
  --distributed     data-parallel over the ranks of `mpirun -np N` (needs --features mpi):
                    --batch-size sequences per rank, gradients averaged before each step;
                    the loss printed is the mean over every rank's sequences
  --timeout SECONDS with --distributed: how long a rank waits for a peer before the job
                    ends with an error naming it                     [default: 300]
  --help            this text";

/// The command line, parsed.
#[derive(Debug)]
struct Options {
    steps: Option<u64>,
    batch_size: usize,
    lr: f64,
    width: usize,
    heads: usize,
    layers: usize,
    dropout: f64,
    context: usize,
    seed: u64,
    device: Device,
    dtype: DType,
    text: Option<String>,
    recompute: bool,
    workspace: String,
    distributed: bool,
    /// How long a rank waits for a peer (`--timeout`); the group's default when `None`.
    timeout: Option<f64>,
}

impl Options {
    fn parse(args: impl Iterator<Item = String>) -> std::result::Result<Options, String> {
        let mut o = Options {
            steps: None,
            batch_size: 64,
            lr: 0.002,
            width: 128,
            heads: 4,
            layers: 2,
            dropout: 0.0,
            context: 64,
            seed: 42,
            device: Device::Cpu,
            dtype: DType::F32,
            text: None,
            recompute: false,
            workspace: "planned".into(),
            distributed: false,
            timeout: None,
        };
        let mut args = args;
        while let Some(flag) = args.next() {
            if flag == "--help" || flag == "-h" {
                return Err(String::new());
            }
            if flag == "--recompute" || flag == "--checkpoint" {
                o.recompute = true;
                continue;
            }
            if flag == "--distributed" {
                o.distributed = true;
                continue;
            }
            let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
            let number = |v: &str| {
                v.parse::<f64>()
                    .map_err(|_| format!("{flag}: `{v}` is not a number"))
            };
            let count = |v: &str| {
                v.parse::<usize>()
                    .ok()
                    .filter(|&n| n > 0)
                    .ok_or_else(|| format!("{flag}: `{v}` is not a positive whole number"))
            };
            match flag.as_str() {
                "--steps" => o.steps = Some(count(&value)? as u64),
                "--batch-size" => o.batch_size = count(&value)?,
                "--lr" => o.lr = number(&value)?,
                "--width" => o.width = count(&value)?,
                "--heads" => o.heads = count(&value)?,
                "--layers" => o.layers = count(&value)?,
                "--dropout" => o.dropout = number(&value)?,
                "--context" => o.context = count(&value)?,
                "--seed" => o.seed = value.parse().map_err(|_| format!("--seed: `{value}`"))?,
                "--timeout" => o.timeout = Some(common::timeout_seconds(&value)?),
                "--device" => o.device = value.parse().map_err(|e: Error| e.to_string())?,
                "--dtype" => o.dtype = common::parse_dtype(&value)?,
                "--text" => o.text = Some(value),
                "--workspace" if ["planned", "bump", "none"].contains(&value.as_str()) => {
                    o.workspace = value;
                }
                "--workspace" => {
                    return Err(format!("--workspace: planned, bump or none, not `{value}`"));
                }
                _ => return Err(format!("unknown option {flag}")),
            }
        }
        Ok(o)
    }
}

/// Steps left out of the steps/s figure: the first ones compile the GPU kernels and grow the caches.
const WARM_UP_STEPS: u64 = 10;

ndscope::model! {
    /// GPT-2's shape: token and position embeddings, pre-norm blocks, a final norm and a head.
    struct Gpt<'m> {
        tokens: Embedding<'m>,
        positions: PositionalEmbedding<'m>,
        blocks: Vec<TransformerBlock<'m>>,
        ln: LayerNorm<'m>,
        head: Linear<'m>,
    }
}

impl<'m> Gpt<'m> {
    fn new(m: &Scope<'m>, vocab: usize, context: usize, o: &Options) -> Result<Gpt<'m>> {
        let init = Init::Normal(0.02);
        let attention = AttentionOptions {
            causal: true,
            dropout: o.dropout,
        };
        Ok(Gpt {
            tokens: Embedding::new(m, vocab, o.width, init)?,
            positions: PositionalEmbedding::new(m, context, o.width, init)?,
            blocks: (0..o.layers)
                .map(|_| TransformerBlock::new(m, o.width, o.heads, attention, init))
                .collect::<Result<_>>()?,
            ln: LayerNorm::new(m, o.width)?,
            head: Linear::new(m, o.width, vocab, init)?,
        })
    }

    /// Next-token logits `[batch, len, vocab]` for `ids` (`[batch, len]`); with `recompute`, each
    /// block's activations are recomputed in the backward pass instead of kept.
    fn logits<'t, 's>(
        &self,
        tape: &'t Tape<'s>,
        ids: &Tensor<'s>,
        mode: Mode,
        recompute: bool,
    ) -> Result<Var<'t, 's>>
    where
        'm: 's,
    {
        let mut x = self.positions.forward(&self.tokens.forward(tape, ids)?)?;
        for block in &self.blocks {
            x = if recompute {
                Recomputed::new(block.clone()).forward(&x, mode)?
            } else {
                block.forward(&x, mode)?
            };
        }
        self.head.forward(&self.ln.forward(&x, mode)?, mode)
    }
}

/// What the model learns: sequences of token ids, and which positions' predictions count.
trait Task {
    /// Tokens in the vocabulary.
    fn vocab(&self) -> usize;
    /// Length of the sequences the model reads (the context).
    fn context(&self) -> usize;
    /// A training batch: inputs `[batch, context]`, and the targets of the positions that count,
    /// `[batch, counted]`, for positions `first_counted()..`.
    fn batch(&self, rng: &mut Rng, size: usize) -> (Vec<i64>, Vec<i64>);
    /// The first position whose prediction enters the loss.
    fn first_counted(&self) -> usize;
}

/// Two-digit addition: `ab+cd=sss`, nine characters, the model reads eight and predicts the sum's
/// three digits from positions 5, 6 and 7.
struct Addition {
    train: Vec<[i64; 9]>,
    held_out: Vec<[i64; 9]>,
}

const PLUS: i64 = 10;
const EQUALS: i64 = 11;

impl Addition {
    fn new(rng: &mut Rng) -> Addition {
        let mut all: Vec<[i64; 9]> = (0..100)
            .flat_map(|a| (0..100).map(move |b| (a, b)))
            .map(|(a, b)| {
                let s = a + b;
                [
                    a / 10,
                    a % 10,
                    PLUS,
                    b / 10,
                    b % 10,
                    EQUALS,
                    s / 100,
                    s / 10 % 10,
                    s % 10,
                ]
            })
            .collect();
        for i in (1..all.len()).rev() {
            all.swap(i, rng.below(i + 1));
        }
        let held_out = all.split_off(all.len() - all.len() / 10);
        Addition {
            train: all,
            held_out,
        }
    }

    fn show(seq: &[i64]) -> String {
        seq.iter()
            .map(|&t| match t {
                PLUS => '+',
                EQUALS => '=',
                d => char::from(b'0' + d as u8),
            })
            .collect()
    }
}

impl Task for Addition {
    fn vocab(&self) -> usize {
        12
    }
    fn context(&self) -> usize {
        8
    }
    fn first_counted(&self) -> usize {
        5
    }
    fn batch(&self, rng: &mut Rng, size: usize) -> (Vec<i64>, Vec<i64>) {
        let (mut inputs, mut targets) = (Vec::new(), Vec::new());
        for _ in 0..size {
            let p = &self.train[rng.below(self.train.len())];
            inputs.extend_from_slice(&p[..8]);
            targets.extend_from_slice(&p[6..]);
        }
        (inputs, targets)
    }
}

/// Characters of a text: windows of `context` characters, every position predicts the next.
struct Text {
    chars: Vec<char>,
    ids: Vec<i64>,
    context: usize,
}

impl Text {
    fn load(path: &str, context: usize) -> Result<Text> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::Io {
            path: path.to_string(),
            reason: e.to_string(),
        })?;
        let mut chars: Vec<char> = text.chars().collect();
        chars.sort_unstable();
        chars.dedup();
        let ids: Vec<i64> = text
            .chars()
            .map(|c| {
                chars
                    .binary_search(&c)
                    .expect("every char is in the vocabulary") as i64
            })
            .collect();
        if ids.len() <= context {
            return Err(Error::Io {
                path: path.to_string(),
                reason: format!(
                    "holds {} characters; --text needs more than the context ({context})",
                    ids.len()
                ),
            });
        }
        Ok(Text {
            chars,
            ids,
            context,
        })
    }
}

impl Task for Text {
    fn vocab(&self) -> usize {
        self.chars.len()
    }
    fn context(&self) -> usize {
        self.context
    }
    fn first_counted(&self) -> usize {
        0
    }
    fn batch(&self, rng: &mut Rng, size: usize) -> (Vec<i64>, Vec<i64>) {
        let (mut inputs, mut targets) = (Vec::new(), Vec::new());
        for _ in 0..size {
            let start = rng.below(self.ids.len() - self.context);
            inputs.extend_from_slice(&self.ids[start..start + self.context]);
            targets.extend_from_slice(&self.ids[start + 1..start + self.context + 1]);
        }
        (inputs, targets)
    }
}

/// The task chosen on the command line.
enum Job {
    Addition(Addition),
    Text(Text),
}

impl Job {
    fn task(&self) -> &dyn Task {
        match self {
            Job::Addition(a) => a,
            Job::Text(t) => t,
        }
    }
}

/// One step in the batch scope `b`: forward, loss on the counted positions, backward, AdamW.
/// Returns the loss and the batch scope's peak bytes.
#[allow(clippy::too_many_arguments)] // the step's parts, each borrowed differently
fn train_step<'m: 'b, 'b>(
    b: &'b Scope<'b>,
    model: &mut Gpt<'m>,
    opt: &mut Adam<'m>,
    precision: &mut common::Precision,
    ddp: Option<&DataParallel<'_>>,
    task: &dyn Task,
    batch: &(Vec<i64>, Vec<i64>),
    o: &Options,
) -> Result<(f32, usize)> {
    let size = o.batch_size;
    precision.enter(b)?;
    let (context, first) = (task.context(), task.first_counted());
    let ids = b.from_slice(&batch.0, &[size, context])?;
    let counted = context - first;
    let targets = b.from_slice(&batch.1, &[size * counted])?;
    let tape = Tape::new(b);
    let mut loss = None;
    let mut forward = || {
        let logits = model.logits(&tape, &ids, Mode::Train, o.recompute)?;
        let unscaled = logits
            .narrow(1, first, counted)?
            .reshape(&[size * counted, task.vocab()])?
            .cross_entropy(&targets)?;
        let scaled = precision.scale(&unscaled)?;
        loss = Some(unscaled);
        Ok(scaled)
    };
    let mut grads = match ddp {
        // The forward pass runs inside, so an error on one rank stops every rank; the gradients
        // come back averaged over the ranks.
        Some(ddp) => ddp.backward(&*model, &tape, size, forward)?,
        None => tape.backward(&forward()?)?,
    };
    if precision.unscale(&mut grads)? {
        opt.step(model, &grads)?;
    }
    let loss = loss.expect("the forward pass ran");
    Ok((loss.value().to_scalar::<f32>()?, b.stats().peak_bytes))
}

/// Greedy completions of the held-out problems' sums, in a scope of `m`: exact-match accuracy and
/// a few examples.
fn held_out_accuracy<'m>(
    m: &Scope<'m>,
    model: &Gpt<'m>,
    task: &Addition,
    precision: &common::Precision,
) -> Result<(f64, Vec<String>)> {
    m.named_scope("eval", |e| {
        precision.enter(e)?;
        let n = task.held_out.len();
        let mut seqs: Vec<Vec<i64>> = task.held_out.iter().map(|p| p[..6].to_vec()).collect();
        for len in 6..9 {
            let flat: Vec<i64> = seqs.iter().flatten().copied().collect();
            let ids = e.from_slice(&flat, &[n, len])?;
            let tape = Tape::no_grad(e);
            let next = model
                .logits(&tape, &ids, Mode::Eval, false)?
                .value()
                .narrow(1, len - 1, 1)?
                .argmax(-1, false)?
                .to_vec::<i64>()?;
            seqs.iter_mut().zip(next).for_each(|(s, t)| s.push(t));
        }
        let correct = seqs
            .iter()
            .zip(&task.held_out)
            .filter(|(s, p)| s[..] == p[..])
            .count();
        let shown = seqs
            .iter()
            .zip(&task.held_out)
            .take(6)
            .map(|(s, p)| {
                let mark = if s[..] == p[..] { "ok" } else { "wrong" };
                format!(
                    "{} ({mark}, {})",
                    Addition::show(s),
                    Addition::show(&p[6..])
                )
            })
            .collect();
        Ok((correct as f64 / n as f64, shown))
    })
}

/// `len` characters sampled from the model after the text's first character, at temperature 0.8.
fn sample<'m>(
    m: &Scope<'m>,
    model: &Gpt<'m>,
    text: &Text,
    rng: &mut Rng,
    len: usize,
    precision: &common::Precision,
) -> Result<String> {
    let mut ids = vec![text.ids[0]];
    m.named_scope("sample", |e| {
        precision.enter(e)?;
        for _ in 0..len {
            let window = &ids[ids.len().saturating_sub(text.context)..];
            let x = e.from_slice(window, &[1, window.len()])?;
            let tape = Tape::no_grad(e);
            let logits = model.logits(&tape, &x, Mode::Eval, false)?;
            let probs = logits
                .value()
                .narrow(1, window.len() - 1, 1)?
                .to_dtype(DType::F32)?
                .div_scalar(0.8)?
                .softmax(-1)?
                .to_vec::<f32>()?;
            let mut u = rng.uniform() as f32;
            let next = probs
                .iter()
                .position(|&p| {
                    u -= p;
                    u <= 0.0
                })
                .unwrap_or(probs.len() - 1);
            ids.push(next as i64);
        }
        Ok(ids.iter().map(|&i| text.chars[i as usize]).collect())
    })
}

fn run(o: &Options) -> Result<()> {
    let group = common::process_group(o.distributed, o.timeout)?;
    let (rank, world) = (group.rank(), group.world_size());
    // Rank 0 speaks for the job.
    macro_rules! say {
        ($($arg:tt)*) => { if rank == 0 { println!($($arg)*) } };
    }
    let started = Instant::now();
    let mut rng = Rng(o.seed);
    let job = match &o.text {
        Some(path) => {
            let text = Text::load(path, o.context)?;
            say!(
                "data: {path}: {} characters, {} distinct",
                text.ids.len(),
                text.chars.len()
            );
            Job::Text(text)
        }
        None => {
            let add = Addition::new(&mut rng);
            say!(
                "data: two-digit addition, {} training problems, {} held out (never trained on)",
                add.train.len(),
                add.held_out.len()
            );
            Job::Addition(add)
        }
    };
    let task = job.task();
    if o.distributed {
        // The same problems on every rank (drawn above from the shared seed), each rank's own batches.
        rng = Rng(o.seed ^ (rank as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        say!(
            "distributed: {world} ranks over {}, {} sequences per rank and step (global batch {})",
            group.transport_name(),
            o.batch_size,
            o.batch_size * world
        );
    }
    let steps = o.steps.unwrap_or(match job {
        Job::Addition(_) => 1000,
        Job::Text(_) => 3000,
    });
    let schedule = WarmupCosine::new(o.lr, steps / 20, steps)?.with_min(o.lr / 10.0);
    let report_every = (steps / 10).max(1);
    let mut ws = match o.workspace.as_str() {
        "planned" => Some(Workspace::planned("batch")),
        "bump" => Some(Workspace::new("batch")),
        _ => None,
    };
    let mut precision = common::Precision::new(o.dtype);

    root(o.device, |s| {
        s.set_seed(o.seed);
        s.named_scope("model", |m| {
            let mut model = Gpt::new(m, task.vocab(), task.context(), o)?;
            model.name_by_path(""); // dumps list each parameter by its path
            // Every rank built the same model; rank 0's initial values become everyone's.
            let ddp = if o.distributed {
                Some(DataParallel::new(&group, &mut model)?)
            } else {
                None
            };
            let mut sync_seconds = 0.0;
            let mut opt = Adam::new(m, &model, AdamConfig::adamw(o.lr, 0.01))?;
            // From here on a tensor made in the model scope while a step runs is an error, not a leak.
            m.set_strict(true);
            say!(
                "model: {} blocks of width {}, {} heads, context {}, {} parameters; AdamW, batch {}, \
                 lr {} (warm-up {} steps, cosine to {}), {} steps, {}, seed {}{}; batch scope: {}",
                o.layers,
                o.width,
                o.heads,
                task.context(),
                model.parameter_elements(),
                o.batch_size,
                o.lr,
                steps / 20,
                o.lr / 10.0,
                steps,
                precision.describe(),
                o.seed,
                if o.recompute { ", blocks recomputed" } else { "" },
                match o.workspace.as_str() {
                    "none" => "the pool",
                    kind => kind,
                }
            );
            let model_at_start = m.stats();
            let mut loss_sum = 0.0f64;
            let mut batch_peak = 0;
            let mut before = m.stats();
            let mut training = std::time::Duration::ZERO;
            for step in 0..steps {
                opt.set_learning_rate(schedule.lr(step));
                let batch = task.batch(&mut rng, o.batch_size);
                let step_started = Instant::now();
                let (loss, peak) = match &mut ws {
                    Some(ws) => m.workspace(ws, |b| {
                        train_step(b, &mut model, &mut opt, &mut precision, ddp.as_ref(), task, &batch, o)
                    })?,
                    None => m.named_scope("batch", |b| {
                        train_step(b, &mut model, &mut opt, &mut precision, ddp.as_ref(), task, &batch, o)
                    })?,
                };
                if let Some(ddp) = &ddp
                    && step >= WARM_UP_STEPS
                {
                    sync_seconds += ddp.last_sync().seconds;
                }
                if step >= WARM_UP_STEPS {
                    training += step_started.elapsed();
                }
                loss_sum += f64::from(loss);
                batch_peak = batch_peak.max(peak);
                if (step + 1) % report_every == 0 {
                    // Each rank saw its own sequences: the job's loss is the mean over the ranks.
                    loss_sum = common::mean_over_ranks(&group, m, loss_sum)?;
                    let after = m.stats();
                    let quality = match &job {
                        Job::Addition(add) => format!(
                            "  held-out exact {:5.1}%",
                            held_out_accuracy(m, &model, add, &precision)?.0 * 100.0
                        ),
                        Job::Text(_) => String::new(),
                    };
                    say!(
                        "step {:>5}  loss {:.4}{quality}  | model: {} tensors, {} B live | \
                         batch: peak {} B, {} allocs/step, {} from system | {:.0} s",
                        step + 1,
                        loss_sum / report_every as f64,
                        after.live_tensors,
                        after.live_bytes,
                        batch_peak,
                        (after.allocations - before.allocations) / report_every,
                        after.system_allocations - before.system_allocations,
                        started.elapsed().as_secs_f64()
                    );
                    loss_sum = 0.0;
                    before = m.stats();
                }
            }
            let end = m.stats();
            let timed = steps.saturating_sub(WARM_UP_STEPS) as f64;
            say!(
                "\ntraining: {:.0} steps/s after the first {WARM_UP_STEPS} (the loss read back every step)",
                timed / training.as_secs_f64()
            );
            if let Some(ddp) = &ddp {
                let last = ddp.last_sync();
                say!(
                    "all-reduce: {:.2} ms/step, {:.0}% of the step ({} bucket(s), {} B per step)",
                    sync_seconds * 1e3 / timed,
                    sync_seconds / training.as_secs_f64() * 100.0,
                    last.buckets,
                    last.bytes
                );
            }
            let arena = ws.as_ref().map_or_else(String::new, |ws| {
                format!(
                    "; workspace arena {} B after {} cycles ({} spills in the last)",
                    ws.capacity(),
                    ws.cycles(),
                    ws.last_cycle_spills()
                )
            });
            say!(
                "model scope: {} live bytes at the start, {} at the end{arena}; batch scope peak {} B; \
                 process peak resident (VmHWM) {} MiB",
                model_at_start.live_bytes,
                end.live_bytes,
                batch_peak,
                common::status_bytes("VmHWM").unwrap_or(0) >> 20
            );
            if let Some(line) = ws.as_ref().and_then(common::plan_summary) {
                say!("{line}");
            }
            if let Some(line) = precision.report() {
                say!("{line}");
            }
            match &job {
                Job::Addition(add) => {
                    let (acc, shown) = held_out_accuracy(m, &model, add, &precision)?;
                    say!("held-out exact match: {:.1}%; completions:", acc * 100.0);
                    for line in shown {
                        say!("  {line}");
                    }
                }
                Job::Text(text) => {
                    say!("sample:\n{}", sample(m, &model, text, &mut rng, 300, &precision)?);
                }
            }
            say!("\nscope tree at the end of training:\n{}", s.dump());
            Ok::<_, Error>(())
        })
    })?;
    say!("done in {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}

fn main() {
    common::main_with(USAGE, Options::parse, run);
}
