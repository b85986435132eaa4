//! The system scope: the never-closing owner of detached tensors.
//!
//! Detached tensors (`Tensor<'static>`) may move between threads, so the system scope keeps no list
//! of its blocks, only atomic counters; each block is freed by its last handle.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use crate::memory::stats::ScopeStats;

static LIVE_TENSORS: AtomicUsize = AtomicUsize::new(0);
static LIVE_BYTES: AtomicUsize = AtomicUsize::new(0);
static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

pub(crate) fn on_alloc(bytes: usize) {
    LIVE_TENSORS.fetch_add(1, Ordering::Relaxed);
    LIVE_BYTES.fetch_add(bytes, Ordering::Relaxed);
    ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
}

pub(crate) fn on_free(bytes: usize) {
    LIVE_TENSORS.fetch_sub(1, Ordering::Relaxed);
    LIVE_BYTES.fetch_sub(bytes, Ordering::Relaxed);
}

/// Counters of the system scope (detached tensors of every thread): live tensors and bytes, and the
/// blocks allocated so far. Other fields are zero: detached blocks bypass the pools.
pub fn system_stats() -> ScopeStats {
    let live_bytes = LIVE_BYTES.load(Ordering::Relaxed);
    ScopeStats {
        live_tensors: LIVE_TENSORS.load(Ordering::Relaxed),
        live_bytes,
        subtree_bytes: live_bytes,
        allocations: ALLOCATIONS.load(Ordering::Relaxed),
        system_allocations: ALLOCATIONS.load(Ordering::Relaxed),
        ..ScopeStats::default()
    }
}
