//! ndscope's side of `benches/versus_pytorch.py`, the one command that prints the table of
//! ndscope against PyTorch on the machine at hand (issue 37): GPT-2 small (random weights,
//! `common::GPT2_SMALL`) forward and forward+backward at 128 and 1,024 tokens, f32
//! and bf16 autocast; fused causal attention `[1, 12, 1024, 64]` in f32 and bf16; greedy decoding of
//! 128 tokens after a 16-token prompt, one request and eight batched.
//!
//! It is driven over stdin so that the script can alternate the two sides run by run: each line
//! names a row (`forward/128`, `forward_backward_bf16/1024`, `attention/bf16`, `decode/8`, …), and
//! the answer is one line `ROW SECONDS VALUE` (the wall time of one run, and what it computed: the
//! loss, the sum of the last position's logits, the sum of the attention's output, or the tokens
//! generated). The time covers what PyTorch's side times: a whole pass or generation, and for the
//! attention rows the attention alone (its random inputs are made and cast before the clock
//! starts). A row's first request also runs it once untimed, as a warm-up. Run by hand:
//!
//! ```text
//! echo forward/128 | RAYON_NUM_THREADS=2 cargo bench --bench versus_pytorch
//! ```

mod common;

use std::io::{BufRead, Write};
use std::time::Instant;

use ndscope::kv::{CausalLm, KvPool};
use ndscope::models::Gpt2;
use ndscope::serve::{Engine, EngineConfig, GenerateOptions, Request, generate};
use ndscope::{AttentionSpec, DType, Device, Scope, root};

/// What the bench's functions return: a library error, or a row it does not know.
type Outcome<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// The prompt of every decoding row: 16 token ids (request `i` starts with token `i`).
fn prompt(request: i64) -> Vec<i64> {
    let mut p: Vec<i64> = (0..16).map(|i| (i * 7919 + 13) % 50257).collect();
    p[0] = request;
    p
}

/// One run of `row`: its timed seconds and what it computed.
fn run<'m>(m: &Scope<'m>, model: &Gpt2<'m>, pool: &KvPool<'m>, row: &str) -> Outcome<(f64, f64)> {
    let start = Instant::now();
    let seconds = |start: Instant| start.elapsed().as_secs_f64();
    let unknown = || format!("versus_pytorch: no row named {row:?}");
    let (name, arg) = row.split_once('/').ok_or_else(unknown)?;
    let bf16 = |name: &str| name.ends_with("_bf16");
    match name {
        "forward" | "forward_backward" | "forward_bf16" | "forward_backward_bf16" => {
            let len: i64 = arg.parse().map_err(|_| unknown())?;
            let ids: Vec<i64> = (0..len).map(|i| (i * 7919) % 50257).collect();
            let autocast = bf16(name).then_some(DType::BF16);
            let backward = name.starts_with("forward_backward");
            let loss = common::gpt2_pass(m, model, &ids, autocast, backward)?;
            Ok((seconds(start), loss.into()))
        }
        "attention" => {
            let dtype = match arg {
                "f32" => DType::F32,
                "bf16" => DType::BF16,
                _ => return Err(unknown().into()),
            };
            let timed = m.scope(|s| -> ndscope::Result<(f64, f64)> {
                s.set_seed(3);
                let shape = [1, 12, 1024, 64];
                let qkv = [s.randn(&shape)?, s.randn(&shape)?, s.randn(&shape)?];
                let [q, k, v] = qkv.map(|t| t.to_dtype(dtype));
                let (q, k, v) = (q?, k?, v?);
                let start = Instant::now();
                let out = q.attention(&k, &v, AttentionSpec::CAUSAL, None)?;
                let sum = out.to_dtype(DType::F32)?.sum_all()?.to_scalar::<f32>()?;
                Ok((seconds(start), sum.into()))
            })?;
            Ok(timed)
        }
        "decode" => {
            let batch: usize = arg.parse().map_err(|_| unknown())?;
            let options = GenerateOptions::greedy(128);
            if batch == 1 {
                let out = generate(model, m, pool, &prompt(0), &options)?;
                return Ok((seconds(start), out.tokens.len() as f64));
            }
            let mut engine = Engine::new(model, pool, EngineConfig { max_batch: batch });
            for i in 0..batch {
                engine.submit(Request {
                    prompt: prompt(i as i64),
                    options: options.clone(),
                    arrival: 0,
                })?;
            }
            let done = engine.run(m, |_| {})?;
            let tokens = done
                .iter()
                .map(|d| d.generation.tokens.len())
                .sum::<usize>();
            Ok((seconds(start), tokens as f64))
        }
        _ => Err(unknown().into()),
    }
}

fn main() -> Outcome<()> {
    common::ensure_gpt2_small()?;
    root(Device::Cpu, |m| -> Outcome<()> {
        let model = Gpt2::from_pretrained(m, common::GPT2_SMALL, DType::F32)?;
        let pool = KvPool::for_tokens(m, model.kv_shape(), 16, 8 * (16 + 128))?;
        let mut warm = std::collections::HashSet::new();
        let stdout = std::io::stdout();
        for line in std::io::stdin().lock().lines() {
            let row = line?;
            let row = row.trim();
            if row.is_empty() {
                continue;
            }
            if warm.insert(row.to_string()) {
                run(m, &model, &pool, row)?;
            }
            let (seconds, value) = run(m, &model, &pool, row)?;
            let mut out = stdout.lock();
            writeln!(out, "{row} {seconds:.6} {value}")?;
            out.flush()?;
        }
        Ok(())
    })
}
