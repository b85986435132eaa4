//! Keeping rayon's workers awake through a run of short parallel ops.
//!
//! Decoding a token is about a hundred parallel products of 20 to 300 µs each, separated by short
//! ops on the calling thread (norms, the activations' rounding, one row's attention). Rayon's idle
//! worker yields 32 times and then sleeps on a futex, so after most of those gaps the next product
//! has to wake it, and a sleeping virtual CPU takes tens of microseconds to come back: the calling
//! thread starts the product alone, and the worker joins late. llama.cpp's threads spin between the
//! ops of a graph instead.
//!
//! So every parallel op of a short run calls [`hold`]: it notes the time, and if no worker is
//! already being kept, broadcasts a *keeper* to each worker but the caller. A keeper runs whatever
//! work the pool has (`rayon::yield_now`, so a product's tasks start on it at once) and otherwise
//! yields the core (`sched_yield`, as rayon's own idle rounds do: another runnable thread gets the
//! core, and valgrind's serialised threads progress), until [`HOLD`] has passed without a new op;
//! then it returns and the worker sleeps as usual. An idle program therefore spins for at most
//! [`HOLD`] after its last op, and nothing is held between calls but three atomics.
//!
//! Measured on the 2-core CI machine (AMD EPYC, Zen 4), `tg128` of `benches/gguf.rs` interleaved
//! with the build before: a patched rayon whose workers never slept decoded GPT-2 small Q4_0 at
//! 261 tokens/s against 243 (medians of five), and these keepers at 263; BENCHMARKS.md has the
//! figures of the whole change.

use std::sync::Arc;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// How long keepers stay after the latest op: longer than the gaps within a decoding step (the
/// attention of a long context, a token's sampling), short against anything a user would notice.
const HOLD: Duration = Duration::from_millis(2);

/// When the latest op that asked for warm workers started, in nanoseconds from [`epoch`].
static LATEST: AtomicU64 = AtomicU64::new(0);
/// Whether keepers are running (or broadcast and about to run).
static KEEPING: AtomicBool = AtomicBool::new(false);

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

fn now() -> u64 {
    epoch().elapsed().as_nanos() as u64
}

/// Marks the start of a parallel op, and keeps the current pool's other workers awake until
/// [`HOLD`] passes without another one.
pub(super) fn hold() {
    let threads = rayon::current_num_threads();
    if threads < 2 {
        return;
    }
    LATEST.store(now(), Ordering::Relaxed);
    if KEEPING.swap(true, Ordering::AcqRel) {
        return;
    }
    // The caller's own copy of the broadcast returns at once: it only runs when the caller, a worker
    // of the pool, next waits for work, and it must not keep the caller from its own op.
    let caller = rayon::current_thread_index();
    let keepers = Arc::new(AtomicUsize::new(threads - usize::from(caller.is_some())));
    rayon::spawn_broadcast(move |context| {
        if Some(context.index()) == caller {
            return;
        }
        keep();
        if keepers.fetch_sub(1, Ordering::AcqRel) == 1 {
            KEEPING.store(false, Ordering::Release);
        }
    });
}

/// One worker's keeper: runs the pool's work as it comes until [`HOLD`] passes without an op.
fn keep() {
    let hold = HOLD.as_nanos() as u64;
    loop {
        if let Some(rayon::Yield::Executed) = rayon::yield_now() {
            continue;
        }
        if now().saturating_sub(LATEST.load(Ordering::Relaxed)) > hold {
            return;
        }
        std::thread::yield_now();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;

    #[test]
    fn keepers_run_the_work_and_then_let_the_workers_sleep() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        pool.install(|| {
            for round in 0..50 {
                hold();
                let sum: u64 = (0..10_000u64).into_par_iter().map(|i| i * round).sum();
                assert_eq!(sum, round * 10_000 * 9_999 / 2);
            }
        });
        // Every keeper returns once the ops stop (other tests' ops may hold them a while longer).
        let start = Instant::now();
        while KEEPING.load(Ordering::Acquire) {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "the keepers did not return after the ops stopped"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}
