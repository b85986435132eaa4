//! A multi-turn conversation with a Llama-family chat model: the model's chat template renders the
//! conversation, and one KV cache holds it across turns, so each turn runs only its new tokens.
//!
//! ```text
//! cargo run --release --example chat                                  # reads turns from stdin
//! cargo run --release --example chat -- --say "What owns a tensor?" --say "And a cache?"
//! cargo run --release --example chat -- --model DIR --system "You answer in one line."
//! ```
//!
//! Each turn renders the whole conversation with the template (as transformers'
//! `apply_chat_template` does), tokenizes it, and keeps the longest prefix the cache already holds:
//! the template usually reproduces the earlier turns token for token, and where it does not (it trims
//! replies, a reply re-tokenizes differently) the cache is cut back there with `KvCache::truncate`
//! rather than started again. The cache lives in the conversation's scope; every step's temporaries
//! in a step scope under it; the dump at the end shows the cache and nothing else left over.
//! (`data/llama-tiny` is a random-ish tiny model: its replies are fragments of docstrings, not
//! answers.)

use std::io::{BufRead, IsTerminal, Write};
use std::path::PathBuf;

use ndscope::data::{ChatMessage, ChatTemplate, Tokenizer};
use ndscope::kv::{CausalLm, KvPool};
use ndscope::models::Llama;
use ndscope::serve::{Finish, GenerateOptions, Sampling, generate_in};
use ndscope::{DType, Device, Error, Result, root};

const USAGE: &str = "\
chat: a conversation with a Llama-family chat model, its KV cache kept across turns

usage: cargo run --release --example chat -- [options]

  --model PATH      a Llama/Mistral/Qwen2 directory with a chat template, or a GGUF file with one
                                                                        [default: data/llama-tiny]
  --system TEXT     a system message first
  --say TEXT        a user turn (repeatable); without any, one turn per line of stdin
  --max-new N       tokens per reply at most                               [default: 24]
  --temperature T   0 is greedy                                            [default: 0]
  --seed S          the sampling seed                                      [default: 42]
  --device D        cpu, or cuda:N (needs --features cuda)                 [default: cpu]
  --help            this text";

#[derive(Debug)]
struct Options {
    model: PathBuf,
    system: Option<String>,
    say: Vec<String>,
    max_new: usize,
    sampling: Sampling,
    seed: u64,
    device: Device,
}

impl Options {
    fn parse(args: impl Iterator<Item = String>) -> std::result::Result<Options, String> {
        let mut o = Options {
            model: "data/llama-tiny".into(),
            system: None,
            say: Vec::new(),
            max_new: 24,
            sampling: Sampling::GREEDY,
            seed: 42,
            device: Device::Cpu,
        };
        let mut args = args;
        while let Some(flag) = args.next() {
            if flag == "--help" || flag == "-h" {
                return Err(String::new());
            }
            let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
            match flag.as_str() {
                "--model" => o.model = value.into(),
                "--system" => o.system = Some(value),
                "--say" => o.say.push(value),
                "--max-new" => {
                    o.max_new =
                        value.parse().ok().filter(|&n| n > 0).ok_or_else(|| {
                            format!("--max-new: `{value}` is not a positive number")
                        })?
                }
                "--temperature" => {
                    o.sampling.temperature = value
                        .parse()
                        .map_err(|_| format!("--temperature: `{value}` is not a number"))?
                }
                "--seed" => o.seed = value.parse().map_err(|_| format!("--seed: `{value}`"))?,
                "--device" => o.device = value.parse().map_err(|e: Error| e.to_string())?,
                _ => return Err(format!("unknown option {flag}")),
            }
        }
        o.sampling.check().map_err(|e| e.to_string())?;
        Ok(o)
    }
}

/// The user's turns: `--say` ones, or stdin's lines (with a prompt when it is a terminal).
fn turns(o: &Options) -> Box<dyn Iterator<Item = String>> {
    if !o.say.is_empty() {
        return Box::new(o.say.clone().into_iter());
    }
    let interactive = std::io::stdin().is_terminal();
    let mut lines = std::io::stdin().lock().lines();
    Box::new(std::iter::from_fn(move || {
        if interactive {
            print!("you> ");
            std::io::stdout().flush().ok();
        }
        lines.next()?.ok()
    }))
}

fn run(o: &Options) -> Result<()> {
    let tokenizer = Tokenizer::for_model(&o.model)?;
    let template = ChatTemplate::for_model(&o.model)?;
    root(o.device, |m| {
        let model = Llama::from_pretrained(m, &o.model, DType::F32)?;
        let max_positions = model.max_positions();
        let pool = KvPool::for_tokens(m, model.kv_shape(), 16, max_positions)?;
        let mut messages: Vec<ChatMessage> = o
            .system
            .iter()
            .map(|s| ChatMessage::new("system", s.as_str()))
            .collect();
        let mut options = GenerateOptions::sampled(o.max_new, o.sampling, o.seed);
        for &eos in &model.config().eos_token_ids {
            options = options.stopping_at(eos);
        }
        m.scope(|conversation| {
            let mut cache = pool.cache(conversation, max_positions)?;
            // The tokens the cache holds, in order.
            let mut held: Vec<i64> = Vec::new();
            for said in turns(o) {
                messages.push(ChatMessage::new("user", said.trim()));
                let ids = tokenizer.encode(&template.apply(&messages, true)?)?;
                if ids.len() >= max_positions {
                    println!(
                        "(the conversation fills the model's {max_positions} positions; ending it)"
                    );
                    break;
                }
                // A reply may take the positions left, no more.
                options.max_new_tokens = o.max_new.min(max_positions - ids.len());
                let common = held.iter().zip(&ids).take_while(|(a, b)| a == b).count();
                if common < held.len() {
                    cache.truncate(common)?;
                    held.truncate(common);
                }
                let reused = held.len();
                let reply = generate_in(
                    &model,
                    conversation,
                    &pool,
                    &mut cache,
                    &ids[reused..],
                    &options,
                )?;
                held.extend(&ids[reused..]);
                // Every reply token but the last ran through the model and is cached.
                held.extend(&reply.tokens[..reply.tokens.len() - 1]);
                let text_tokens = match reply.finish {
                    Finish::Stop(_) => &reply.tokens[..reply.tokens.len() - 1],
                    _ => &reply.tokens[..],
                };
                let text = tokenizer.decode(text_tokens)?;
                println!(
                    "assistant> {}\n  ({} prompt tokens, {} from the cache; {} new tokens; {})",
                    text.trim(),
                    ids.len(),
                    reused,
                    reply.tokens.len(),
                    cache.usage()
                );
                messages.push(ChatMessage::new("assistant", text));
            }
            println!(
                "\nthe conversation's scope before it closes:\n{}",
                conversation.dump()
            );
            Ok::<_, Error>(())
        })?;
        assert_eq!(
            pool.stats().blocks_free,
            pool.stats().blocks,
            "the conversation's blocks are back"
        );
        Ok(())
    })
}

fn main() {
    let options = match Options::parse(std::env::args().skip(1)) {
        Ok(o) => o,
        Err(message) => {
            if !message.is_empty() {
                eprintln!("chat: {message}\n");
            }
            eprintln!("{USAGE}");
            std::process::exit(if message.is_empty() { 0 } else { 2 });
        }
    };
    if let Err(e) = ndscope::threads::work_on_this_thread(None).and_then(|_| run(&options)) {
        eprintln!("chat: {e}");
        std::process::exit(1);
    }
}
