//! A Llama-3.2-1B-shaped model on the CPU (hidden 2048, 16 layers, 32 query / 8 key-value heads, MLP
//! 8192, vocabulary 128,256, a tied head; random weights in bf16, written once by
//! `benches/llama_reference.py make` to `target/llama-1b-random/`): loading (its time, and the peak
//! resident memory of the bf16 load), the forward pass of 512 tokens and the forward+backward pass
//! of 256 (f32 and bf16 weights), batch-1 decoding against the machine's read bandwidth, and eight
//! requests decoded together by the engine.
//! `benches/llama_reference.py step` measures transformers and PyTorch on the same directory.
//!
//! ```text
//! python3 benches/llama_reference.py make     # the checkpoint (2.5 GB), once
//! RAYON_NUM_THREADS=2 cargo bench --bench llama
//! python3 benches/llama_reference.py step
//! ```
//!
//! `NDSCOPE_BENCH_DEVICE=cuda:0` (a build with `--features cuda`) runs the same work on a GPU, beside
//! `python3 benches/llama_reference.py step DIR cuda`; there the decoding line has no bandwidth bound
//! (the bound is the host's) and the load's peak is not measured (it is the host's resident memory).
//!
//! Each pass takes seconds, so this bench times medians of a few runs itself (after a warm-up run)
//! rather than through criterion's sampling.

mod common;

use std::hint::black_box;
use std::path::Path;
use std::time::{Duration, Instant};

use ndscope::kv::{CausalLm, KvPool};
use ndscope::models::Llama;
use ndscope::nn::{Mode, Parameters};
use ndscope::serve::{Engine, EngineConfig, GenerateOptions, Request, generate};
use ndscope::{DType, Device, Result, Scope, Tape, gpu_memory, root};

const DIR: &str = "target/llama-1b-random";
const RUNS: usize = 3;

/// Where the model runs: `NDSCOPE_BENCH_DEVICE` (`cpu`, `cuda:N`), the CPU when unset.
fn bench_device() -> Result<Device> {
    match std::env::var("NDSCOPE_BENCH_DEVICE") {
        Ok(text) => text.parse(),
        Err(_) => Ok(Device::Cpu),
    }
}

/// The median of `runs` timings of `work`, after one untimed run.
fn median(runs: usize, work: impl FnMut() -> Result<()>) -> Result<Duration> {
    Ok(median_and_faults(runs, work)?.0)
}

/// [`median`], and the pages faulted in by the last run (memory the pass mapped anew rather than
/// reused: each such page costs the kernel a zeroing; `None` where the count is not available).
fn median_and_faults(
    runs: usize,
    mut work: impl FnMut() -> Result<()>,
) -> Result<(Duration, Option<u64>)> {
    work()?;
    let mut times = Vec::with_capacity(runs);
    let mut faults = None;
    for _ in 0..runs {
        let before = common::minor_faults();
        let start = Instant::now();
        work()?;
        times.push(start.elapsed());
        faults = before.zip(common::minor_faults()).map(|(a, b)| b - a);
    }
    times.sort();
    Ok((times[runs / 2], faults))
}

/// ", N pages faulted in by the last run" for a count, nothing without one.
fn faulted(faults: Option<u64>) -> String {
    faults.map_or(String::new(), |n| {
        format!(", {n} pages faulted in by the last run")
    })
}

/// The token ids of `benches/llama_reference.py`.
fn ids(len: usize) -> Vec<i64> {
    (0..len as i64).map(|i| (i * 7919 + 13) % 128_256).collect()
}

/// Bytes per second summing 1 GiB of f32 with two threads, each its own half: the bytes one decode
/// step streams, at the rate the machine reads them.
fn read_bandwidth() -> f64 {
    let data = vec![1.0f32; 256 << 20];
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let start = Instant::now();
        let total = common::streamed_sum(&data, 2);
        black_box(total);
        best = best.min(start.elapsed().as_secs_f64());
    }
    (data.len() * 4) as f64 / best
}

fn passes<'m>(m: &Scope<'m>, model: &Llama<'m>, label: &str) -> Result<()> {
    let forward = ids(512);
    let (t, faults) = median_and_faults(RUNS, || {
        m.scope(|b| {
            let x = b.from_slice(&forward, &[1, 512])?;
            let tape = Tape::no_grad(b);
            let logits = model.forward(&tape, &x, Mode::Eval)?;
            // Read back, so that a GPU's queued work is inside the timing.
            black_box(
                logits
                    .value()
                    .narrow(1, 511, 1)?
                    .to_dtype(DType::F32)?
                    .sum_all()?
                    .to_scalar::<f32>()?,
            );
            Ok(())
        })
    })?;
    println!(
        "llama_1b/forward_512/{label}: {:.3} s{}",
        t.as_secs_f64(),
        faulted(faults)
    );
    let train = ids(257);
    let (t, faults) = median_and_faults(RUNS, || {
        m.scope(|b| {
            let x = b.from_slice(&train[..256], &[1, 256])?;
            let labels = b.from_slice(&train[1..], &[256])?;
            let tape = Tape::new(b);
            let logits = model.forward(&tape, &x, Mode::Train)?;
            let loss = logits.reshape(&[256, 128_256])?.cross_entropy(&labels)?;
            let grads = tape.backward(&loss)?;
            black_box(grads.len());
            // The loss read after the backward pass is queued waits for it on a GPU's stream.
            black_box(loss.value().to_dtype(DType::F32)?.to_scalar::<f32>()?);
            Ok(())
        })
    })?;
    println!(
        "llama_1b/forward_backward_256/{label}: {:.3} s{}",
        t.as_secs_f64(),
        faulted(faults)
    );
    Ok(())
}

fn decoding<'m>(m: &Scope<'m>, model: &Llama<'m>, label: &str, weight_bytes: f64) -> Result<()> {
    let pool = KvPool::for_tokens(m, model.kv_shape(), 16, 8 * 64)?;
    let prompt = ids(16);
    let options = GenerateOptions::greedy(32).with_min_new_tokens(32);
    // One request: the prompt's pass, then 31 single-token steps. The prompt's pass is timed
    // apart, so that the step rate counts the steps alone.
    let mut prefills = Vec::new();
    let mut wholes = Vec::new();
    for run in 0..=RUNS {
        let start = Instant::now();
        m.scope(|s| {
            let mut cache = pool.cache(s, 16)?;
            s.scope(|step| {
                model
                    .decode(step, &pool, &mut [&mut cache], &[&prompt])
                    .map(drop)
            })
        })?;
        let prefill = start.elapsed();
        let start = Instant::now();
        black_box(generate(model, m, &pool, &prompt, &options)?.tokens);
        if run > 0 {
            prefills.push(prefill);
            wholes.push(start.elapsed());
        }
    }
    prefills.sort();
    wholes.sort();
    let (prefill, t) = (prefills[RUNS / 2], wholes[RUNS / 2]);
    let step_rate = 31.0 / (t - prefill).as_secs_f64();
    if m.device().is_cuda() {
        println!(
            "llama_1b/decode_batch1/{label}: 32 tokens in {:.3} s; {step_rate:.2} tokens/s after \
             the prompt ({:.0} GB/s of weights)",
            t.as_secs_f64(),
            step_rate * weight_bytes / 1e9
        );
        queue_and_wait(m, model, &pool, &prompt, label)?;
    } else {
        let bound = read_bandwidth() / weight_bytes;
        println!(
            "llama_1b/decode_batch1/{label}: 32 tokens in {:.3} s; {step_rate:.2} tokens/s after \
             the prompt; the read bandwidth bounds it at {bound:.2} tokens/s ({:.0} % of the bound)",
            t.as_secs_f64(),
            100.0 * step_rate / bound
        );
    }
    let t8 = median(RUNS, || {
        let mut engine = Engine::new(model, &pool, EngineConfig { max_batch: 8 });
        for r in 0..8 {
            let mut p = prompt.clone();
            p[0] = r;
            engine.submit(Request {
                prompt: p,
                options: options.clone(),
                arrival: 0,
            })?;
        }
        black_box(engine.run(m, |_| ())?);
        Ok(())
    })?;
    println!(
        "llama_1b/engine_8_requests/{label}: 8 x 32 tokens in {:.3} s: {:.2} tokens/s, {:.2}x one \
         request's {:.2}",
        t8.as_secs_f64(),
        256.0 / t8.as_secs_f64(),
        (256.0 / t8.as_secs_f64()) / (32.0 / t.as_secs_f64()),
        32.0 / t.as_secs_f64()
    );
    Ok(())
}

/// Where a GPU decoding step's time goes: queueing the step's kernels (`decode` returns once they
/// are queued) against waiting for their logits, and how often the host waited for the GPU (a step
/// that waits more than once takes turns with the GPU instead of queueing ahead of it).
fn queue_and_wait<'m>(
    m: &Scope<'m>,
    model: &Llama<'m>,
    pool: &KvPool<'_>,
    prompt: &[i64],
    label: &str,
) -> Result<()> {
    const STEPS: u32 = 31;
    let device = m.device();
    m.scope(|r| {
        let mut cache = pool.cache(r, 64)?;
        r.scope(|step| {
            let logits = model.decode(step, pool, &mut [&mut cache], &[prompt])?;
            black_box(logits.to_vec::<f32>()?);
            Ok(())
        })?;
        let waits_before = gpu_memory(device)?.host_waits;
        let (mut queued, mut waited) = (Duration::ZERO, Duration::ZERO);
        for i in 0..STEPS {
            r.scope(|step| {
                let start = Instant::now();
                let token = [i64::from(i % 7) + 3];
                let logits = model.decode(step, pool, &mut [&mut cache], &[&token])?;
                let done = Instant::now();
                black_box(logits.to_dtype(DType::F32)?.to_vec::<f32>()?);
                queued += done - start;
                waited += done.elapsed();
                Ok(())
            })?;
        }
        let waits = gpu_memory(device)?.host_waits - waits_before;
        println!(
            "llama_1b/decode_batch1/{label}: a step queued in {:.2} ms, then {:.2} ms waiting for \
             its logits; {:.1} host waits a step",
            queued.as_secs_f64() * 1e3 / f64::from(STEPS),
            waited.as_secs_f64() * 1e3 / f64::from(STEPS),
            waits as f64 / f64::from(STEPS)
        );
        Ok(())
    })
}

/// A line of `/proc/self/status` in bytes (`VmRSS`, `VmHWM`), where Linux has it.
fn status_bytes(key: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(&format!("{key}:")))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The process's peak resident memory while loading the bf16 checkpoint as bf16, against the
/// weights' bytes: first in the process, so that the high-water mark is the load's. (The loader
/// drops the mapped file's pages from the process as it copies them, so the file's bytes do not
/// count twice.)
fn load_peak() -> Result<()> {
    let Some(before) = status_bytes("VmRSS") else {
        println!("llama_1b/load_peak/bf16: no /proc/self/status here, not measured");
        return Ok(());
    };
    root(Device::Cpu, |m| {
        let model = Llama::from_pretrained(m, DIR, DType::BF16)?;
        let weights = (model.parameter_elements() * 2) as f64;
        let peak = status_bytes("VmHWM").unwrap_or(before);
        println!(
            "llama_1b/load_peak/bf16: resident {:.3} GB before, peak {:.3} GB: the load added {:.3} \
             GB = {:.3}x the weights' {:.3} GB",
            before as f64 / 1e9,
            peak as f64 / 1e9,
            (peak - before) as f64 / 1e9,
            (peak - before) as f64 / weights,
            weights / 1e9
        );
        Ok(())
    })
}

fn main() -> Result<()> {
    if !Path::new(DIR).join("config.json").is_file() {
        eprintln!(
            "llama bench: no checkpoint at {DIR}; make it with `python3 benches/llama_reference.py make`"
        );
        return Ok(());
    }
    common::warn_if_cpu_busy("llama bench");
    // Criterion-style arguments: `--bench` is ignored; a filter keeps the parts whose name holds it
    // (`load_peak`, `passes`, `decode`) and the dtypes whose label does (`f32`, `bf16`).
    let filter = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let wanted = |name: &str| filter.as_ref().is_none_or(|f| name.contains(f.as_str()));
    let device = bench_device()?;
    device.check_available()?;
    if device.is_cuda() {
        println!("llama_1b: on {device}");
    } else if wanted("load_peak") {
        load_peak()?;
    }
    for (dtype, label) in [(DType::F32, "f32"), (DType::BF16, "bf16")] {
        let (run_passes, run_decode) = (
            wanted(&format!("passes/{label}")),
            wanted(&format!("decode/{label}")),
        );
        if !run_passes && !run_decode {
            continue;
        }
        root(device, |m| {
            let start = Instant::now();
            let model = Llama::from_pretrained(m, DIR, dtype)?;
            let weight_bytes = model.parameter_elements() as f64 * dtype.size() as f64;
            println!(
                "llama_1b/load/{label}: {:.3} s, {:.2} GB of weights",
                start.elapsed().as_secs_f64(),
                weight_bytes / 1e9
            );
            if run_passes {
                passes(m, &model, label)?;
            }
            if run_decode {
                decoding(m, &model, label, weight_bytes)?;
            }
            Ok(())
        })?;
    }
    Ok(())
}
