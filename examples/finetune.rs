//! Fine-tunes a pretrained Hugging Face model — GPT-2, or the Llama family (Llama, Mistral, Qwen2)
//! — on a text file, on the CPU by default (`--device cuda:0` with the `cuda` feature).
//!
//! It loads a model directory as transformers' `save_pretrained` writes it (by default the tiny
//! GPT-2 in `data/gpt2-tiny`, trained on Python docstrings; `--model data/llama-tiny` for a Llama 3
//! style one), prints its size and its loss on the text, continues a prompt greedily, fine-tunes it
//! with AdamW on random windows of the text (`data/scopes.txt` by default, a page about scopes),
//! shows the loss falling and the same continuation after, and saves a directory that transformers
//! loads (`AutoModelForCausalLM.from_pretrained(DIR)`, `AutoTokenizer.from_pretrained(DIR)`).
//!
//! ```text
//! cargo run --release --example finetune -- --help
//! cargo run --release --example finetune -- --model data/llama-tiny --recompute
//! ```

use std::path::{Path, PathBuf};
use std::time::Instant;

use ndscope::data::Tokenizer;
use ndscope::kv::{CausalLm, KvPool};
use ndscope::models::AutoModel;
use ndscope::nn::{Mode, Parameters};
use ndscope::optim::{Adam, AdamConfig, Optimizer};
use ndscope::serve::{GenerateOptions, generate};
use ndscope::{DType, Device, Error, Result, Scope, Tape, Workspace, checkpoint, root};

mod common;
use common::Rng;

const USAGE: &str = "\
Fine-tune a pretrained GPT-2 or Llama-family model (a Hugging Face directory) on a text with ndscope.

USAGE: cargo run --release --example finetune -- [OPTIONS]

OPTIONS:
  --model DIR       a GPT-2, Llama, Mistral or Qwen2 directory (config.json, model.safetensors,
                    tokenizer.json)                                   [default: data/gpt2-tiny]
  --text FILE       the UTF-8 text to fine-tune on                    [default: data/scopes.txt]
  --steps N         optimizer steps                                   [default: 300]
  --batch-size N    windows per step                                  [default: 8]
  --context N       tokens per window (at most the model's positions) [default: 64]
  --lr X            AdamW learning rate                               [default: 0.001]
  --prompt TEXT     the prompt continued before and after             [default: \"A scope owns\"]
  --seed N          window sampling                                   [default: 42]
  --device D        cpu, or cuda:N (needs --features cuda)            [default: cpu]
  --dtype T         f32, or bf16 / f16 autocast (f16 with loss scaling) [default: f32]
  --recompute       recompute each block in the backward pass (activation checkpointing)
  --out DIR         where the fine-tuned model is saved [default: target/MODEL_TYPE-finetuned]
  --help            this text";

/// The command line, parsed.
#[derive(Debug)]
struct Options {
    model: PathBuf,
    text: PathBuf,
    steps: usize,
    batch_size: usize,
    context: usize,
    lr: f64,
    prompt: String,
    seed: u64,
    device: Device,
    dtype: DType,
    recompute: bool,
    /// `None`: `target/<model_type>-finetuned`.
    out: Option<PathBuf>,
}

impl Options {
    fn parse(args: impl Iterator<Item = String>) -> std::result::Result<Options, String> {
        let mut o = Options {
            model: "data/gpt2-tiny".into(),
            text: "data/scopes.txt".into(),
            steps: 300,
            batch_size: 8,
            context: 64,
            lr: 1e-3,
            prompt: "A scope owns".into(),
            seed: 42,
            device: Device::Cpu,
            dtype: DType::F32,
            recompute: false,
            out: None,
        };
        let mut args = args;
        while let Some(flag) = args.next() {
            if flag == "--help" || flag == "-h" {
                return Err(String::new());
            }
            if flag == "--recompute" {
                o.recompute = true;
                continue;
            }
            let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
            let count = |v: &str| {
                v.parse::<usize>()
                    .ok()
                    .filter(|&n| n > 0)
                    .ok_or_else(|| format!("{flag}: `{v}` is not a positive whole number"))
            };
            match flag.as_str() {
                "--model" => o.model = value.into(),
                "--text" => o.text = value.into(),
                "--steps" => o.steps = count(&value)?,
                "--batch-size" => o.batch_size = count(&value)?,
                "--context" => o.context = count(&value)?.max(2),
                "--lr" => {
                    o.lr = value
                        .parse::<f64>()
                        .ok()
                        .filter(|lr| lr.is_finite() && *lr > 0.0)
                        .ok_or_else(|| format!("--lr: `{value}` is not a positive number"))?
                }
                "--prompt" => o.prompt = value,
                "--seed" => o.seed = value.parse().map_err(|_| format!("--seed: `{value}`"))?,
                "--device" => o.device = value.parse().map_err(|e: Error| e.to_string())?,
                "--dtype" => o.dtype = common::parse_dtype(&value)?,
                "--out" => o.out = Some(value.into()),
                _ => return Err(format!("unknown option {flag}")),
            }
        }
        Ok(o)
    }
}

/// The model's mean next-token loss over the text, in consecutive windows of `context` tokens, in
/// a scope of its own.
fn text_loss<'m>(
    m: &Scope<'m>,
    model: &AutoModel<'m>,
    ids: &[i64],
    context: usize,
    precision: &common::Precision,
) -> Result<f64> {
    m.named_scope("eval", |e| {
        precision.enter(e)?;
        let windows = ids.len() / context;
        let flat = &ids[..windows * context];
        let input = e.from_slice(flat, &[windows, context])?;
        let tape = Tape::no_grad(e);
        let logits = model.forward(&tape, &input, Mode::Eval)?;
        AutoModel::loss(&logits, &input)?
            .value()
            .to_vec_f64()
            .map(|v| v[0])
    })
}

/// The prompt and a greedy continuation of up to 24 tokens (cached decoding), stopping at an end
/// token: the config's, or GPT-2's `<|endoftext|>`.
fn continuation<'m>(
    m: &Scope<'m>,
    model: &AutoModel<'m>,
    tokenizer: &Tokenizer,
    prompt: &str,
) -> Result<String> {
    let ids = tokenizer.encode_with_special_tokens(prompt)?;
    let mut options = GenerateOptions::greedy(24);
    let stops = model.end_tokens().iter().copied();
    for stop in stops.chain(tokenizer.token_id("<|endoftext|>")) {
        options = options.stopping_at(stop);
    }
    let new = m.named_scope("generate", |g| {
        let positions = (ids.len() + 24).min(model.max_positions());
        let pool = KvPool::for_tokens(g, model.kv_shape(), KvPool::BLOCK_TOKENS, positions)?;
        generate(model, g, &pool, &ids, &options)
    })?;
    Ok(format!("{prompt}{}", tokenizer.decode(&new.tokens)?))
}

fn run(o: &Options) -> Result<()> {
    let started = Instant::now();
    let tokenizer = Tokenizer::from_file(o.model.join("tokenizer.json"))?;
    let text = std::fs::read_to_string(&o.text).map_err(|e| Error::Io {
        path: o.text.display().to_string(),
        reason: e.to_string(),
    })?;
    let ids = tokenizer.encode(&text)?;
    let mut precision = common::Precision::new(o.dtype);
    let mut ws = Workspace::planned("batch");
    root(o.device, |s| {
        s.named_scope("model", |m| {
            let loading = Instant::now();
            let mut model = AutoModel::from_pretrained(m, &o.model, DType::F32)?;
            model.set_recompute(o.recompute);
            let loaded_in = loading.elapsed();
            let context = o.context.min(model.max_positions());
            if ids.len() < context + 1 {
                return Err(Error::InvalidShape {
                    op: "finetune",
                    shape: vec![ids.len()],
                    reason: format!(
                        "{} holds {} tokens; it needs more than the context ({context})",
                        o.text.display(),
                        ids.len()
                    ),
                });
            }
            println!(
                "model: {}, from {}; {} parameters ({} B in the model scope), loaded in {:.1} ms",
                model.describe(),
                o.model.display(),
                model.parameter_elements(),
                m.stats().live_bytes,
                loaded_in.as_secs_f64() * 1e3,
            );
            println!(
                "data: {}: {} characters, {} tokens; windows of {context} tokens, batch {}, AdamW lr {}, {} steps, {}{}",
                o.text.display(),
                text.chars().count(),
                ids.len(),
                o.batch_size,
                o.lr,
                o.steps,
                precision.describe(),
                if o.recompute { ", blocks recomputed in the backward pass" } else { "" }
            );
            let before = text_loss(m, &model, &ids, context, &precision)?;
            let sample_before = continuation(m, &model, &tokenizer, &o.prompt)?;
            println!("loss on the text before: {before:.4}");
            println!("continuation before: {sample_before:?}");

            let mut opt = Adam::new(m, &model, AdamConfig::adamw(o.lr, 0.01))?;
            // From here on a tensor made in the model scope while a step runs is an error, not a leak.
            m.set_strict(true);
            let model_at_start = m.stats().live_bytes;
            let mut rng = Rng(o.seed);
            let training = Instant::now();
            let mut recent = Vec::new();
            for step in 1..=o.steps {
                let windows: Vec<i64> = (0..o.batch_size)
                    .flat_map(|_| {
                        let start = rng.below(ids.len() - context + 1);
                        ids[start..start + context].iter().copied()
                    })
                    .collect();
                let (loss, peak) = m.workspace(&mut ws, |b| -> Result<(f64, usize)> {
                    precision.enter(b)?;
                    let input = b.from_slice(&windows, &[o.batch_size, context])?;
                    let tape = Tape::new(b);
                    let logits = model.forward(&tape, &input, Mode::Train)?;
                    let loss = AutoModel::loss(&logits, &input)?;
                    precision.backward_and_step(&tape, &loss, |grads| opt.step(&mut model, grads))?;
                    Ok((loss.value().to_vec_f64()?[0], b.stats().peak_bytes))
                })?;
                recent.push(loss);
                if step % 50 == 0 || step == o.steps {
                    let mean = recent.iter().sum::<f64>() / recent.len() as f64;
                    recent.clear();
                    let stats = m.stats();
                    println!(
                        "step {step:4}  loss {mean:.4}  | model: {} tensors, {} B live | batch: peak {peak} B, workspace {} B | {:.1} s",
                        stats.live_tensors,
                        stats.live_bytes,
                        ws.capacity(),
                        training.elapsed().as_secs_f64()
                    );
                }
            }
            let after = text_loss(m, &model, &ids, context, &precision)?;
            println!("\nloss on the text: {before:.4} before, {after:.4} after {} steps", o.steps);
            println!("continuation after: {:?}", continuation(m, &model, &tokenizer, &o.prompt)?);
            if let Some(line) = precision.report() {
                println!("{line}");
            }
            println!(
                "model scope: {model_at_start} live bytes after loading and AdamW's state, {} at the end",
                m.stats().live_bytes
            );
            if let Some(line) = common::plan_summary(&ws) {
                println!("{line}");
            }
            let out = o.out.clone().unwrap_or_else(|| {
                format!("target/{}-finetuned", model.architecture()).into()
            });
            save(&model, &o.model, &out)
        })
    })?;
    println!("done in {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}

/// Writes the fine-tuned model and the tokenizer, chat template and generation settings it was
/// loaded with.
fn save(model: &AutoModel<'_>, from: &Path, out: &Path) -> Result<()> {
    model.save_pretrained(out)?;
    for file in [
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "generation_config.json",
    ] {
        if from.join(file).is_file() {
            let bytes = std::fs::read(from.join(file)).map_err(|e| Error::Io {
                path: from.join(file).display().to_string(),
                reason: e.to_string(),
            })?;
            checkpoint::write_atomically(out.join(file), &bytes)?;
        }
    }
    println!(
        "saved to {} (transformers: AutoModelForCausalLM.from_pretrained(\"{}\"))",
        out.display(),
        out.display()
    );
    Ok(())
}

fn main() {
    common::main_with(USAGE, Options::parse, run);
}
