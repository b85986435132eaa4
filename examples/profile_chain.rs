//! Runs the 20-op elementwise chain of the benchmarks on a 1 KiB tensor in a loop, for profilers:
//! `perf record -g target/release/examples/profile_chain 2000000`.

use ndscope::{Device, Error, Result, Tensor, root};

fn chain<'s>(x: &Tensor<'s>) -> Result<Tensor<'s>> {
    let mut y = x.clone();
    for _ in 0..5 {
        let z = y.add_scalar(1.0)?.mul_scalar(0.5)?.maximum(x)?;
        y = z.add(x)?;
    }
    Ok(y)
}

fn main() -> Result<()> {
    let iterations: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(200_000);
    root(Device::Cpu, |s| {
        let x = s.randn(&[256])?;
        let started = std::time::Instant::now();
        for _ in 0..iterations {
            s.scope(|_| chain(&x).map(drop))?;
        }
        let per = started.elapsed().as_secs_f64() / iterations as f64;
        println!(
            "{iterations} chains, {:.2} us a chain, {:.0} ns an op",
            per * 1e6,
            per * 1e9 / 20.0
        );
        Ok::<_, Error>(())
    })
}
