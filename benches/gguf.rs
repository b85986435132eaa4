//! Models computing on GGUF files' quantized blocks on the CPU, the figures `llama-bench` reports
//! for the same files: prompt processing (`pp512`: one pass over 512 tokens) and decoding (`tg128`:
//! 128 tokens one at a time, here after a 32-token prompt), plus eight requests decoded together by
//! the engine and the resident memory a quantized load adds against the file's tensor bytes.
//!
//! The files are a Llama-3.2-1B-shaped model and the GPT-2 small shape with random weights,
//! converted and quantized by llama.cpp (`benches/gguf_files.py` writes them to `target/`); a file
//! that is missing is skipped with a message.
//!
//! ```text
//! RAYON_NUM_THREADS=2 cargo bench --bench gguf                 # every file and figure
//! RAYON_NUM_THREADS=2 cargo bench --bench gguf -- llama-1b-Q4_0  # a filter on "<file>/<figure>"
//! ```
//!
//! The KV caches keep `f16`, as `llama-bench`'s do by default; `GGUF_BENCH_KV=f32` (or `bf16`)
//! measures another cache dtype.
//!
//! A pass takes up to seconds, so this bench times medians itself (after a warm-up run) rather than
//! through criterion's sampling.

use std::hint::black_box;
use std::path::Path;
use std::time::{Duration, Instant};

mod common;

use ndscope::gguf::Gguf;
use ndscope::kv::{CausalLm, KvPool, KvShape};
use ndscope::models::AutoModel;
use ndscope::serve::{Engine, EngineConfig, GenerateOptions, Request, generate};
use ndscope::{DType, Device, Result, Scope, root};

const FILES: [&str; 9] = [
    "llama-1b-Q8_0",
    "llama-1b-Q4_0",
    "llama-1b-Q4_K_M",
    "llama-1b-Q5_K_M",
    "gpt2-small-Q8_0",
    "gpt2-small-Q4_0",
    "gpt2-small-Q4_K_M",
    "gpt2-small-Q5_K_M",
    // The unquantized conversion: what the quantized files are measured against, beside
    // llama.cpp's f32 decoding (issue 37's row of decoding against the read bandwidth).
    "gpt2-small-f32",
];
const RUNS: usize = 3;

/// The dtype the caches keep: `f16` (llama.cpp's default), or `GGUF_BENCH_KV`'s.
fn kv_dtype() -> Result<DType> {
    match std::env::var("GGUF_BENCH_KV") {
        Ok(name) => name.parse().map_err(|_| ndscope::Error::InvalidArgument {
            op: "gguf bench",
            reason: format!("GGUF_BENCH_KV={name} is not a dtype; give f32, bf16 or f16"),
        }),
        Err(_) => Ok(DType::F16),
    }
}

/// The model's cache shape in the dtype the caches keep here.
fn kv_shape(model: &AutoModel<'_>) -> Result<KvShape> {
    Ok(KvShape {
        dtype: kv_dtype()?,
        ..model.kv_shape()
    })
}

/// The median of `runs` timings of `work`, after one untimed run.
fn median(runs: usize, mut work: impl FnMut() -> Result<()>) -> Result<Duration> {
    work()?;
    let mut times = Vec::with_capacity(runs);
    for _ in 0..runs {
        let start = Instant::now();
        work()?;
        times.push(start.elapsed());
    }
    times.sort();
    Ok(times[runs / 2])
}

/// Token ids spread over the vocabulary (`vocab` rows).
fn ids(len: usize, vocab: usize) -> Vec<i64> {
    (0..len as i64)
        .map(|i| (i * 7919 + 13) % vocab as i64)
        .collect()
}

/// The bytes of the file's tensors (what a loaded model should hold, give or take the norms).
fn tensor_bytes(path: &Path) -> Result<f64> {
    let bytes = std::fs::read(path).map_err(|e| ndscope::Error::Io {
        path: path.display().to_string(),
        reason: e.to_string(),
    })?;
    let file = Gguf::parse(&bytes)?;
    Ok(file
        .tensors
        .iter()
        .map(|t| {
            let cols = t.shape.last().copied().unwrap_or(1);
            let rows: usize = t.shape.iter().rev().skip(1).product();
            t.ty.bytes_for(cols).unwrap_or(0) * rows
        })
        .sum::<usize>() as f64)
}

/// A line of `/proc/self/status` in bytes (`VmRSS`, `VmHWM`), where Linux has it.
fn status_bytes(key: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(&format!("{key}:")))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

fn prompt_processing<'m>(m: &Scope<'m>, model: &AutoModel<'m>, name: &str) -> Result<()> {
    let len = 512.min(model.max_positions());
    let pool = KvPool::for_tokens(m, kv_shape(model)?, 16, len)?;
    let prompt = ids(len, model.vocab_size());
    let t = median(RUNS, || {
        m.scope(|s| {
            let mut cache = pool.cache(s, len)?;
            s.scope(|step| {
                model
                    .decode(step, &pool, &mut [&mut cache], &[&prompt])
                    .map(drop)
            })
        })
    })?;
    println!(
        "gguf/{name}/pp{len}: {:.3} s = {:.1} tokens/s",
        t.as_secs_f64(),
        len as f64 / t.as_secs_f64()
    );
    Ok(())
}

fn decoding<'m>(m: &Scope<'m>, model: &AutoModel<'m>, name: &str, batch8: bool) -> Result<()> {
    let (prompt_len, new) = (32, 128);
    let pool = KvPool::for_tokens(m, kv_shape(model)?, 16, 8 * (prompt_len + new))?;
    let prompt = ids(prompt_len, model.vocab_size());
    let options = GenerateOptions::greedy(new).with_min_new_tokens(new);
    // The prompt's pass is timed apart, so that the rate counts the 128 single-token steps.
    let prefill = median(RUNS, || {
        m.scope(|s| {
            let mut cache = pool.cache(s, prompt_len)?;
            s.scope(|step| {
                model
                    .decode(step, &pool, &mut [&mut cache], &[&prompt])
                    .map(drop)
            })
        })
    })?;
    let whole = median(RUNS, || {
        black_box(generate(model, m, &pool, &prompt, &options)?.tokens);
        Ok(())
    })?;
    let rate = new as f64 / whole.saturating_sub(prefill).as_secs_f64();
    println!("gguf/{name}/tg{new}: {rate:.2} tokens/s after a {prompt_len}-token prompt");
    if !batch8 {
        return Ok(());
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
    let one = (new as f64) / whole.as_secs_f64();
    let eight = 8.0 * new as f64 / t8.as_secs_f64();
    println!(
        "gguf/{name}/engine_8_requests: 8 x {new} tokens in {:.3} s: {eight:.2} tokens/s, {:.2}x \
         one request's {one:.2} (prompts included on both sides)",
        t8.as_secs_f64(),
        eight / one
    );
    Ok(())
}

fn main() -> Result<()> {
    // The main thread computes as one of the workers, as llama.cpp's does in its pool.
    ndscope::threads::work_on_this_thread(None)?;
    // Criterion-style arguments: `--bench` is ignored; a filter keeps the figures whose
    // "<file>/<figure>" holds it (figures: load, pp512, tg128, engine).
    let filter = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    println!("gguf: the KV caches keep {}", kv_dtype()?);
    common::warn_if_cpu_busy("gguf bench");
    let wanted = |name: &str| filter.as_ref().is_none_or(|f| name.contains(f.as_str()));
    for name in FILES {
        let path = Path::new("target").join(format!("{name}.gguf"));
        let figures = ["load", "pp512", "tg128", "engine"].map(|f| wanted(&format!("{name}/{f}")));
        if !figures.contains(&true) {
            continue;
        }
        if !path.is_file() {
            eprintln!(
                "gguf bench: no {}; make it with `python3 benches/gguf_files.py LLAMA_CPP_DIR`",
                path.display()
            );
            continue;
        }
        let before = status_bytes("VmRSS");
        root(Device::Cpu, |m| {
            let start = Instant::now();
            let model = AutoModel::from_gguf_quantized(m, &path, DType::F32)?;
            let loaded = start.elapsed();
            let tensors = tensor_bytes(&path)?;
            let held = m.stats().live_bytes as f64;
            let added = match (before, status_bytes("VmRSS")) {
                (Some(b), Some(a)) => format!(
                    "; resident memory grew {:.3} GB = {:.3}x",
                    (a.saturating_sub(b)) as f64 / 1e9,
                    a.saturating_sub(b) as f64 / tensors
                ),
                _ => String::new(),
            };
            if figures[0] {
                println!(
                    "gguf/{name}/load: {:.3} s; the file's tensors {:.3} GB, the scope holds {:.3} GB \
                     = {:.3}x{added}",
                    loaded.as_secs_f64(),
                    tensors / 1e9,
                    held / 1e9,
                    held / tensors
                );
            }
            if figures[1] {
                prompt_processing(m, &model, name)?;
            }
            if figures[2] || figures[3] {
                decoding(m, &model, name, figures[3])?;
            }
            Ok(())
        })?;
    }
    Ok(())
}
