//! Work shared by the benchmarks, so that each comparison measures the same code.
#![allow(dead_code)]

use ndscope::nn::{Mode, Module, Sequential};
use ndscope::optim::{Adam, Optimizer};
use ndscope::{Result, Scope, Tape, Tensor};

/// GPT-2 small with random weights (seed 7), the checkpoint the GPT-2 benches and their PyTorch
/// scripts read.
pub const GPT2_SMALL: &str = "target/gpt2-small-random";

/// Writes [`GPT2_SMALL`] unless it is there.
pub fn ensure_gpt2_small() -> Result<()> {
    use ndscope::models::{Gpt2, Gpt2Config};
    if std::path::Path::new(GPT2_SMALL)
        .join("model.safetensors")
        .is_file()
    {
        return Ok(());
    }
    ndscope::root(ndscope::Device::Cpu, |s| {
        s.set_seed(7);
        // GPT-2 small's configuration (`GPT2Config()` in transformers).
        Gpt2::new(s, Gpt2Config::new(50257, 1024, 768, 12, 12))?.save_pretrained(GPT2_SMALL)
    })
}

/// Twenty elementwise ops, each producing a new temporary; `tanh` swaps one op of each group of four
/// for a transcendental one.
pub fn chain<'s>(x: &Tensor<'s>, tanh: bool) -> Result<Tensor<'s>> {
    let mut y = x.clone();
    for _ in 0..5 {
        let z = y.add_scalar(1.0)?.mul_scalar(0.5)?;
        let z = if tanh { z.tanh()? } else { z.maximum(x)? };
        y = z.add(x)?;
    }
    Ok(y)
}

/// One step in the batch scope `b` on the inputs `x` and labels `y` (model-scope tensors, so that
/// creating the batch is not measured).
pub fn train_step<'m: 'b, 'b>(
    b: &'b Scope<'b>,
    model: &mut Sequential<'m>,
    opt: &mut Adam<'m>,
    x: &Tensor<'m>,
    y: &Tensor<'m>,
) -> Result<f32> {
    let tape = Tape::new(b);
    let loss = model
        .forward(&tape.constant(x), Mode::Train)?
        .cross_entropy(y)?;
    let grads = tape.backward(&loss)?;
    opt.step(model, &grads)?;
    loss.value().to_scalar::<f32>()
}

/// The sum of `data` read by `threads` threads, each its own part, sixteen lanes each so that the
/// compiler vectorises the additions and memory, not one chain of dependent additions, bounds the
/// time: the read bandwidth a decoding step, which streams every weight once, can reach.
pub fn streamed_sum(data: &[f32], threads: usize) -> f32 {
    std::thread::scope(|s| {
        let parts: Vec<_> = data
            .chunks(data.len().div_ceil(threads.max(1)))
            .map(|part| {
                s.spawn(move || {
                    let mut lanes = [0.0f32; 16];
                    for chunk in part.chunks_exact(16) {
                        for (l, x) in lanes.iter_mut().zip(chunk) {
                            *l += x;
                        }
                    }
                    lanes.iter().sum::<f32>()
                })
            })
            .collect();
        parts.into_iter().map(|p| p.join().unwrap()).sum()
    })
}

/// One GPT-2 pass over `ids` (batch 1) in a child scope of `m`, with autocast to `autocast` if
/// given: with `backward`, the forward and backward passes of the language-model loss, returning
/// the loss; else the forward pass, returning the sum of the last position's logits. Reading the
/// result waits for the device.
pub fn gpt2_pass<'m>(
    m: &Scope<'m>,
    model: &ndscope::models::Gpt2<'m>,
    ids: &[i64],
    autocast: Option<ndscope::DType>,
    backward: bool,
) -> Result<f32> {
    m.scope(|b| {
        if let Some(dtype) = autocast {
            b.autocast(dtype)?;
        }
        let len = ids.len();
        let x = b.from_slice(ids, &[1, len])?;
        if !backward {
            let tape = Tape::no_grad(b);
            let logits = model.forward(&tape, &x, Mode::Eval)?;
            let last = logits.value().narrow(1, len - 1, 1)?;
            return last.to_dtype(ndscope::DType::F32)?.sum_all()?.to_scalar();
        }
        let tape = Tape::new(b);
        let logits = model.forward(&tape, &x, Mode::Train)?;
        let loss = ndscope::models::Gpt2::loss(&logits, &x)?;
        drop(tape.backward(&loss)?);
        loss.value().to_scalar()
    })
}

/// The process's minor page faults so far (`/proc/self/stat`'s tenth field): pages the kernel mapped
/// in, zeroing each, when first touched. `None` off Linux.
pub fn minor_faults() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The command name (second field) may hold spaces; the fields after its `)` are plain.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(7)?.parse().ok()
}

/// Warns on standard error when other processes kept the CPUs busy just before a bench: a leftover
/// build or a stray process on a 2-core machine halves every figure that follows, and nothing in
/// the figures says so (BENCHMARKS.md, issue 35, twenty-ninth measurement: an orphaned compiler
/// took one of two cores for an hour of measurements). Reads Linux's `/proc/stat` over a quarter of
/// a second, while this process waits; elsewhere it says nothing.
pub fn warn_if_cpu_busy(bench: &str) {
    let Some(before) = cpu_ticks() else { return };
    std::thread::sleep(std::time::Duration::from_millis(250));
    let Some(after) = cpu_ticks() else { return };
    let total = after.total.saturating_sub(before.total);
    if total == 0 {
        return;
    }
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    let share = |ticks: u64| ticks as f64 / total as f64 * cpus;
    let (busy, stolen) = (
        share(after.busy.saturating_sub(before.busy)),
        share(after.stolen.saturating_sub(before.stolen)),
    );
    if busy > 0.15 || stolen > 0.15 {
        eprintln!(
            "{bench}: before measuring, other processes kept {busy:.2} of {cpus} CPUs busy and the \
             host took {stolen:.2} (`top` shows which processes); the figures below will be low"
        );
    }
}

/// `/proc/stat`'s first line in clock ticks: all of them, those spent working (user, nice, system,
/// interrupts), and those the host took from this virtual machine (steal).
struct CpuTicks {
    total: u64,
    busy: u64,
    stolen: u64,
}

fn cpu_ticks() -> Option<CpuTicks> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let fields: Vec<u64> = stat
        .lines()
        .next()?
        .strip_prefix("cpu ")?
        .split_whitespace()
        .map(|f| f.parse().ok())
        .collect::<Option<_>>()?;
    // user nice system idle iowait irq softirq steal (guest time is counted in user already).
    let field = |i: usize| fields.get(i).copied().unwrap_or(0);
    Some(CpuTicks {
        total: (0..8).map(field).sum(),
        busy: field(0) + field(1) + field(2) + field(5) + field(6),
        stolen: field(7),
    })
}
