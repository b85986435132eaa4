//! Text generation with a paged KV cache, and a load of concurrent requests through the
//! continuous-batching engine.
//!
//! ```text
//! cargo run --release --example generate                          # the bundled tiny GPT-2
//! cargo run --release --example generate -- --model data/llama-tiny  # the bundled tiny Llama
//! cargo run --release --example generate -- --model data/gguf/llama-tiny-Q4_K_M.gguf  # as GGUF
//! cargo run --release --example generate -- --prompt "def main():" --temperature 0.8 --top-p 0.9
//! cargo run --release --example generate -- --serve 64            # 64 requests of mixed lengths
//! ```
//!
//! The model and the KV pool live in the model scope; each request's cache in the request's scope;
//! each step's temporaries in the step's scope. `--serve N` prints tokens/s, latency percentiles, the
//! KV pool's waste and the scope tree after the run.

#[allow(dead_code)] // the training helpers of examples/common; this example needs its entry point
mod common;
use common::Rng;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use ndscope::data::Tokenizer;
use ndscope::kv::{CausalLm, KvPool, KvShape};
use ndscope::models::AutoModel;
use ndscope::serve::{Engine, EngineConfig, GenerateOptions, Request, Sampling, generate};
use ndscope::{DType, Device, Error, Result, Scope, root};

const USAGE: &str = "\
generate: text from a Hugging Face GPT-2 or Llama-family directory, one prompt or a served load

usage: cargo run --release --example generate -- [options]

  --model PATH      a GPT-2 or Llama/Mistral/Qwen2 directory (config.json, model.safetensors,
                    tokenizer.json), or a GGUF file (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0,
                    Q5_1, Q2_K..Q6_K; the model computes on the quantized blocks)
                                                                       [default: data/gpt2-tiny]
  --decoded         decode a GGUF file's quantized weights to f32 on load
  --prompt TEXT     what to continue                                   [default: \"A scope owns every tensor\"]
  --max-new N       tokens to generate at most                         [default: 48]
  --temperature T   0 is greedy                                        [default: 0]
  --top-k K         keep the K most likely tokens (0: all)             [default: 0]
  --top-p P         keep the most likely tokens summing to P           [default: 1]
  --seed S          the sampling seed                                  [default: 42]
  --device D        cpu, or cuda:N (needs --features cuda)             [default: cpu]
  --block B         tokens per KV block                                [default: 16]
  --kv-dtype D      what the KV cache keeps: f32, bf16 or f16 (half the bytes; llama.cpp's
                    default)                                           [default: the model's]
  --serve N         serve N concurrent requests of mixed lengths instead of one prompt
  --batch B         requests decoded together when serving             [default: 8]
  --help            this text";

#[derive(Debug)]
struct Options {
    model: PathBuf,
    prompt: String,
    max_new: usize,
    sampling: Sampling,
    seed: u64,
    device: Device,
    block: usize,
    kv_dtype: Option<DType>,
    serve: Option<usize>,
    batch: usize,
    decoded: bool,
}

impl Options {
    fn parse(args: impl Iterator<Item = String>) -> std::result::Result<Options, String> {
        let mut o = Options {
            model: "data/gpt2-tiny".into(),
            prompt: "A scope owns every tensor".into(),
            max_new: 48,
            sampling: Sampling::GREEDY,
            seed: 42,
            device: Device::Cpu,
            block: KvPool::BLOCK_TOKENS,
            kv_dtype: None,
            serve: None,
            batch: 8,
            decoded: false,
        };
        let mut args = args;
        while let Some(flag) = args.next() {
            if flag == "--help" || flag == "-h" {
                return Err(String::new());
            }
            if flag == "--decoded" {
                o.decoded = true;
                continue;
            }
            let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
            let count = |v: &str| {
                v.parse::<usize>()
                    .ok()
                    .filter(|&n| n > 0)
                    .ok_or_else(|| format!("{flag}: `{v}` is not a positive whole number"))
            };
            let number = |v: &str| {
                v.parse::<f64>()
                    .ok()
                    .filter(|x| x.is_finite())
                    .ok_or_else(|| format!("{flag}: `{v}` is not a number"))
            };
            match flag.as_str() {
                "--model" => o.model = value.into(),
                "--prompt" => o.prompt = value,
                "--max-new" => o.max_new = count(&value)?,
                "--temperature" => o.sampling.temperature = number(&value)?,
                "--top-k" => {
                    o.sampling.top_k = value
                        .parse()
                        .map_err(|_| format!("--top-k: `{value}` is not a whole number"))?
                }
                "--top-p" => o.sampling.top_p = number(&value)?,
                "--seed" => o.seed = value.parse().map_err(|_| format!("--seed: `{value}`"))?,
                "--device" => o.device = value.parse().map_err(|e: Error| e.to_string())?,
                "--block" => o.block = count(&value)?,
                "--kv-dtype" => {
                    o.kv_dtype = Some(
                        value
                            .parse()
                            .ok()
                            .filter(|d: &DType| d.is_float() && *d != DType::F64)
                            .ok_or_else(|| {
                                format!("--kv-dtype: `{value}` is not one of f32, bf16, f16")
                            })?,
                    )
                }
                "--serve" => o.serve = Some(count(&value)?),
                "--batch" => o.batch = count(&value)?,
                _ => return Err(format!("unknown option {flag}")),
            }
        }
        o.sampling.check().map_err(|e| e.to_string())?;
        Ok(o)
    }
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i].as_secs_f64() * 1e3
}

fn run(o: &Options) -> Result<()> {
    let tokenizer = Tokenizer::for_model(&o.model)?;
    root(o.device, |m| {
        // GPT-2 or the Llama family, as config.json's model_type (or the GGUF file's
        // general.architecture) says.
        // A GGUF file's quantized matrices stay in their blocks, on the CPU and on a GPU.
        let blocks = o.model.is_file() && !o.decoded;
        let model = if blocks {
            AutoModel::from_gguf_quantized(m, &o.model, DType::F32)?
        } else {
            AutoModel::from_pretrained(m, &o.model, DType::F32)?
        };
        serve(o, m, &tokenizer, &model, model.end_tokens())
    })
}

/// One prompt, or a served load, with `model`; generation ends at any of `stops`.
fn serve<'m, M: CausalLm<'m>>(
    o: &Options,
    m: &Scope<'m>,
    tokenizer: &Tokenizer,
    model: &M,
    stops: &[i64],
) -> Result<()> {
    let with_stops = |mut options: GenerateOptions| {
        for &stop in stops {
            options = options.stopping_at(stop);
        }
        options
    };
    // The model's cache shape, kept in the dtype asked for.
    let kv_shape = KvShape {
        dtype: o.kv_dtype.unwrap_or(model.kv_shape().dtype),
        ..model.kv_shape()
    };
    {
        let positions = model.max_positions();
        let Some(n) = o.serve else {
            // With the special tokens the tokenizer adds (Llama's <|begin_of_text|>; none for GPT-2).
            let prompt = tokenizer.encode_with_special_tokens(&o.prompt)?;
            // Room for this request only: a pool for the whole context of a long-context model
            // (Llama 3.2's 131,072 positions: 8 GiB of f32 keys and values for a 1B model) would
            // cost more than the model.
            let tokens = positions.min(prompt.len() + o.max_new);
            let pool = KvPool::for_tokens(m, kv_shape, o.block, tokens)?;
            let options = with_stops(GenerateOptions::sampled(o.max_new, o.sampling, o.seed));
            let started = Instant::now();
            let out = generate(model, m, &pool, &prompt, &options)?;
            let elapsed = started.elapsed().as_secs_f64();
            println!("{}{}", o.prompt, tokenizer.decode(&out.tokens)?);
            println!(
                "\n{} new tokens in {:.1} ms ({:.0} tokens/s, the prompt's {} tokens included in the time); \
                 finished by {:?}; cache at the end: {}",
                out.tokens.len(),
                elapsed * 1e3,
                out.tokens.len() as f64 / elapsed,
                prompt.len(),
                out.finish,
                out.kv
            );
            return Ok(());
        };
        // A load of n requests: prompts are windows of the bundled text, of 4 to half the model's
        // positions; outputs of 8 to a quarter of them; a few arrive at each step.
        let text = std::fs::read_to_string("data/scopes.txt").map_err(|e| Error::Io {
            path: "data/scopes.txt".into(),
            reason: e.to_string(),
        })?;
        let corpus = tokenizer.encode(&text)?;
        let mut rng = Rng(o.seed);
        let pool = KvPool::for_tokens(m, kv_shape, o.block, o.batch * positions)?;
        let mut engine = Engine::new(model, &pool, EngineConfig { max_batch: o.batch });
        let mut generated_max = 0;
        for i in 0..n {
            let len = 4 + rng.below(positions / 2 - 3);
            let at = rng.below(corpus.len() - len + 1);
            let new = 8 + rng.below(positions / 4 - 7);
            generated_max += new;
            let options = with_stops(GenerateOptions::sampled(new, o.sampling, o.seed + i as u64));
            engine.submit(Request {
                prompt: corpus[at..at + len].to_vec(),
                options,
                arrival: i / 2,
            })?;
        }
        let (mut held, mut cached, mut steps, mut peak_blocks) = (0, 0, 0, 0);
        let mut full_batch_dump = None;
        let started = Instant::now();
        let done = engine.run(m, |step| {
            held += step.pool.blocks_used() * step.pool.block_tokens;
            cached += step.pool.tokens_cached;
            steps += 1;
            peak_blocks = peak_blocks.max(step.pool.blocks_used());
            if step.batch == o.batch && full_batch_dump.is_none() {
                full_batch_dump = Some((step.step, m.dump()));
            }
        })?;
        let elapsed = started.elapsed().as_secs_f64();
        let tokens: usize = done.iter().map(|c| c.generation.tokens.len()).sum();
        let prompts: usize = done.iter().map(|c| c.prompt_tokens).sum();
        let mut latency: Vec<Duration> = done.iter().map(|c| c.latency).collect();
        let mut first: Vec<Duration> = done.iter().map(|c| c.first_token).collect();
        latency.sort();
        first.sort();
        let stats = pool.stats();
        println!(
            "served {n} requests ({prompts} prompt tokens, {tokens} generated of at most {generated_max}) \
             in {steps} steps, {:.2} s: {:.0} generated tokens/s",
            elapsed,
            tokens as f64 / elapsed
        );
        println!(
            "latency p50 {:.1} ms, p90 {:.1} ms, p99 {:.1} ms; first token p50 {:.1} ms, p99 {:.1} ms",
            percentile(&latency, 0.5),
            percentile(&latency, 0.9),
            percentile(&latency, 0.99),
            percentile(&first, 0.5),
            percentile(&first, 0.99)
        );
        println!(
            "KV: waste {:.2}% of the held bytes over the run (blocks of {}), peak {} of {} blocks ({} B each); \
             a max-length reservation would hold {} blocks for {} requests",
            100.0 * (held - cached) as f64 / held.max(1) as f64,
            stats.block_tokens,
            peak_blocks,
            stats.blocks,
            stats.block_bytes,
            o.batch * positions.div_ceil(o.block),
            o.batch
        );
        println!("{stats}");
        if let Some((step, dump)) = full_batch_dump {
            println!("\nscope tree at step {step}, the first with a full batch:\n{dump}");
        }
        println!("scope tree after the run:\n{}", m.dump());
        Ok(())
    }
}

fn main() {
    common::main_with(USAGE, Options::parse, run);
}
