//! Runs the MNIST-sized training step (784-256-10 MLP, batch 128, AdamW) in a loop, for profilers:
//! `perf record -g target/release/examples/profile_step 2000` or valgrind's callgrind.

use ndscope::nn::{self, Activation, Init, Mode, Module};
use ndscope::optim::{Adam, AdamConfig, Optimizer};
use ndscope::{Device, Error, Tape, root};

fn main() -> Result<(), Error> {
    let steps: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(500);
    let labels: Vec<i64> = (0..128).map(|i| i % 10).collect();
    root(Device::Cpu, |m| {
        let mut model = nn::mlp(m, &[784, 256, 10], Activation::Relu, Init::KaimingUniform)?;
        let mut opt = Adam::new(m, &model, AdamConfig::adamw(1e-3, 1e-4))?;
        let x = m.rand(&[128, 784])?;
        let y = m.from_slice(&labels, &[128])?;
        let started = std::time::Instant::now();
        for _ in 0..steps {
            m.scope(|b| {
                let tape = Tape::new(b);
                let loss = model
                    .forward(&tape.constant(&x), Mode::Train)?
                    .cross_entropy(&y)?;
                let grads = tape.backward(&loss)?;
                opt.step(&mut model, &grads)
            })?;
        }
        let per_step = started.elapsed().as_secs_f64() / steps as f64;
        println!(
            "{steps} steps, {:.3} ms a step, {:.0} steps/s",
            per_step * 1e3,
            1.0 / per_step
        );
        Ok(())
    })
}
