//! Peak memory of 1,000 training steps of a 784-256-10 MLP (batch 128, AdamW), in ndscope or in
//! candle-core, one framework per process so the process's peak resident set is its own:
//!
//! ```text
//! cargo run --release --example peak_memory -- ndscope
//! cargo run --release --example peak_memory -- candle
//! ```
//!
//! ndscope also reports its own stats: the tree's peak bytes after the first 10 steps and after the
//! last, which must be equal (flat memory).

use candle_core as candle;
use ndscope::nn::{self, Activation, Init, Mode, Module};
use ndscope::optim::{Adam, AdamConfig, Optimizer};
use ndscope::{Device, Error, Tape, root};

const STEPS: usize = 1_000;
const SIZES: [usize; 3] = [784, 256, 10];
const BATCH: usize = 128;

/// The process's peak resident set in KiB (`VmHWM` of /proc/self/status), where Linux reports it.
fn peak_rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn labels() -> Vec<i64> {
    (0..BATCH as i64).map(|i| i % 10).collect()
}

fn run_ndscope() -> Result<(), Error> {
    root(Device::Cpu, |m| {
        let mut model = nn::mlp(m, &SIZES, Activation::Relu, Init::KaimingUniform)?;
        let mut opt = Adam::new(m, &model, AdamConfig::adamw(1e-3, 1e-4))?;
        let x = m.rand(&[BATCH, SIZES[0]])?;
        let y = m.from_slice(&labels(), &[BATCH])?;
        let mut peak_after_10 = 0;
        for step in 1..=STEPS {
            m.scope(|b| {
                let tape = Tape::new(b);
                let loss = model
                    .forward(&tape.constant(&x), Mode::Train)?
                    .cross_entropy(&y)?;
                let grads = tape.backward(&loss)?;
                opt.step(&mut model, &grads)
            })?;
            if step == 10 {
                peak_after_10 = m.stats().peak_bytes;
            }
        }
        let st = m.stats();
        println!(
            "ndscope: {STEPS} steps; tree peak {} B after 10 steps, {} B after {STEPS}; model live {} B; \
             {} allocations ({} from the system); peak RSS {} KiB",
            peak_after_10,
            st.peak_bytes,
            st.live_bytes,
            st.allocations,
            st.system_allocations,
            peak_rss_kib().map_or("unknown".into(), |k| k.to_string())
        );
        Ok(())
    })
}

fn run_candle() -> candle::Result<()> {
    let dev = candle::Device::Cpu;
    let mut params = Vec::new();
    for pair in SIZES.windows(2) {
        let bound = (6.0 / pair[0] as f64).sqrt() as f32;
        params.push(candle::Var::from_tensor(&candle::Tensor::rand(
            -bound,
            bound,
            (pair[1], pair[0]),
            &dev,
        )?)?);
        params.push(candle::Var::zeros(pair[1], candle::DType::F32, &dev)?);
    }
    let mut moments: Vec<(candle::Tensor, candle::Tensor)> = params
        .iter()
        .map(|p| Ok((p.zeros_like()?, p.zeros_like()?)))
        .collect::<candle::Result<_>>()?;
    let x = candle::Tensor::rand(0f32, 1.0, (BATCH, SIZES[0]), &dev)?;
    let y = candle::Tensor::from_slice(&labels(), BATCH, &dev)?;
    let (lr, b1, b2, eps, wd) = (1e-3, 0.9f64, 0.999f64, 1e-8, 1e-4);
    for step in 1..=STEPS as i32 {
        let h = x
            .matmul(&params[0].t()?)?
            .broadcast_add(&params[1])?
            .relu()?;
        let logits = h.matmul(&params[2].t()?)?.broadcast_add(&params[3])?;
        let picked = logits.gather(&y.unsqueeze(1)?, 1)?.squeeze(1)?;
        let loss = (logits.log_sum_exp(1)? - picked)?.mean_all()?;
        let grads = loss.backward()?;
        let (c1, c2) = (1.0 - b1.powi(step), 1.0 - b2.powi(step));
        for (var, (m, v)) in params.iter().zip(moments.iter_mut()) {
            let Some(g) = grads.get(var) else { continue };
            *m = ((&*m * b1)? + (g * (1.0 - b1))?)?;
            *v = ((&*v * b2)? + (g.sqr()? * (1.0 - b2))?)?;
            let update = ((&*m / c1)? / ((&*v / c2)?.sqrt()? + eps)?)?;
            var.set(&((var.as_tensor() * (1.0 - lr * wd))? - (update * lr)?)?)?;
        }
    }
    println!(
        "candle: {STEPS} steps; peak RSS {} KiB",
        peak_rss_kib().map_or("unknown".into(), |k| k.to_string())
    );
    Ok(())
}

fn main() {
    let outcome = match std::env::args().nth(1).as_deref() {
        Some("ndscope") => run_ndscope().map_err(|e| e.to_string()),
        Some("candle") => run_candle().map_err(|e| e.to_string()),
        _ => Err("name a framework: `-- ndscope` or `-- candle`".into()),
    };
    if let Err(e) = outcome {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
