//! The memory of a big model's training step: a GPT-2-small-shaped model (12 blocks of width 768,
//! 124M parameters, random weights), batch 1, 1,024 tokens, forward + backward + AdamW, with or
//! without activation checkpointing, in a plain batch scope or a bump or planned workspace. One
//! configuration per process, so the process's peak resident set (`VmHWM`) is its own:
//!
//! ```text
//! cargo run --release --example big_model_memory -- --workspace none
//! cargo run --release --example big_model_memory -- --workspace none --recompute
//! cargo run --release --example big_model_memory -- --workspace planned
//! ```
//!
//! It prints the batch scope's peak bytes (every tensor of the step, the checkpointed segments'
//! scopes included), the median step time, and the process's peak resident set against its size
//! once the model and the optimizer are built. The model scope is strict: the step could not charge
//! a tensor to it.

use std::time::Instant;

use ndscope::models::{Gpt2, Gpt2Config};
use ndscope::nn::{Mode, Parameters};
use ndscope::optim::{Adam, AdamConfig, Optimizer};
use ndscope::{Device, Error, Result, Scope, Tape, Workspace, root};

#[allow(dead_code)] // the training helpers of examples/common; this example needs the entry point
mod common;

const USAGE: &str = "\
Peak memory and time of a GPT-2-small-shaped training step (random weights, batch 1).

USAGE: cargo run --release --example big_model_memory -- [OPTIONS]

OPTIONS:
  --recompute         recompute every block's activations in the backward pass (activation
                      checkpointing; --checkpoint is the old spelling)
  --workspace W       none (a plain batch scope), bump or planned       [default: none]
  --steps N           training steps; the first is not timed            [default: 4]
  --len N             tokens                                            [default: 1024]
  --layers N          blocks                                            [default: 12]
  --width N           model width                                       [default: 768]
  --heads N           attention heads                                   [default: 12]
  --vocab N           vocabulary                                        [default: 50257]
  --device D          cpu, or cuda:N (needs --features cuda)            [default: cpu]
  --help              this text";

#[derive(Debug, Clone, Copy, PartialEq)]
enum Arena {
    None,
    Bump,
    Planned,
}

#[derive(Debug)]
struct Options {
    recompute: bool,
    arena: Arena,
    steps: usize,
    len: usize,
    layers: usize,
    width: usize,
    heads: usize,
    vocab: usize,
    device: Device,
}

impl Options {
    fn parse(mut args: impl Iterator<Item = String>) -> std::result::Result<Options, String> {
        let mut o = Options {
            recompute: false,
            arena: Arena::None,
            steps: 4,
            len: 1024,
            layers: 12,
            width: 768,
            heads: 12,
            vocab: 50257,
            device: Device::Cpu,
        };
        while let Some(arg) = args.next() {
            let mut value = |name: &str| args.next().ok_or_else(|| format!("{name} needs a value"));
            let number = |name: &str, v: String| {
                v.parse::<usize>()
                    .ok()
                    .filter(|&n| n > 0)
                    .ok_or_else(|| format!("{name} takes a positive whole number, not {v:?}"))
            };
            match arg.as_str() {
                "--help" | "-h" => return Err(String::new()),
                "--recompute" | "--checkpoint" => o.recompute = true,
                "--workspace" => {
                    o.arena = match value("--workspace")?.as_str() {
                        "none" => Arena::None,
                        "bump" => Arena::Bump,
                        "planned" => Arena::Planned,
                        other => {
                            return Err(format!(
                                "--workspace takes none, bump or planned, not {other:?}"
                            ));
                        }
                    }
                }
                "--steps" => o.steps = number("--steps", value("--steps")?)?,
                "--len" => o.len = number("--len", value("--len")?)?,
                "--layers" => o.layers = number("--layers", value("--layers")?)?,
                "--width" => o.width = number("--width", value("--width")?)?,
                "--heads" => o.heads = number("--heads", value("--heads")?)?,
                "--vocab" => o.vocab = number("--vocab", value("--vocab")?)?,
                "--device" => {
                    o.device = value("--device")?
                        .parse()
                        .map_err(|e: Error| e.to_string())?;
                }
                other => return Err(format!("unknown option {other:?}")),
            }
        }
        if o.steps < 2 {
            return Err("--steps needs at least 2 (the first is not timed)".into());
        }
        Ok(o)
    }
}

fn mib(bytes: usize) -> String {
    format!("{:.0} MiB", bytes as f64 / (1024.0 * 1024.0))
}

/// What one step measured.
struct Measured {
    loss: f32,
    /// The batch scope's peak bytes over the step.
    peak: usize,
    /// Its live bytes once the loss is computed: what the tape keeps for the backward pass.
    after_forward: usize,
}

/// One training step in `b`: the next-token loss over the sequence, backward, AdamW.
fn step<'m: 'b, 'b>(
    b: &'b Scope<'b>,
    model: &mut Gpt2<'m>,
    opt: &mut Adam<'m>,
    ids: &[i64],
) -> Result<Measured> {
    let tape = Tape::new(b);
    let ids = b.from_slice(ids, &[1, ids.len()])?;
    // The logits go when the loss no longer needs them (the loss's backward step), not at the end.
    let loss = Gpt2::loss(&model.forward(&tape, &ids, Mode::Train)?, &ids)?;
    let after_forward = b.stats().subtree_bytes;
    let grads = tape.backward(&loss)?;
    opt.step(model, &grads)?;
    Ok(Measured {
        loss: loss.value().to_scalar::<f32>()?,
        peak: b.stats().peak_bytes,
        after_forward,
    })
}

fn run(o: &Options) -> Result<()> {
    let config = Gpt2Config::new(o.vocab, o.len, o.width, o.layers, o.heads);
    let ids: Vec<i64> = (0..o.len as i64)
        .map(|i| (i * 7919) % o.vocab as i64)
        .collect();
    let mut ws = match o.arena {
        Arena::None => None,
        Arena::Bump => Some(Workspace::new("batch")),
        Arena::Planned => Some(Workspace::planned("batch")),
    };
    root(o.device, |s| {
        s.set_seed(7);
        s.named_scope("model", |m| {
            let mut model = Gpt2::new(m, config)?;
            model.set_recompute(o.recompute);
            let mut opt = Adam::new(m, &model, AdamConfig::adamw(1e-4, 0.01))?;
            m.set_strict(true);
            let built = common::status_bytes("VmRSS:").unwrap_or(0);
            println!(
                "GPT-2 shape: {} blocks of width {}, {} heads, vocab {}, {} tokens, {} parameters; \
                 {}, {}",
                o.layers,
                o.width,
                o.heads,
                o.vocab,
                o.len,
                model.parameter_elements(),
                if o.recompute {
                    "every block recomputed"
                } else {
                    "no checkpointing"
                },
                match o.arena {
                    Arena::None => "plain batch scope (pool only)",
                    Arena::Bump => "bump workspace",
                    Arena::Planned => "planned workspace",
                }
            );
            let mut times = Vec::new();
            let (mut peak, mut after_forward) = (0, 0);
            for k in 0..o.steps {
                let started = Instant::now();
                let measured = match &mut ws {
                    None => m.named_scope("batch", |b| step(b, &mut model, &mut opt, &ids))?,
                    Some(ws) => m.workspace(ws, |b| step(b, &mut model, &mut opt, &ids))?,
                };
                let took = started.elapsed();
                println!(
                    "step {}: loss {:.4}, {:.2} s",
                    k + 1,
                    measured.loss,
                    took.as_secs_f64()
                );
                if k > 0 {
                    times.push(took);
                }
                peak = peak.max(measured.peak);
                after_forward = after_forward.max(measured.after_forward);
            }
            times.sort();
            let median = times[times.len() / 2];
            let hwm = common::status_bytes("VmHWM:").unwrap_or(0);
            println!(
                "batch scope peak {} ({peak} B), {} live after the forward pass; median step {:.3} s; \
                 process peak (VmHWM) {}, {} above the model and optimizer ({}); pool cache now {}",
                mib(peak),
                mib(after_forward),
                median.as_secs_f64(),
                mib(hwm),
                mib(hwm.saturating_sub(built)),
                mib(built),
                mib(m.memory_stats(o.device).cached_bytes),
            );
            if o.device != Device::Cpu {
                // On a GPU the process's resident set is the host's; the device pool's peak is its own.
                let pool = m.memory_stats(o.device);
                println!(
                    "{} pool: peak reserved {}, peak allocated {}",
                    o.device,
                    mib(pool.peak_reserved_bytes),
                    mib(pool.peak_allocated_bytes)
                );
            }
            if let Some(ws) = &ws {
                println!("workspace arena {}", mib(ws.capacity()));
                if let Some(line) = common::plan_summary(ws) {
                    println!("{line}");
                }
            }
            Ok::<_, Error>(())
        })
    })
}

fn main() {
    common::main_with(USAGE, Options::parse, run);
}
