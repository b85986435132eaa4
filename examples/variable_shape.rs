//! A training workload whose shapes change every step: an MLP 784-1024-1024-10 (AdamW) trained with a
//! random batch size in 1..=512 at each step, the batch's tensors in a pool-mode child scope. Prints
//! the tree's reserved peak over its live peak: how much memory the allocator held beyond what the
//! tensors needed, with shapes no size-class cache could anticipate.
//!
//! ```text
//! cargo run --release --example variable_shape                            # host
//! cargo run --release --features cuda --example variable_shape -- --device cuda:0
//! python3 benches/pytorch_reference.py variable_shape                     # PyTorch, same workload
//! ```
//!
//! The batch sizes come from splitmix64 (seed 0), as in the PyTorch reference, so both see the same
//! sequence.

use ndscope::nn::{self, Activation, Init, Mode, Module};
use ndscope::optim::{Adam, AdamConfig, Optimizer};
use ndscope::{Device, Error, Result, Tape, root};

const SIZES: [usize; 4] = [784, 1024, 1024, 10];
const MAX_BATCH: u64 = 512;

/// The k-th batch size: splitmix64(k) mod 512, plus one.
fn batch_size(k: u64) -> usize {
    let mut z = k.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z % MAX_BATCH) as usize + 1
}

fn run(device: Device, steps: u64) -> Result<()> {
    root(device, |m| {
        let mut model = nn::mlp(m, &SIZES, Activation::Relu, Init::KaimingUniform)?;
        let mut opt = Adam::new(m, &model, AdamConfig::adamw(1e-3, 1e-2))?;
        let start = std::time::Instant::now();
        let mut last_loss = 0.0;
        for k in 0..steps {
            let n = batch_size(k);
            last_loss = m.scope(|b| {
                let x = b.randn(&[n, SIZES[0]])?;
                let labels: Vec<i64> = (0..n as i64).map(|i| (i * 7 + k as i64) % 10).collect();
                let y = b.from_slice(&labels, &[n])?;
                let tape = Tape::new(b);
                let loss = model
                    .forward(&tape.constant(&x), Mode::Train)?
                    .cross_entropy(&y)?;
                let grads = tape.backward(&loss)?;
                opt.step(&mut model, &grads)?;
                loss.value().to_scalar::<f32>()
            })?;
        }
        device.synchronize()?;
        let mem = m.memory_stats(device);
        println!(
            "variable_shape on {device}: {steps} steps (batch 1..=512) in {:.1} s, last loss {last_loss:.3}",
            start.elapsed().as_secs_f64()
        );
        println!(
            "peak live {:.1} MB, peak allocated {:.1} MB, peak reserved {:.1} MB: reserved/live {:.2}x; \
             {:.1} MB cached at the end; {} allocator calls, {} segments",
            mem.peak_live_bytes as f64 / 1e6,
            mem.peak_allocated_bytes as f64 / 1e6,
            mem.peak_reserved_bytes as f64 / 1e6,
            mem.fragmentation(),
            mem.cached_bytes as f64 / 1e6,
            mem.allocator_calls,
            mem.segments,
        );
        Ok(())
    })
}

fn main() {
    let mut device = Device::Cpu;
    let mut steps = 2000;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().unwrap_or_default();
        let parsed = match flag.as_str() {
            "--device" => value
                .parse()
                .map(|d| device = d)
                .map_err(|e: Error| e.to_string()),
            "--steps" => value
                .parse()
                .map(|s| steps = s)
                .map_err(|e| format!("--steps: {e}")),
            _ => Err(format!(
                "unknown option {flag}; options: --device D, --steps N"
            )),
        };
        if let Err(e) = parsed {
            eprintln!("variable_shape: {e}");
            std::process::exit(2);
        }
    }
    if let Err(e) = run(device, steps) {
        eprintln!("variable_shape: {e}");
        std::process::exit(1);
    }
}
