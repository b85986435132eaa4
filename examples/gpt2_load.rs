//! Loads a GPT-2 model directory once and reports what it cost: the time, and the process's peak
//! resident memory against the bytes of the weights. Loading copies each tensor once from the
//! memory-mapped file and drops the file's pages from the process once copied, so the peak is the
//! weights plus about one tensor.
//!
//! ```text
//! cargo run --release --example gpt2_load -- [DIR]   # default: target/gpt2-small-random
//! ```
//!
//! Without a directory at DIR it first writes GPT-2 small (124M parameters) with random weights
//! there, in a child process's worth of memory that it then gives back (run it again to measure a
//! load whose file is in the page cache, as transformers' `from_pretrained` is measured).

use std::time::Instant;

use ndscope::models::{Gpt2, Gpt2Config};
use ndscope::nn::Parameters;
use ndscope::{DType, Device, Error, Result, root};

#[allow(dead_code)] // the training helpers of examples/common; this example reads /proc with it
mod common;
use common::status_bytes;

fn run(dir: &str) -> Result<()> {
    if !std::path::Path::new(dir)
        .join("model.safetensors")
        .is_file()
    {
        root(Device::Cpu, |s| {
            s.set_seed(7);
            Gpt2::new(s, Gpt2Config::new(50257, 1024, 768, 12, 12))?.save_pretrained(dir)
        })?;
        println!("wrote GPT-2 small with random weights to {dir}; run again to measure the load");
        return Ok(());
    }
    let before = status_bytes("VmRSS");
    let started = Instant::now();
    root(Device::Cpu, |s| {
        let model = Gpt2::from_pretrained(s, dir, DType::F32)?;
        let elapsed = started.elapsed();
        let weights = model.parameter_elements() * 4;
        println!(
            "loaded {dir}: {} parameters, {weights} B of f32 weights, in {:.3} s",
            model.parameter_elements(),
            elapsed.as_secs_f64()
        );
        if let (Some(anon), Some(file)) = (status_bytes("RssAnon"), status_bytes("RssFile")) {
            println!("resident now: {anon} B anonymous (the weights), {file} B of mapped files");
        }
        match (before, status_bytes("VmHWM")) {
            (Some(before), Some(peak)) => println!(
                "process resident memory: {before} B before loading, peak {peak} B; the load added {} B = {:.3}x the weights",
                peak - before,
                (peak - before) as f64 / weights as f64
            ),
            _ => println!("(no /proc/self/status here: the peak is not measured)"),
        }
        Ok::<_, Error>(())
    })
}

fn main() {
    let dir = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "target/gpt2-small-random".into());
    if let Err(e) = run(&dir) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
