//! `ndscope-server`: a Hugging Face GPT-2 or Llama-family directory behind an OpenAI-compatible
//! HTTP API.
//!
//! ```text
//! cargo run --release -p ndscope-server -- --model data/llama-tiny --port 8000
//! curl -s localhost:8000/v1/completions -H 'content-type: application/json' \
//!      -d '{"model": "llama-tiny", "prompt": "A scope owns", "max_tokens": 16}'
//! ```
//!
//! One thread owns the model's scope and steps the engine; the HTTP handlers (tokio, axum) send it
//! requests and get tokens back through channels. Ctrl-C or SIGTERM stops taking requests, lets the
//! running ones finish (within `--grace-s`), and ends.

mod engine;
mod metrics;
mod openai;
mod routes;
mod text;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use ndscope::data::{ChatTemplate, Tokenizer};
use ndscope::serve::CoreConfig;
use ndscope::{DType, Device};

use engine::{Command, EngineSettings};
use metrics::Metrics;
use routes::App;

const USAGE: &str = "\
ndscope-server: an OpenAI-compatible HTTP server for a Hugging Face GPT-2 or Llama-family directory

usage: cargo run --release -p ndscope-server -- --model PATH [options]

  --model PATH       a directory with config.json, model.safetensors, tokenizer.json (and a chat
                     template for /v1/chat/completions), or a GGUF file
  --name NAME        the model's id in requests                [default: the directory's or file's name]
  --host ADDR        the address to listen on                  [default: 127.0.0.1]
  --port N           the port (0: any free one)                [default: 8000]
  --dtype T          f32, bf16 or f16                          [default: f32]
  --device D         cpu, or cuda:N (build with `--features cuda`)  [default: cpu]
  --batch N          requests decoded together                 [default: 8]
  --step-tokens N    tokens one forward pass runs at most (longer prompts join in chunks)
                                                               [default: 512]
  --queue N          requests that may wait; past it, 429      [default: 256]
  --kv-tokens N      tokens the KV pool holds, all requests together
                                                               [default: batch x min(positions, 2048)]
  --block N          tokens per KV block                       [default: 16]
  --max-body BYTES   the largest request body                  [default: 1048576]
  --grace-s N        on Ctrl-C or SIGTERM, how long the running requests may take to finish
                                                               [default: 30]
  --min-step-ms N    each engine step lasts at least N ms: a throttle for demos and tests of
                     streaming and cancellation on tiny models    [default: 0]
  --help             this text

endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
           GET /metrics (Prometheus), GET /debug/scopes (the engine's scope tree)";

struct Options {
    settings: EngineSettings,
    name: Option<String>,
    addr: SocketAddr,
    max_body: usize,
    grace: std::time::Duration,
}

fn number(flag: &str, value: &str) -> Result<usize, String> {
    value
        .parse()
        .map_err(|_| format!("{flag}: `{value}` is not a whole number"))
}

fn parse(mut args: impl Iterator<Item = String>) -> Result<Options, String> {
    let mut model = None;
    let mut name = None;
    let mut host = "127.0.0.1".to_string();
    let mut port = 8000u16;
    let mut dtype = DType::F32;
    let mut device = Device::Cpu;
    let mut core = CoreConfig::default();
    let mut kv_tokens = None;
    let mut block_tokens = 16;
    let mut max_body = 1 << 20;
    let mut min_step = 0;
    let mut grace = 30;
    while let Some(flag) = args.next() {
        if flag == "--help" || flag == "-h" {
            return Err(String::new());
        }
        let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--model" => model = Some(PathBuf::from(value)),
            "--name" => name = Some(value),
            "--host" => host = value,
            "--port" => {
                port = value
                    .parse()
                    .map_err(|_| format!("--port: `{value}` is not a port"))?
            }
            "--dtype" => dtype = value.parse().map_err(|e| format!("--dtype: {e}"))?,
            "--device" => device = value.parse().map_err(|e| format!("--device: {e}"))?,
            "--batch" => core.max_batch = number(&flag, &value)?,
            "--step-tokens" => core.step_tokens = number(&flag, &value)?,
            "--queue" => core.max_waiting = number(&flag, &value)?,
            "--kv-tokens" => kv_tokens = Some(number(&flag, &value)?),
            "--block" => block_tokens = number(&flag, &value)?,
            "--max-body" => max_body = number(&flag, &value)?,
            "--min-step-ms" => min_step = number(&flag, &value)?,
            "--grace-s" => grace = number(&flag, &value)?,
            _ => return Err(format!("unknown option {flag}")),
        }
    }
    let model = model.ok_or("--model PATH is needed")?;
    if core.max_batch == 0 || block_tokens == 0 {
        return Err("--batch and --block must be at least 1".into());
    }
    let addr = format!("{host}:{port}")
        .parse()
        .map_err(|_| format!("--host: `{host}` is not an IP address"))?;
    Ok(Options {
        settings: EngineSettings {
            model,
            dtype,
            device,
            core,
            kv_tokens,
            block_tokens,
            min_step: std::time::Duration::from_millis(min_step as u64),
        },
        name,
        addr,
        max_body,
        grace: std::time::Duration::from_secs(grace as u64),
    })
}

fn main() {
    let options = match parse(std::env::args().skip(1)) {
        Ok(o) => o,
        Err(e) if e.is_empty() => {
            println!("{USAGE}");
            return;
        }
        Err(e) => {
            eprintln!("ndscope-server: {e}\n\n{USAGE}");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(options) {
        eprintln!("ndscope-server: {e}");
        std::process::exit(1);
    }
}

fn run(o: Options) -> Result<(), String> {
    let dir = &o.settings.model;
    let tokenizer = Tokenizer::for_model(dir).map_err(|e| e.to_string())?;
    // A base model has no chat template: /v1/chat/completions then says so.
    let template = ChatTemplate::for_model(dir).ok();
    let name = o.name.clone().unwrap_or_else(|| {
        dir.canonicalize()
            .ok()
            // A directory's name, or a GGUF file's without its extension.
            .and_then(|d| {
                let name = if d.is_file() {
                    d.file_stem()
                } else {
                    d.file_name()
                };
                name.map(|n| n.to_string_lossy().into_owned())
            })
            .unwrap_or_else(|| "model".into())
    });
    let metrics = Arc::new(Metrics::default());
    let core = o.settings.core;
    let (engine, facts, thread) = engine::spawn(o.settings, metrics.clone())?;
    let described = format!(
        "{name} ({}, {} positions, {} KV blocks, batch {}, {} chat template)",
        facts.architecture,
        facts.max_positions,
        facts.kv_blocks,
        core.max_batch,
        if template.is_some() { "with a" } else { "no" },
    );
    let app = Arc::new(App::new(
        name,
        facts,
        tokenizer,
        template,
        engine.clone(),
        metrics,
        core.max_batch,
        o.max_body,
    ));
    let runtime = tokio::runtime::Runtime::new().map_err(|e| e.to_string())?;
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind(o.addr)
            .await
            .map_err(|e| format!("cannot listen on {}: {e}", o.addr))?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        println!("ndscope-server: serving {described} on http://{addr}");
        let ending = app.clone();
        let stopping = Arc::new(tokio::sync::Notify::new());
        let stopped = stopping.clone();
        let serving =
            axum::serve(listener, routes::router(app)).with_graceful_shutdown(async move {
                stop_signal().await;
                // New requests are refused from now on; the running ones finish.
                ending.ending.store(true, Ordering::Relaxed);
                println!("ndscope-server: stopping; the running requests finish first");
                stopped.notify_one();
            });
        // A client that stops reading would hold its connection, and the shutdown, forever.
        let grace = o.grace;
        tokio::select! {
            served = serving => served.map_err(|e| e.to_string()),
            () = async { stopping.notified().await; tokio::time::sleep(grace).await } => {
                println!("ndscope-server: {grace:?} passed; closing the connections left");
                Ok(())
            }
        }
    })?;
    // The tasks still streaming end here, and their requests with them.
    drop(runtime);
    engine.send(Command::Shutdown);
    drop(engine);
    thread
        .join()
        .map_err(|_| "the engine thread panicked".to_string())?;
    println!("ndscope-server: stopped");
    Ok(())
}

async fn stop_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => return std::future::pending().await,
            };
        tokio::select! {
            _ = interrupt => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = interrupt.await;
    }
}
