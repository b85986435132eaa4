//! Workspaces: arenas that a scope allocates from and resets in O(1) when it closes, reused cycle
//! after cycle (DL4J's cyclic workspaces).
//!
//! A workspace works in one of two modes.
//!
//! - **Bump** ([`Workspace::new`]): allocations bump a pointer. The arena starts empty. During a
//!   cycle, requests that do not fit *spill* to the tree's pool, and the workspace records how much the
//!   cycle would have needed: the top of a virtual bump pointer that also advances for every spilled
//!   byte (a bump arena cannot reuse a block freed out of order, so a chain of temporaries needs the sum
//!   of its allocations, not its peak of live bytes); when the cycle closes, the arena grows to that
//!   size (one system allocation), so from the next cycle on a steady loop runs entirely inside it.
//! - **Planned** ([`Workspace::planned`]): the first cycle allocates from the pool and records its
//!   sequence of allocations and frees; when it closes, a [`Plan`] gives every allocation an offset
//!   so that allocations alive at the same time never share a byte, and the arena is sized to the plan's
//!   peak — close to the largest total of bytes live at once, where a bump arena needs the sum of a
//!   chain. A later cycle that repeats the sequence gets each allocation by a table lookup. A cycle
//!   that diverges (another size, another order of frees, more allocations) keeps the slots it already
//!   has, takes the rest from the pool, and is planned anew when it closes.
//!
//! Resetting is safe without any run-time check because no tensor of a cycle can outlive it: the
//! cycle's tensors carry the workspace scope's lifetime. Reusing a planned slot within a cycle is safe
//! because the cycle has made exactly the recorded sequence up to that allocation, so every allocation
//! the plan lets the slot share bytes with has been freed.
//!
//! The arena lives on the device of the scopes that cycle in it (a workspace used under a GPU scope
//! learns a GPU arena; a GPU reuses bytes in stream order, as its pool does). Requests for another
//! device's memory during a cycle go to that device's pool.

use std::ptr::NonNull;

use crate::device::Device;
use crate::memory::block::NO_SLOT;
use crate::memory::plan::{Plan, Planner};
use crate::memory::raw::ALIGN;
use crate::memory::{raw, reclaim};

/// A reusable arena for a workspace scope; open a cycle with
/// [`Scope::workspace`](crate::Scope::workspace).
///
/// Two modes. [`Workspace::new`] bump-allocates: the arena learns the top a bump pointer reaches in
/// a cycle (a chain of temporaries needs the sum of its allocations) and suits any loop, including
/// one whose shapes change every cycle. [`Workspace::planned`] records the first cycle, solves an
/// offset for each allocation so that tensors alive at the same time never share a byte, and replays
/// those offsets in every cycle that repeats the sequence: its arena is near the cycle's live peak. A
/// cycle that differs is served from the pool for the rest of it and planned in its turn; four plans
/// are kept. Resetting and reusing the arena needs no run-time check: a cycle's tensors carry its
/// scope's lifetime, so none outlives it.
///
/// Scopes opened inside a cycle (a checkpointed segment's, a child `scope`) allocate from the same
/// arena and are planned with the cycle; tensors they `ret` to the cycle's scope stay where they are.
/// When the arena grows, the tree's pool first hands its idle blocks of that device back, so the
/// arena replaces the cache the learning cycle ran from instead of adding to it. Put a step's inputs
/// in the cycle's scope (`w.from_slice(..)`), not in the model scope: see [`Tape`](crate::Tape).
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
    /// `Some` in planned mode.
    planner: Option<Planner>,
}

/// What a workspace gives an allocation request.
pub(crate) struct Grant {
    /// Arena memory, or `None`: the caller takes the block from the pool.
    pub(crate) ptr: Option<NonNull<u8>>,
    /// The allocation's slot in a planned cycle, or `NO_SLOT`.
    pub(crate) slot: u32,
    /// Whether a request of the cycle's device went to the pool (counted as a spill).
    pub(crate) spilled: bool,
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
            planner: None,
        }
    }

    /// An empty planned workspace: its first cycle records the sequence of allocations, later cycles
    /// that repeat it get each allocation at an offset solved for it ([`Plan`]).
    ///
    /// ```
    /// use ndscope::{Device, Workspace};
    /// let mut ws = Workspace::planned("batch");
    /// ndscope::root(Device::Cpu, |model| {
    ///     for _ in 0..3 {
    ///         model.workspace(&mut ws, |w| -> ndscope::Result<()> {
    ///             let mut x = w.ones(&[1024])?;
    ///             for _ in 0..8 {
    ///                 x = x.mul_scalar(0.5)?; // each result frees the previous one
    ///             }
    ///             Ok(())
    ///         })?;
    ///     }
    ///     Ok::<_, ndscope::Error>(())
    /// })?;
    /// let plan = ws.plan().expect("the first cycle was planned");
    /// assert_eq!(plan.peak(), plan.lower_bound()); // two live buffers of 4 KiB
    /// assert_eq!(plan.peak(), 8192);
    /// assert_eq!(plan.bump_size(), 9 * 4096); // a bump arena needs the whole chain
    /// assert_eq!(ws.capacity(), 8192);
    /// assert_eq!(ws.replayed_cycles(), 2);
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    pub fn planned(name: &'static str) -> Workspace {
        Workspace {
            planner: Some(Planner::default()),
            ..Workspace::new(name)
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

    /// Whether the workspace plans its cycles ([`Workspace::planned`]).
    pub fn is_planned(&self) -> bool {
        self.planner.is_some()
    }

    /// The plan in use, or last used (planned mode, after the first cycle).
    pub fn plan(&self) -> Option<&Plan> {
        self.plans().first()
    }

    /// The plans kept for replay, the one in use (or last used) first: a cycle that starts like
    /// none of them is planned anew, and up to four plans are kept, so loops that alternate between a
    /// few shapes (a last, smaller batch per epoch) replay without planning again.
    pub fn plans(&self) -> &[Plan] {
        self.planner.as_ref().map_or(&[], |p| p.plans())
    }

    /// Cycles that followed the plan to their end (planned mode).
    pub fn replayed_cycles(&self) -> u64 {
        self.planner.as_ref().map_or(0, |p| p.replayed_cycles)
    }

    /// Plans solved: one for the first cycle and one per cycle that diverged (planned mode).
    pub fn plans_solved(&self) -> u64 {
        self.planner.as_ref().map_or(0, |p| p.plans_solved)
    }

    /// Whether the last completed cycle followed the plan (planned mode).
    pub fn last_cycle_replayed(&self) -> bool {
        self.planner.as_ref().is_some_and(|p| p.last_cycle_replayed)
    }

    /// Whether the current cycle has followed the plan so far (planned mode).
    pub(crate) fn replaying(&self) -> bool {
        self.planner.as_ref().is_some_and(|p| p.replaying())
    }

    /// Memory for a request of `bytes` (> 0) of `device` memory during a cycle.
    #[inline]
    pub(crate) fn alloc(&mut self, device: Device, bytes: usize) -> Grant {
        let size = bytes.next_multiple_of(ALIGN);
        if let Some(p) = &mut self.planner
            && device == self.cycle_device
        {
            let (slot, offset) = p.alloc(size);
            if let (Some(offset), Some(buf)) = (offset, self.buf) {
                // SAFETY: the planner replays only plans whose peak fits the arena (`begin_cycle`
                // gives it the arena's size), and every slot ends at or below its plan's peak.
                let ptr = unsafe { buf.add(offset) };
                return Grant {
                    ptr: Some(ptr),
                    slot,
                    spilled: false,
                };
            }
            return Grant {
                ptr: None,
                slot,
                spilled: self.note_spill(device, bytes),
            };
        }
        if self.planner.is_none()
            && let Some(ptr) = self.bump(device, bytes)
        {
            return Grant {
                ptr: Some(ptr),
                slot: NO_SLOT,
                spilled: false,
            };
        }
        Grant {
            ptr: None,
            slot: NO_SLOT,
            spilled: self.note_spill(device, bytes),
        }
    }

    /// Allocation `slot` of the current planned cycle was freed or left the cycle's scope.
    #[inline]
    pub(crate) fn leave(&mut self, slot: u32) {
        if let Some(p) = &mut self.planner {
            p.free(slot);
        }
    }

    /// Bump-allocates `bytes` (> 0) of `device` memory, or `None` if the arena is full or on another
    /// device (the caller spills).
    fn bump(&mut self, device: Device, bytes: usize) -> Option<NonNull<u8>> {
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
    fn note_spill(&mut self, device: Device, bytes: usize) -> bool {
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
        if self.planner.is_some() {
            return; // planned slots stay where the plan put them
        }
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
        let room = if self.buf.is_some() && self.buf_device == device {
            self.capacity
        } else {
            0
        };
        if let Some(p) = &mut self.planner {
            p.begin(room);
        }
    }

    /// Ends a cycle: resets the arena and grows it to what the cycle needed. Before a new arena is
    /// allocated, `make_room(device)` hands the idle blocks of the pool the cycle spilled to back to
    /// the device, so the arena takes their place instead of adding to them: the cycle that learned
    /// the size ran from that pool, and its blocks are idle now. Returns whether the arena was
    /// reallocated (a system allocation).
    pub(crate) fn end_cycle(&mut self, make_room: impl FnOnce(Device)) -> bool {
        self.cycles += 1;
        self.top = 0;
        let mut needed = self.demand;
        self.spilled = 0;
        if let Some(p) = &mut self.planner {
            match p.end() {
                Some(peak) => needed = peak,
                None => return false,
            }
        }
        let moved = self.buf_device != self.cycle_device && needed > 0;
        if needed > self.capacity || moved {
            self.release();
            make_room(self.cycle_device);
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
            .field("plan", &self.plan())
            .finish()
    }
}
