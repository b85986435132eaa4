//! Allocator churn: tensors of ever new sizes, each dropped at once, until a tebibyte has gone
//! through the allocator; then the largest single tensor the device still serves. A cache that only
//! grows would fill the device with idle blocks of sizes no later request fits; ndscope's pools give
//! them back when the device's allocator refuses, so the device stays usable to its last bytes.
//!
//! ```text
//! cargo run --release --features cuda --example churn -- --device cuda:0
//! (ulimit -v 8000000 && cargo run --release --example churn -- --limit 8192000000)
//! ```
//!
//! Sizes start at `--start` MiB (default: 1 GiB on a GPU, 64 MiB on the host) and grow 1.07x per
//! request; a refused request above 95% of the capacity starts the sizes over. Capacity: the GPU's
//! memory, or on the host the address-space limit given with `--limit` (the `ulimit -v` in bytes).

use ndscope::{DType, Device, Error, Result, gpu_memory, root};

const MIB: usize = 1 << 20;
const GIB: f64 = (1u64 << 30) as f64;

struct Options {
    device: Device,
    limit: Option<usize>,
    churn: u128,
    start: Option<usize>,
}

fn parse() -> std::result::Result<Options, String> {
    let mut o = Options {
        device: Device::Cpu,
        limit: None,
        churn: 1 << 40,
        start: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--device" => o.device = value()?.parse().map_err(|e: Error| e.to_string())?,
            "--limit" => o.limit = Some(value()?.parse().map_err(|e| format!("--limit: {e}"))?),
            "--churn-gib" => {
                o.churn = value()?
                    .parse::<u128>()
                    .map_err(|e| format!("--churn-gib: {e}"))?
                    << 30
            }
            "--start" => {
                o.start = Some(
                    value()?
                        .parse::<usize>()
                        .map_err(|e| format!("--start: {e}"))?
                        * MIB,
                )
            }
            _ => {
                return Err(format!(
                    "unknown option {flag}; options: --device D, --limit BYTES, --churn-gib N, --start MIB"
                ));
            }
        }
    }
    Ok(o)
}

/// Whether the device serves a tensor of `bytes` bytes now (allocated and dropped at once).
fn serves(s: &ndscope::Scope<'_>, bytes: usize) -> Result<bool> {
    match s.empty(&[bytes / 4], DType::F32) {
        Ok(_) => Ok(true),
        Err(Error::OutOfMemory { .. }) => Ok(false),
        Err(e) => Err(e),
    }
}

fn run(o: &Options) -> Result<()> {
    let capacity = match (o.device, o.limit) {
        (_, Some(limit)) => limit,
        (Device::Cuda(_), None) => gpu_memory(o.device)?.total_bytes,
        (Device::Cpu, None) => {
            eprintln!(
                "churn: on the host, run under `ulimit -v` and pass the limit in bytes with --limit"
            );
            std::process::exit(2);
        }
    };
    let start = o.start.unwrap_or(match o.device {
        Device::Cpu => 64 * MIB,
        Device::Cuda(_) => 1024 * MIB,
    });
    root(o.device, |s| {
        s.set_cache_limit(o.device, None); // only the refusal policy guards the device
        let (mut churned, mut requests, mut size) = (0u128, 0u64, start);
        let mut early_refusals = Vec::new();
        while churned < o.churn {
            requests += 1;
            if serves(s, size)? {
                churned += size as u128;
                size += size / 14; // 1.07x
            } else if size > capacity / 100 * 95 {
                size = start;
            } else {
                early_refusals.push(size);
                size = start;
            }
        }
        // The largest servable request, by bisection over 2 MiB steps.
        let (mut lo, mut hi) = (0, capacity.div_ceil(2 * MIB));
        while lo < hi {
            let mid = (lo + hi).div_ceil(2);
            if serves(s, mid * 2 * MIB)? {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        let largest = lo * 2 * MIB;
        println!(
            "churn on {}: {requests} requests, {:.0} GiB churned; largest request served afterwards \
             {:.2} GiB = {:.1}% of the {:.2} GiB capacity; refused below 95% during the churn: {}",
            o.device,
            churned as f64 / GIB,
            largest as f64 / GIB,
            100.0 * largest as f64 / capacity as f64,
            capacity as f64 / GIB,
            early_refusals.len()
        );
        println!("pool: {}", s.memory_stats(o.device));
        if largest < capacity / 100 * 95 || !early_refusals.is_empty() {
            eprintln!("FAILED: the target is >= 95% of the capacity and no refusal below it");
            std::process::exit(1);
        }
        Ok(())
    })
}

fn main() {
    let options = parse().unwrap_or_else(|e| {
        eprintln!("churn: {e}");
        std::process::exit(2)
    });
    if let Err(e) = run(&options) {
        eprintln!("churn: {e}");
        std::process::exit(1);
    }
}
