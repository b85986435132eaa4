//! The system scope: the never-closing owner of moved-out tensors.
//!
//! Moved-out tensors (`Tensor<'static>`) may move between threads, so the system scope keeps no list
//! of its blocks, only the atomic counters of `memory::block::SYSTEM`; each block is freed by its last
//! handle.

use crate::memory::block::SYSTEM;
use crate::memory::stats::ScopeStats;

/// Counters of the system scope (moved-out tensors of every thread): live tensors and bytes, and the
/// blocks allocated so far. Other fields are zero: system blocks bypass the pools.
pub fn system_stats() -> ScopeStats {
    let (live_tensors, live_bytes, allocations) = SYSTEM.counts();
    ScopeStats {
        live_tensors,
        live_bytes,
        subtree_bytes: live_bytes,
        allocations,
        system_allocations: allocations,
        ..ScopeStats::default()
    }
}
