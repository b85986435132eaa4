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
    /// Allocations made in this scope itself while one of its child scopes was open: a step's
    /// tensors charged to a longer-lived scope, usually because the step's inputs were created there.
    /// Moves in (`ret`) are not counted, and a child's count is not added to its parent's. See
    /// [`Scope::set_strict`](crate::Scope::set_strict).
    pub outer_allocations: u64,
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
        if self.outer_allocations > 0 {
            write!(
                f,
                ", {} allocs while a child was open",
                self.outer_allocations
            )?;
        }
        Ok(())
    }
}

/// A tree's memory on one device, in the spirit of PyTorch's `torch.cuda.memory_stats`: what its
/// tensors use, what its pool holds from the device's allocator, and how the allocator answered.
/// From [`Scope::memory_stats`](crate::Scope::memory_stats).
///
/// Bytes come in three layers: `live_bytes` (what tensors use) ≤ `allocated_bytes` (the blocks that
/// hold them, rounded up to a size class or a 512-byte granule) ≤ `reserved_bytes` (everything taken
/// from the device's allocator: those blocks plus `cached_bytes` of idle ones). Workspace arenas are
/// counted by their workspace, not here.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// Bytes of the tree's live tensors in pool blocks (each block counted once).
    pub live_bytes: usize,
    /// The most `live_bytes` at once.
    pub peak_live_bytes: usize,
    /// Bytes of the blocks holding them.
    pub allocated_bytes: usize,
    /// The most `allocated_bytes` at once.
    pub peak_allocated_bytes: usize,
    /// Bytes held from the device's allocator: allocated and idle blocks.
    pub reserved_bytes: usize,
    /// The most `reserved_bytes` at once.
    pub peak_reserved_bytes: usize,
    /// Bytes of idle blocks kept for reuse (`reserved_bytes - allocated_bytes`).
    pub cached_bytes: usize,
    /// The most idle bytes the pool keeps (`None`: no bound); see
    /// [`Scope::set_cache_limit`](crate::Scope::set_cache_limit).
    pub cache_limit: Option<usize>,
    /// Segments held (allocations that large blocks are carved from).
    pub segments: usize,
    /// Calls to the device's allocator that returned memory.
    pub allocator_calls: u64,
    /// Memory returned to the device's allocator (trims, `empty_cache`, releases before retries).
    pub free_calls: u64,
    /// Times the device's allocator refused a request.
    pub refusals: u64,
    /// Times a refusal made the pool release idle memory (its own, then other trees' on the device)
    /// and ask again.
    pub retries: u64,
    /// Bytes released for those retries.
    pub released_for_retries: u64,
    /// Requests refused even after every release: each one an `Error::OutOfMemory`.
    pub failures: u64,
}

impl MemoryStats {
    /// Reserved bytes over live bytes at their peaks: how much more memory the device gave than the
    /// tensors ever needed at once (1.0 is perfect; size-class rounding, idle blocks that did not fit
    /// later requests and segment tails all raise it). `NaN` before any allocation.
    pub fn fragmentation(&self) -> f64 {
        self.peak_reserved_bytes as f64 / self.peak_live_bytes as f64
    }
}

impl fmt::Display for MemoryStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} live (peak {}), {} allocated, {} reserved (peak {}, {:.2}x the live peak), {} cached, {} segments, {} allocator calls",
            Bytes(self.live_bytes),
            Bytes(self.peak_live_bytes),
            Bytes(self.allocated_bytes),
            Bytes(self.reserved_bytes),
            Bytes(self.peak_reserved_bytes),
            self.fragmentation(),
            Bytes(self.cached_bytes),
            self.segments,
            self.allocator_calls,
        )?;
        if self.refusals > 0 {
            write!(
                f,
                ", {} refusals, {} retries releasing {}, {} failed",
                self.refusals,
                self.retries,
                Bytes(self.released_for_retries as usize),
                self.failures
            )?;
        }
        Ok(())
    }
}

/// `s` with the characters XML gives a meaning escaped, for the SVG charts (the timeline's and a
/// plan's).
pub(crate) fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}
