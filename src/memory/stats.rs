//! Per-scope memory statistics.

use std::fmt;

/// A snapshot of a scope's memory counters, from [`Scope::stats`](crate::Scope::stats).
///
/// `live_*` count the blocks this scope owns itself; `subtree_bytes` and `peak_bytes` include the
/// scopes open below it. The event counters (`allocations`, `reuses`, ...) include the events of
/// child scopes that have closed, so the stats of a model scope after a loop of batch scopes account
/// for every batch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ScopeStats {
    /// Storage blocks owned by this scope (views and clones share one block).
    pub live_tensors: usize,
    /// Bytes of those blocks.
    pub live_bytes: usize,
    /// Live bytes of this scope and every open scope below it.
    pub subtree_bytes: usize,
    /// Highest `subtree_bytes` since the scope opened or since [`reset_peak`](crate::Scope::reset_peak).
    pub peak_bytes: usize,
    /// Blocks allocated (from the cache, the arena or the system).
    pub allocations: u64,
    /// Allocations served from the tree's cache of freed blocks.
    pub reuses: u64,
    /// Calls to the system allocator (host block memory, host arena growth, header chunks).
    pub system_allocations: u64,
    /// Calls to a GPU's memory allocator (GPU blocks the cache could not serve, GPU arena growth).
    /// A steady-state training step on a GPU makes none.
    pub device_allocations: u64,
    /// Bytes of freed blocks the tree keeps cached for reuse (the whole tree's cache).
    pub cached_bytes: usize,
    /// Workspace requests that did not fit the arena and went to the pool.
    pub spills: u64,
    /// Blocks still held by forgotten handles when their scope closed, and reclaimed then.
    pub reclaimed_tensors: u64,
    /// Bytes of those blocks.
    pub reclaimed_bytes: u64,
    /// Blocks moved into this scope by `ret`/`move_to` without copying.
    pub moved_in: u64,
    /// Allocations refused by a budget or by the system allocator.
    pub ooms: u64,
}

impl ScopeStats {
    /// Adds the event counters of a closing child scope.
    pub(crate) fn absorb(&mut self, child: &ScopeStats) {
        self.allocations += child.allocations;
        self.reuses += child.reuses;
        self.system_allocations += child.system_allocations;
        self.device_allocations += child.device_allocations;
        self.spills += child.spills;
        self.reclaimed_tensors += child.reclaimed_tensors;
        self.reclaimed_bytes += child.reclaimed_bytes;
        self.moved_in += child.moved_in;
        self.ooms += child.ooms;
    }
}

/// Formats a byte count for people: `812 B`, `3.1 KiB`, `1.50 MiB`.
pub(crate) struct Bytes(pub usize);

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
        if self.0 < 1024 {
            return write!(f, "{} B", self.0);
        }
        let mut v = self.0 as f64 / 1024.0;
        let mut unit = 0;
        while v >= 1024.0 && unit < UNITS.len() - 1 {
            v /= 1024.0;
            unit += 1;
        }
        write!(f, "{v:.1} {}", UNITS[unit])
    }
}

impl fmt::Display for ScopeStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} tensors, {} live, {} peak, {} allocs ({} reused, {} from system)",
            self.live_tensors,
            Bytes(self.live_bytes),
            Bytes(self.peak_bytes),
            self.allocations,
            self.reuses,
            self.system_allocations
        )?;
        if self.device_allocations > 0 {
            write!(f, ", {} from the GPU allocator", self.device_allocations)?;
        }
        if self.spills > 0 {
            write!(f, ", {} spills", self.spills)?;
        }
        if self.reclaimed_tensors > 0 {
            write!(
                f,
                ", {} reclaimed ({})",
                self.reclaimed_tensors,
                Bytes(self.reclaimed_bytes as usize)
            )?;
        }
        if self.ooms > 0 {
            write!(f, ", {} refused", self.ooms)?;
        }
        Ok(())
    }
}
