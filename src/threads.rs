//! The CPU backend's threads: rayon's global pool, and whether the thread that drives the model is
//! one of its workers.
//!
//! Each op the CPU backend splits (a product, a normalisation over rows, attention) hands its
//! pieces to rayon's global pool. Called from a thread outside the pool (a program's `main`), rayon
//! queues the op for the pool's workers and puts the caller to sleep until they are done: every op
//! costs a wake-up on each side, and the caller's core sits idle meanwhile. Decoding runs hundreds
//! of such ops per token, each a few tens of microseconds long, so that overhead is a large share of
//! the step: GPT-2 small on its Q4_0 blocks decodes 175 tokens/s on two threads driven from `main`,
//! and 255 tokens/s when `main` is one of the two workers (BENCHMARKS.md, "Quantized weights").
//! [`work_on_this_thread`] makes the calling thread a worker: it computes its share of each op and
//! waits by stealing work rather than sleeping, as llama.cpp's main thread does in its own pool.

use crate::error::{Error, Result};

/// Builds rayon's global pool with the calling thread as one of its workers, and returns how many
/// workers it has: `threads`, or (`None`) `RAYON_NUM_THREADS` if set, else one per core. Call it
/// first thing in `main`, before anything uses rayon (any tensor op does), from the thread that will
/// drive the model, and keep that thread alive as long as the program computes (in `main` it is).
///
/// Nothing else changes: without the call, rayon builds its pool of its own on first use, with
/// the caller outside it.
///
/// ```no_run
/// fn main() -> ndscope::Result<()> {
///     let workers = ndscope::threads::work_on_this_thread(None)?;
///     println!("computing on {workers} threads, this one included");
///     // ... load a model and decode, train, ...
///     Ok(())
/// }
/// ```
///
/// # Errors
/// [`Error::InvalidArgument`] when rayon's global pool already exists (built by an earlier call,
/// by the program, or by some op that ran before); `Some(0)` threads.
pub fn work_on_this_thread(threads: Option<usize>) -> Result<usize> {
    let op = "threads::work_on_this_thread";
    if threads == Some(0) {
        return Err(Error::InvalidArgument {
            op,
            reason: "needs at least one thread (None: RAYON_NUM_THREADS, or one per core)".into(),
        });
    }
    let mut builder = rayon::ThreadPoolBuilder::new().use_current_thread();
    if let Some(n) = threads {
        builder = builder.num_threads(n);
    }
    builder.build_global().map_err(|e| Error::InvalidArgument {
        op,
        reason: format!(
            "rayon's global pool already exists ({e}): call this first thing in main, before any \
             tensor op"
        ),
    })?;
    Ok(rayon::current_num_threads())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_threads_is_refused_before_the_pool_is_touched() {
        let err = work_on_this_thread(Some(0)).unwrap_err();
        assert!(err.to_string().contains("at least one thread"), "{err}");
    }
}
