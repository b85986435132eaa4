//! All-reduce bus bandwidth of host tensors through MPI, 1 KiB to 256 MiB, as nccl-tests and the
//! OSU benchmarks report it: `busbw = bytes / time * 2 (n - 1) / n` for `n` ranks. Run under
//! `mpirun` (its own main; criterion cannot coordinate ranks), beside the same sizes through
//! mpi4py (`benches/allreduce_reference.py`):
//!
//! ```text
//! cargo bench --features mpi --bench allreduce --no-run
//! mpirun -np 2 target/release/deps/allreduce-<hash>
//! ```

use std::time::Instant;

use ndscope::dist::{ProcessGroup, Reduce};
use ndscope::{Device, root};

fn main() -> ndscope::Result<()> {
    let group = ProcessGroup::mpi()?;
    let (rank, world) = (group.rank(), group.world_size());
    if rank == 0 {
        println!("# ndscope all-reduce (sum, f32, out of place) over {world} ranks through MPI");
        println!(
            "{:>12} {:>8} {:>12} {:>12}",
            "bytes", "iters", "time (us)", "busbw (GB/s)"
        );
    }
    let max_bytes: usize = std::env::var("ALLREDUCE_MAX_BYTES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256 << 20);
    let mut bytes = 1024;
    while bytes <= max_bytes {
        let elements = bytes / 4;
        // About 0.2 s of work per size, at least 5 iterations.
        let iters = ((64 << 20) / bytes).clamp(5, 2000);
        let seconds = root(Device::Cpu, |s| {
            let t = s.full(&[elements], 1.0)?;
            for _ in 0..3 {
                group.all_reduce(&t, Reduce::Sum)?; // warm-up: pool and MPI buffers
            }
            group.barrier()?;
            let start = Instant::now();
            for _ in 0..iters {
                let out = group.all_reduce(&t, Reduce::Sum)?;
                std::hint::black_box(&out);
            }
            let mine = start.elapsed().as_secs_f64() / iters as f64;
            // The slowest rank's time is the collective's.
            let all = group.all_gather(&s.from_slice(&[mine], &[1])?)?;
            Ok::<_, ndscope::Error>(all.to_vec::<f64>()?.into_iter().fold(0.0, f64::max))
        })?;
        let busbw = bytes as f64 / seconds * 2.0 * (world as f64 - 1.0) / world as f64 / 1e9;
        if rank == 0 {
            println!(
                "{bytes:>12} {iters:>8} {:>12.2} {busbw:>12.3}",
                seconds * 1e6
            );
        }
        bytes *= 4;
    }
    Ok(())
}
