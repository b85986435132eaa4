//! Workspaces: arenas that a scope allocates from by bumping a pointer and resets in O(1) when it
//! closes, reused cycle after cycle (DL4J's cyclic workspaces).
//!
//! The arena starts empty. During a cycle, requests that do not fit *spill* to the tree's pool, and the
//! workspace records how much the cycle would have needed: the top of a virtual bump pointer that also
//! advances for every spilled byte (a bump arena cannot reuse a block freed out of order, so a chain
//! of temporaries needs the sum of its allocations, not its peak of live bytes); when the cycle closes, the arena grows to
//! that size (one system allocation), so from the next cycle on a steady loop runs entirely inside it.
//! Resetting is safe without any run-time check because no tensor of a cycle can outlive it: the
//! cycle's tensors carry the workspace scope's lifetime.
//!
//! The arena lives on the device of the scopes that cycle in it (a workspace used under a GPU scope
//! learns a GPU arena). Requests for another device's memory during a cycle go to that device's pool.

use std::ptr::NonNull;

use crate::device::Device;
use crate::memory::raw::ALIGN;
use crate::memory::{raw, reclaim};

/// A reusable arena for a workspace scope; open a cycle with
/// [`Scope::workspace`](crate::Scope::workspace).
///
/// ```
/// use ndscope::{Device, Workspace};
/// let mut ws = Workspace::new("batch");
/// ndscope::root(Device::Cpu, |model| {
///     for _ in 0..3 {
///         model.workspace(&mut ws, |w| -> ndscope::Result<()> {
///             let x = w.ones(&[256])?;
///             let _y = x.mul_scalar(2.0)?;
///             Ok(())
///         })?;
///     }
///     Ok::<_, ndscope::Error>(())
/// })?;
/// assert_eq!(ws.cycles(), 3);
/// assert_eq!(ws.last_cycle_spills(), 0); // the third cycle ran inside the learned arena
/// # Ok::<(), ndscope::Error>(())
/// ```
pub struct Workspace {
    name: &'static str,
    buf: Option<NonNull<u8>>,
    /// Where `buf` lives.
    buf_device: Device,
    /// The device of the scope cycling now (or of the last cycle).
    cycle_device: Device,
    capacity: usize,
    top: usize,
    /// Peak of (arena top + bytes spilled so far) during the current cycle.
    demand: usize,
    spilled: usize,
    cycles: u64,
    spills: u64,
    last_cycle_spills: u64,
    grows: u64,
}

// SAFETY: a workspace owns its buffer exclusively; between cycles no tensor points into it (a cycle's
// tensors cannot outlive the cycle) and during a cycle it is mutably borrowed by the cycle's scope.
unsafe impl Send for Workspace {}

impl Workspace {
    /// An empty workspace; its arena is sized by the first cycles.
    pub fn new(name: &'static str) -> Workspace {
        Workspace {
            name,
            buf: None,
            buf_device: Device::Cpu,
            cycle_device: Device::Cpu,
            capacity: 0,
            top: 0,
            demand: 0,
            spilled: 0,
            cycles: 0,
            spills: 0,
            last_cycle_spills: 0,
            grows: 0,
        }
    }

    /// A workspace whose host arena is allocated up front with `bytes` bytes.
    pub fn with_capacity(name: &'static str, bytes: usize) -> Workspace {
        let mut ws = Workspace::new(name);
        ws.grow_to(Device::Cpu, bytes);
        ws
    }

    /// The name its cycles' scopes get in dumps.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Bytes of the arena.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The device the arena lives on (the host until a cycle on a GPU scope learns a GPU arena).
    pub fn device(&self) -> Device {
        self.buf_device
    }

    /// Cycles completed.
    pub fn cycles(&self) -> u64 {
        self.cycles
    }

    /// Requests that did not fit the arena, over all cycles.
    pub fn spills(&self) -> u64 {
        self.spills
    }

    /// Spills of the last completed cycle (0 once the arena has learned the loop's size).
    pub fn last_cycle_spills(&self) -> u64 {
        self.last_cycle_spills
    }

    /// Times the arena buffer was allocated: once by `with_capacity`, and once per growth to a learned
    /// size.
    pub fn grows(&self) -> u64 {
        self.grows
    }

    /// Bump-allocates `bytes` (> 0) of `device` memory, or `None` if the arena is full or on another
    /// device (the caller spills).
    pub(crate) fn bump(&mut self, device: Device, bytes: usize) -> Option<NonNull<u8>> {
        let size = bytes.next_multiple_of(ALIGN);
        let buf = self.buf?;
        if device != self.buf_device {
            return None;
        }
        if self.capacity - self.top < size {
            return None;
        }
        // SAFETY: `top + size <= capacity`, so the offset stays inside the buffer.
        let ptr = unsafe { buf.add(self.top) };
        self.top += size;
        self.demand = self.demand.max(self.top + self.spilled);
        Some(ptr)
    }

    /// Records a spill of `bytes` of `device` memory that went to the pool instead; returns whether it
    /// counts as a spill (requests for another device than the cycle's never fit the arena).
    pub(crate) fn note_spill(&mut self, device: Device, bytes: usize) -> bool {
        if device != self.cycle_device {
            return false;
        }
        self.spills += 1;
        self.last_cycle_spills += 1;
        self.spilled += bytes.next_multiple_of(ALIGN);
        self.demand = self.demand.max(self.top + self.spilled);
        true
    }

    /// Frees an arena region; only the topmost region actually rolls the pointer back (a chain of
    /// temporaries freed in reverse order reuses the same bytes).
    pub(crate) fn pop(&mut self, ptr: NonNull<u8>, bytes: usize) {
        let size = bytes.next_multiple_of(ALIGN);
        if let Some(buf) = self.buf
            && ptr.as_ptr() as usize + size == buf.as_ptr() as usize + self.top
        {
            self.top -= size;
        }
    }

    /// Starts a cycle of a scope on `device`.
    pub(crate) fn begin_cycle(&mut self, device: Device) {
        self.cycle_device = device;
        self.top = 0;
        self.demand = 0;
        self.spilled = 0;
        self.last_cycle_spills = 0;
    }

    /// Ends a cycle: resets the arena and grows it to what the cycle needed. Returns whether the arena
    /// was reallocated (a system allocation).
    pub(crate) fn end_cycle(&mut self) -> bool {
        self.cycles += 1;
        self.top = 0;
        let needed = self.demand;
        self.spilled = 0;
        let moved = self.buf_device != self.cycle_device && needed > 0;
        if needed > self.capacity || moved {
            self.grow_to(self.cycle_device, needed);
            return true;
        }
        false
    }

    fn grow_to(&mut self, device: Device, bytes: usize) {
        let bytes = bytes.next_multiple_of(ALIGN);
        if bytes == 0 {
            return;
        }
        self.release();
        // An arena the allocator refuses stays empty: the workspace then spills everything, which is
        // slower but correct.
        self.buf = reclaim::alloc(device, bytes).ok();
        if self.buf.is_some() {
            self.buf_device = device;
            self.capacity = bytes;
            self.grows += 1;
        }
    }

    fn release(&mut self) {
        if let Some(buf) = self.buf.take() {
            // SAFETY: `buf` came from `raw::alloc(buf_device, capacity)`; no tensor points into it
            // between cycles.
            unsafe { raw::free(self.buf_device, buf, self.capacity) };
        }
        self.capacity = 0;
    }
}

impl Drop for Workspace {
    fn drop(&mut self) {
        self.release();
    }
}

impl std::fmt::Debug for Workspace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Workspace")
            .field("name", &self.name)
            .field("capacity", &self.capacity)
            .field("device", &self.buf_device)
            .field("cycles", &self.cycles)
            .field("spills", &self.spills)
            .finish()
    }
}
