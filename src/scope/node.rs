//! The run-time side of a scope: a node in the scope tree that owns blocks and counts them.
//!
//! Nodes live in the stack frames of `root`/`scope` calls and link to each other with raw pointers
//! (parent, children, the intrusive list of owned blocks). That is sound because scopes nest strictly in
//! time on one thread: a child's frame ends before its parent's, and a node unlinks itself when its
//! frame ends. Nothing here allocates in the steady state.

use std::cell::{Cell, RefCell};
use std::panic::Location;
use std::ptr::{self, NonNull};
use std::sync::Arc;

use crate::device::Device;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::checked_numel;
use crate::memory::arena::{Grant, Workspace};
use crate::memory::block::{
    BlockHeader, BlockOwner, BlockRef, HeaderSlab, Home, NO_SLOT, Region, ShapeSummary,
};
use crate::memory::pool::{Pool, Source, Taken};
use crate::memory::raw::{self, ALIGN, DeviceMemory};
use crate::memory::reclaim::{Refused, SharedPool, default_cache_limit};
use crate::memory::stats::{MemoryStats, ScopeStats};
use crate::rng::Stream;
use crate::scope::fault::FaultPlan;
use crate::scope::timeline::{EventKind, Recorder};

thread_local! {
    /// Scopes opened so far on this thread; a scope opened later closes earlier (LIFO).
    static OPENED: Cell<u64> = const { Cell::new(0) };
    /// The scope that op results go to while a differentiable op runs (see [`Placement`]); null
    /// when none.
    static PLACE_IN: Cell<*const ScopeNode> = const { Cell::new(ptr::null()) };
}

/// While it lives, op results on this thread go to a given scope when it closes sooner than every
/// operand's owner (or to the operands' innermost owner, as always, when none is given).
///
/// Sound only for code whose every result is typed with that scope's brand: a tape sets its scope
/// around the body of each differentiable op (library code, whose results are all `Tensor<'s>` of
/// the tape's scope), and clears it around user code it calls (a checkpointed layer's forward).
/// Guards nest: dropping one restores what was set before it.
/// The guard borrows the scope it places in (`'a`), so it cannot outlive it.
pub(crate) struct Placement<'a> {
    previous: *const ScopeNode,
    _scope: std::marker::PhantomData<&'a ScopeNode>,
}

impl<'a> Placement<'a> {
    /// Results go to `node` (or their innermost operand owner, if that closes sooner) until the
    /// guard drops.
    pub(crate) fn into(node: &'a ScopeNode) -> Placement<'a> {
        Placement {
            previous: PLACE_IN.with(|p| p.replace(node)),
            _scope: std::marker::PhantomData,
        }
    }

    /// Results go to their innermost operand owner until the guard drops.
    pub(crate) fn cleared() -> Placement<'static> {
        Placement {
            previous: PLACE_IN.with(|p| p.replace(ptr::null())),
            _scope: std::marker::PhantomData,
        }
    }
}

impl Placement<'_> {
    /// The scope results go to now, if one is set.
    pub(crate) fn current<'n>() -> Option<&'n ScopeNode> {
        // SAFETY: a pointer is set only by a guard that borrows its node (so the node is open while
        // the guard lives), and dropping that guard, or an inner one, restores the pointer before;
        // guards are locals of op bodies, dropped in reverse order. The caller uses the reference at
        // once, to allocate, while the guard that set it is alive.
        PLACE_IN.with(|p| unsafe { p.get().as_ref() })
    }
}

impl Drop for Placement<'_> {
    fn drop(&mut self) {
        PLACE_IN.with(|p| p.set(self.previous));
    }
}

/// State shared by every scope of one tree: the block caches, the header slab and the RNG.
pub(crate) struct TreeState {
    /// One caching pool per device the tree has allocated on; the host's comes first. Pools are
    /// shared with the process-wide registry, through which other trees release their idle blocks.
    pools: RefCell<Vec<Arc<SharedPool>>>,
    pub(crate) slab: RefCell<HeaderSlab>,
    pub(crate) random: Cell<Stream>,
    pub(crate) root: Cell<*const ScopeNode>,
    pub(crate) faults: FaultPlan,
    pub(crate) timeline: Recorder,
}

impl TreeState {
    pub(crate) fn new() -> TreeState {
        TreeState {
            pools: RefCell::new(vec![SharedPool::register(Device::Cpu)]),
            slab: RefCell::new(HeaderSlab::default()),
            random: Cell::new(Stream::new(crate::rng::DEFAULT_SEED)),
            root: Cell::new(ptr::null()),
            faults: FaultPlan::default(),
            timeline: Recorder::default(),
        }
    }

    /// The tree's pool of `device` memory, created on first use.
    #[inline]
    fn pool(&self, device: Device) -> Arc<SharedPool> {
        if let Some(pool) = self.pools.borrow().iter().find(|p| p.device() == device) {
            return Arc::clone(pool);
        }
        let pool = SharedPool::register(device);
        self.pools.borrow_mut().push(Arc::clone(&pool));
        pool
    }

    /// Runs `f` on the pool of `device`, if the tree has one.
    fn with_pool<R>(
        &self,
        device: Device,
        f: impl FnOnce(&mut Pool<DeviceMemory>) -> R,
    ) -> Option<R> {
        let pools = self.pools.borrow();
        let pool = pools.iter().find(|p| p.device() == device)?;
        Some(f(&mut pool.lock()))
    }

    /// A cached or new block of `device` memory of at least `bytes` (> 0) bytes, under the pools'
    /// refusal policy.
    #[inline]
    fn take(&self, device: Device, bytes: usize) -> std::result::Result<Taken, Refused> {
        let pools = self.pools.borrow();
        match pools.iter().find(|p| p.device() == device) {
            Some(pool) => pool.take(bytes),
            None => {
                drop(pools);
                self.pool(device).take(bytes)
            }
        }
    }

    /// Caches a block of `device` memory holding `bytes` used bytes.
    ///
    /// # Safety
    /// As for [`Pool::give`]: `ptr` came from [`TreeState::take`] on `device` with this `capacity`,
    /// and nothing uses it any more.
    #[inline]
    unsafe fn give(&self, device: Device, ptr: NonNull<u8>, bytes: usize, capacity: usize) {
        // SAFETY: forwarded from the caller.
        let given = self.with_pool(device, |pool| unsafe { pool.give(ptr, bytes, capacity) });
        debug_assert!(
            given.is_some(),
            "a block goes back to the pool it came from"
        );
    }

    /// Bytes cached by every pool of the tree.
    pub(crate) fn cached_bytes(&self) -> usize {
        self.pools
            .borrow()
            .iter()
            .map(|p| p.lock().cached_bytes())
            .sum()
    }

    /// Hands every cached block back to its device's allocator; returns the bytes released.
    pub(crate) fn empty_cache(&self) -> usize {
        self.pools.borrow().iter().map(|p| p.lock().empty()).sum()
    }

    /// Hands cached blocks back (largest first, pool by pool) until at most `max_cached` bytes stay
    /// cached in the whole tree or nothing more can go; returns the bytes released.
    pub(crate) fn trim_cache(&self, max_cached: usize) -> usize {
        let mut excess = self.cached_bytes().saturating_sub(max_cached);
        let mut released = 0;
        for pool in self.pools.borrow().iter() {
            if excess == 0 {
                break;
            }
            let mut pool = pool.lock();
            let keep = pool.cached_bytes().saturating_sub(excess);
            let freed = pool.trim(keep);
            excess = excess.saturating_sub(freed);
            released += freed;
        }
        released
    }

    /// The counters of the tree's pool of `device` (all zero if the tree never used it).
    pub(crate) fn memory_stats(&self, device: Device) -> MemoryStats {
        self.with_pool(device, |p| p.stats())
            .unwrap_or(MemoryStats {
                cache_limit: default_cache_limit(device),
                ..MemoryStats::default()
            })
    }

    /// Sets the most idle bytes the pool of `device` keeps.
    pub(crate) fn set_cache_limit(&self, device: Device, limit: Option<usize>) {
        self.pool(device).lock().set_limit(limit);
    }

    /// Restarts the peaks of every pool's counters.
    pub(crate) fn reset_memory_peaks(&self) {
        for pool in self.pools.borrow().iter() {
            pool.lock().reset_peaks();
        }
    }
}

/// How a scope shows up in dumps and errors.
#[derive(Clone, Copy)]
pub(crate) enum ScopeName {
    Named(&'static str),
    /// An unnamed scope, shown by where it was opened.
    Site(&'static Location<'static>),
}

impl std::fmt::Display for ScopeName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ScopeName::Named(n) => f.write_str(n),
            ScopeName::Site(l) => write!(f, "scope@{}:{}", l.file(), l.line()),
        }
    }
}

pub(crate) struct ScopeNode {
    tree: NonNull<TreeState>,
    parent: *const ScopeNode,
    /// Position in this thread's opening order; larger closes sooner.
    pub(crate) order: u64,
    pub(crate) name: ScopeName,
    pub(crate) device: Device,
    /// Head of the intrusive list of owned blocks.
    blocks: Cell<*const BlockHeader>,
    first_child: Cell<*const ScopeNode>,
    next_sibling: Cell<*const ScopeNode>,
    prev_sibling: Cell<*const ScopeNode>,
    pub(crate) stats: RefCell<ScopeStats>,
    capped: Cell<bool>,
    budget: Cell<Option<usize>>,
    /// The workspace this scope allocates from: its own cycle's, or the one its nearest workspace
    /// ancestor cycles in (a scope opened inside a cycle is part of the cycle).
    arena: Cell<Option<NonNull<Workspace>>>,
    /// Whether this scope is the cycle of `arena` (and ends it when it closes).
    cycles: Cell<bool>,
    /// The 16-bit dtype differentiable matrix products compute in here (inherited by child scopes).
    autocast: Cell<Option<DType>>,
    /// Whether `f32` products here may read their operands as TF32 (inherited by child scopes).
    tf32: Cell<bool>,
    /// Lines that values living in this scope add to its dump (see [`Note`]).
    notes: RefCell<Vec<std::sync::Weak<dyn Note>>>,
    /// Whether an allocation here while a child scope is open is refused ([`Error::OuterAllocation`]).
    strict: Cell<bool>,
    /// The first allocation made here while a child scope was open: the child and the site.
    first_outer: Cell<Option<OuterAllocation>>,
}

/// An allocation in a scope while one of its child scopes was open: usually a step's intermediate
/// charged to a longer-lived scope (the step's inputs were created there).
#[derive(Clone, Copy)]
pub(crate) struct OuterAllocation {
    /// The open child.
    pub(crate) child: ScopeName,
    pub(crate) at: &'static Location<'static>,
    pub(crate) dtype: DType,
    pub(crate) shape: ShapeSummary,
}

// SAFETY: a node is reachable only through its `Scope` (which is neither `Send` nor `Sync`, by its
// `StaysOnItsThread` marker) and through raw pointers followed on the scope's own thread, so no node is
// ever touched by two threads. These impls only keep the compiler from reporting each field of the
// node when a program tries to share a scope; the marker carries the real rule.
unsafe impl Send for ScopeNode {}
// SAFETY: as above.
unsafe impl Sync for ScopeNode {}

/// The error of an allocation of `requested` bytes that would take `scope`'s subtree, holding `live`
/// bytes, over its `budget`; the dump shows the tree `from`, whose pools hold `cached` idle bytes.
#[cold]
pub(crate) fn over_budget(
    scope: impl ToString,
    device: Device,
    requested: usize,
    live: usize,
    budget: usize,
    from: &ScopeNode,
) -> Error {
    Error::OutOfMemory {
        scope: scope.to_string(),
        device: device.to_string(),
        requested,
        live,
        budget: Some(budget),
        cached: from.tree().cached_bytes(),
        released: 0,
        dump: crate::scope::dump::dump_tree(from.root()),
    }
}

/// The error of an allocation of `requested` bytes of `device` memory that the device's allocator
/// refused, also after `released` idle bytes went back to it; `tree` is the tree the request came
/// from (none for the system scope, whose `live` bytes are then the system scope's).
#[cold]
pub(crate) fn refused(
    scope: impl ToString,
    device: Device,
    requested: usize,
    released: usize,
    tree: Option<&ScopeNode>,
    live: usize,
) -> Error {
    let stats = tree.map(|node| node.tree().memory_stats(device));
    Error::OutOfMemory {
        scope: scope.to_string(),
        device: device.to_string(),
        requested,
        live: stats.map_or(live, |s| s.live_bytes),
        budget: None,
        cached: stats.map_or(0, |s| s.cached_bytes),
        released,
        dump: tree.map_or_else(String::new, |node| {
            crate::scope::dump::dump_tree(node.root())
        }),
    }
}

/// A value that lives in a scope without being a tensor of it (a KV cache's blocks belong to the
/// pool) and says what it holds in the scope's dump.
pub(crate) trait Note: Send + Sync {
    /// One line, without indentation.
    fn line(&self) -> String;
}

impl BlockOwner for ScopeNode {
    fn release(&self, h: &BlockHeader) {
        self.release_block(h);
    }
}

impl ScopeNode {
    pub(crate) fn new(
        tree: &TreeState,
        parent: Option<&ScopeNode>,
        name: ScopeName,
        device: Device,
    ) -> ScopeNode {
        let order = OPENED.with(|o| {
            o.set(o.get() + 1);
            o.get()
        });
        ScopeNode {
            tree: NonNull::from(tree),
            parent: parent.map_or(ptr::null(), |p| p as *const ScopeNode),
            order,
            name,
            device,
            blocks: Cell::new(ptr::null()),
            first_child: Cell::new(ptr::null()),
            next_sibling: Cell::new(ptr::null()),
            prev_sibling: Cell::new(ptr::null()),
            stats: RefCell::new(ScopeStats::default()),
            capped: Cell::new(false),
            budget: Cell::new(None),
            arena: Cell::new(None),
            cycles: Cell::new(false),
            autocast: Cell::new(parent.and_then(|p| p.autocast.get())),
            tf32: Cell::new(parent.is_some_and(|p| p.tf32.get())),
            notes: RefCell::new(Vec::new()),
            strict: Cell::new(false),
            first_outer: Cell::new(None),
        }
    }

    /// Links the node into its parent's children (or registers it as the tree's root). Called once the
    /// node sits at its final address.
    pub(crate) fn link(&self, arena: Option<&mut Workspace>) {
        if let Some(ws) = arena {
            ws.begin_cycle(self.device);
            self.arena.set(Some(NonNull::from(ws)));
            self.cycles.set(true);
        } else if let Some(p) = self.parent() {
            // Inside a cycle: allocations and frees here are events of the cycle, planned with it.
            self.arena.set(p.arena.get());
        }
        match self.parent() {
            None => self.tree().root.set(self),
            Some(p) => {
                let head = p.first_child.get();
                self.next_sibling.set(head);
                if !head.is_null() {
                    // SAFETY: children in the list are open (they unlink when they close).
                    unsafe { (*head).prev_sibling.set(self) };
                }
                p.first_child.set(self);
            }
        }
    }

    /// Adds `note` to the scope's dump for as long as it lives.
    pub(crate) fn add_note(&self, note: std::sync::Weak<dyn Note>) {
        let mut notes = self.notes.borrow_mut();
        notes.retain(|n| n.strong_count() > 0);
        notes.push(note);
    }

    /// The lines of the notes still alive.
    pub(crate) fn notes(&self) -> Vec<String> {
        self.notes
            .borrow()
            .iter()
            .filter_map(|n| n.upgrade().map(|n| n.line()))
            .collect()
    }

    pub(crate) fn tree(&self) -> &TreeState {
        // SAFETY: the tree state lives in the root's frame, which outlives every node of the tree.
        unsafe { self.tree.as_ref() }
    }

    pub(crate) fn parent(&self) -> Option<&ScopeNode> {
        // SAFETY: a parent outlives its children (strict nesting in time).
        unsafe { self.parent.as_ref() }
    }

    pub(crate) fn children(&self) -> impl Iterator<Item = &ScopeNode> {
        let mut cur = self.first_child.get();
        std::iter::from_fn(move || {
            // SAFETY: linked children are open nodes.
            let node = unsafe { cur.as_ref()? };
            cur = node.next_sibling.get();
            Some(node)
        })
    }

    pub(crate) fn blocks(&self) -> impl Iterator<Item = &BlockHeader> {
        let mut cur = self.blocks.get();
        std::iter::from_fn(move || {
            // SAFETY: headers in an owner's list are live (their block is owned by this open scope).
            let h = unsafe { cur.as_ref()? };
            cur = h.next.get();
            Some(h)
        })
    }

    pub(crate) fn ancestors_and_self(&self) -> impl Iterator<Item = &ScopeNode> {
        let mut cur: *const ScopeNode = self;
        std::iter::from_fn(move || {
            // SAFETY: every node on the parent chain is open.
            let node = unsafe { cur.as_ref()? };
            cur = node.parent;
            Some(node)
        })
    }

    pub(crate) fn root(&self) -> &ScopeNode {
        self.ancestors_and_self()
            .last()
            .expect("a node is its own ancestor")
    }

    fn is_ancestor_or_self_of(&self, other: &ScopeNode) -> bool {
        other.ancestors_and_self().any(|n| ptr::eq(n, self))
    }

    /// Runs `f` on the workspace this scope allocates from: its own cycle's or its workspace
    /// ancestor's (`None` outside any cycle).
    pub(crate) fn with_arena<R>(&self, f: impl FnOnce(&mut Workspace) -> R) -> Option<R> {
        // SAFETY: the workspace is mutably borrowed by the cycle's `workspace` call for as long as the
        // cycle's node is open, and this node is the cycle's or one opened inside it (closed before
        // it). The workspace is reached only through `with_arena`, one call at a time on the scopes'
        // thread, and `f` is never given a way back to a node, so the `&mut` cannot overlap another.
        self.arena.get().map(|mut w| f(unsafe { w.as_mut() }))
    }

    /// Whether both scopes are (inside) the same workspace cycle: its arena outlives them both.
    pub(crate) fn in_cycle_with(&self, other: &ScopeNode) -> bool {
        self.arena.get().is_some() && self.arena.get() == other.arena.get()
    }

    /// Runs `f` on the workspace of a workspace scope, the one whose cycle this scope is (`None`
    /// for other scopes, also those opened inside a cycle).
    pub(crate) fn with_own_arena<R>(&self, f: impl FnOnce(&mut Workspace) -> R) -> Option<R> {
        if self.cycles.get() {
            self.with_arena(f)
        } else {
            None
        }
    }

    pub(crate) fn is_capped(&self) -> bool {
        self.capped.get()
    }

    pub(crate) fn set_capped(&self, capped: bool) {
        self.capped.set(capped);
    }

    pub(crate) fn budget(&self) -> Option<usize> {
        self.budget.get()
    }

    pub(crate) fn set_budget(&self, budget: Option<usize>) {
        self.budget.set(budget);
    }

    pub(crate) fn is_strict(&self) -> bool {
        self.strict.get()
    }

    pub(crate) fn set_strict(&self, strict: bool) {
        self.strict.set(strict);
    }

    /// The first allocation made here while a child scope was open, if any.
    pub(crate) fn first_outer_allocation(&self) -> Option<OuterAllocation> {
        self.first_outer.get()
    }

    /// Counts (or, in a strict scope, refuses) an allocation of `shape` `dtype` made at `at` while a
    /// child scope is open.
    fn check_outer(
        &self,
        dtype: DType,
        shape: &[usize],
        at: &'static Location<'static>,
    ) -> Result<()> {
        // SAFETY: linked children are open nodes.
        let Some(child) = (unsafe { self.first_child.get().as_ref() }) else {
            return Ok(());
        };
        if self.strict.get() {
            return Err(Error::OuterAllocation {
                scope: self.name.to_string(),
                child: child.name.to_string(),
                dtype,
                shape: shape.to_vec(),
                at: format!("{}:{}:{}", at.file(), at.line(), at.column()),
            });
        }
        self.stats.borrow_mut().outer_allocations += 1;
        if self.first_outer.get().is_none() {
            self.first_outer.set(Some(OuterAllocation {
                child: child.name,
                at,
                dtype,
                shape: ShapeSummary::of(shape),
            }));
        }
        Ok(())
    }

    pub(crate) fn autocast(&self) -> Option<DType> {
        self.autocast.get()
    }

    pub(crate) fn set_autocast(&self, dtype: Option<DType>) {
        self.autocast.set(dtype);
    }

    pub(crate) fn tf32(&self) -> bool {
        self.tf32.get()
    }

    pub(crate) fn set_tf32(&self, allowed: bool) {
        self.tf32.set(allowed);
    }

    /// Checks the cap and every budget on the way to the root before `bytes` come into this scope.
    /// `counted_in` is the scope that holds the bytes now (for moves): budgets that already count it
    /// are not charged twice.
    fn admit(&self, device: Device, bytes: usize, counted_in: Option<&ScopeNode>) -> Result<()> {
        if self.capped.get() {
            return Err(Error::Capped {
                scope: self.name.to_string(),
                requested: bytes,
            });
        }
        for node in self.ancestors_and_self() {
            let Some(budget) = node.budget.get() else {
                continue;
            };
            if counted_in.is_some_and(|c| node.is_ancestor_or_self_of(c)) {
                continue;
            }
            let live = node.stats.borrow().subtree_bytes;
            if live.saturating_add(bytes) > budget {
                self.stats.borrow_mut().ooms += 1;
                return Err(over_budget(node.name, device, bytes, live, budget, self));
            }
        }
        Ok(())
    }

    /// Allocates a block of `device` memory for `shape` elements of `dtype` owned by this scope.
    /// `moving` says the block is the copy of a tensor moved here (`ret` from a workspace), which is
    /// not counted as an allocation made while a child is open.
    pub(crate) fn alloc(
        &self,
        device: Device,
        dtype: DType,
        shape: &[usize],
        at: &'static Location<'static>,
        moving: bool,
    ) -> Result<BlockRef> {
        let bytes = checked_numel(shape, dtype.size())? * dtype.size();
        if !moving {
            self.check_outer(dtype, shape, at)?;
        }
        self.tree().faults.on_alloc(self, bytes)?;
        self.admit(device, bytes, None)?;
        let grant = if bytes == 0 {
            None
        } else {
            self.with_arena(|a| a.alloc(device, bytes))
        };
        let region = match grant {
            _ if bytes == 0 => Region::empty(device),
            Some(Grant {
                ptr: Some(ptr),
                slot,
                ..
            }) => Region {
                ptr,
                bytes,
                capacity: bytes.next_multiple_of(ALIGN),
                home: Home::Arena,
                device,
                slot,
            },
            _ => {
                if raw::capturing(device) {
                    // A pool block would be handed to other tensors after this step while the graph
                    // keeps writing it on every replay.
                    return Err(Error::InsideCapture {
                        op: "alloc",
                        device: device.to_string(),
                        what: "allocating GPU memory outside the step's planned workspace",
                    });
                }
                let (slot, spilled) = grant.map_or((NO_SLOT, false), |g| (g.slot, g.spilled));
                if spilled {
                    self.stats.borrow_mut().spills += 1;
                }
                let (ptr, capacity, source) = match self.tree().take(device, bytes) {
                    Ok(taken) => taken,
                    Err(Refused { released }) => {
                        self.stats.borrow_mut().ooms += 1;
                        return Err(refused(self.name, device, bytes, released, Some(self), 0));
                    }
                };
                let mut stats = self.stats.borrow_mut();
                match (source, device) {
                    (Source::Reused, _) => stats.reuses += 1,
                    (Source::System, Device::Cpu) => stats.system_allocations += 1,
                    (Source::System, Device::Cuda(_)) => stats.device_allocations += 1,
                }
                Region {
                    slot,
                    ..Region::heap(ptr, bytes, capacity, device)
                }
            }
        };
        let (header, grew) = self.tree().slab.borrow_mut().take();
        // SAFETY: the slab hands out headers that no handle refers to; we initialise it with one
        // reference and adopt that reference below.
        let header_ref = unsafe { header.as_ref() };
        header_ref.init(region, dtype, ShapeSummary::of(shape), at);
        self.stats.borrow_mut().allocations += 1;
        if grew {
            self.stats.borrow_mut().system_allocations += 1;
        }
        self.attach(header_ref, EventKind::Alloc);
        // SAFETY: initialised above with `refs == 1`; slab headers live as long as the tree.
        Ok(unsafe { BlockRef::adopt(header) })
    }

    /// Links a block into this scope's list and counts it.
    fn attach(&self, h: &BlockHeader, event: EventKind) {
        self.tree().timeline.record(self.name, event, h);
        h.owner
            .set(Some(NonNull::from(self as &(dyn BlockOwner + 'static))));
        h.prev.set(ptr::null());
        h.next.set(self.blocks.get());
        // SAFETY: the list head, if any, is a live header of this scope.
        if let Some(head) = unsafe { self.blocks.get().as_ref() } {
            head.prev.set(h);
        }
        self.blocks.set(h);
        let bytes = h.bytes.get();
        {
            let mut s = self.stats.borrow_mut();
            s.live_tensors += 1;
            s.live_bytes += bytes;
        }
        for node in self.ancestors_and_self() {
            let mut s = node.stats.borrow_mut();
            s.subtree_bytes += bytes;
            s.peak_bytes = s.peak_bytes.max(s.subtree_bytes);
        }
    }

    /// Unlinks a block from this scope's list and uncounts it.
    fn detach(&self, h: &BlockHeader, event: EventKind) {
        self.detach_within(h, event, None);
    }

    /// `detach`, for a block that moves to `to` (`None`: freed, or handed to the system). A block
    /// of a planned workspace cycle leaves the cycle unless `to` is in the same cycle: then it keeps
    /// its slot, and its free is the cycle's event wherever it happens.
    fn detach_within(&self, h: &BlockHeader, event: EventKind, to: Option<&ScopeNode>) {
        self.tree().timeline.record(self.name, event, h);
        if !to.is_some_and(|to| self.in_cycle_with(to)) {
            let slot = h.slot.replace(NO_SLOT);
            if slot != NO_SLOT {
                self.with_arena(|a| a.leave(slot));
            }
        }
        let (prev, next) = (h.prev.get(), h.next.get());
        // SAFETY: neighbours in the list are live headers of this scope.
        unsafe {
            match prev.as_ref() {
                Some(p) => p.next.set(next),
                None => self.blocks.set(next),
            }
            if let Some(n) = next.as_ref() {
                n.prev.set(prev);
            }
        }
        h.prev.set(ptr::null());
        h.next.set(ptr::null());
        let bytes = h.bytes.get();
        {
            let mut s = self.stats.borrow_mut();
            s.live_tensors -= 1;
            s.live_bytes -= bytes;
        }
        for node in self.ancestors_and_self() {
            node.stats.borrow_mut().subtree_bytes -= bytes;
        }
    }

    /// Returns a block whose last handle dropped.
    /// The scope that owns a live handle's block; `None` for the system scope.
    #[inline]
    pub(crate) fn owning(h: &BlockHeader) -> Option<&ScopeNode> {
        // SAFETY: every owner set on a header is a `ScopeNode` (`attach` is the only writer besides
        // `init`, which clears it), so dropping the vtable recovers its address; a live handle's owner
        // is open (a scope closes only when its closure returns, and no handle outlives that), so the
        // node is valid for as long as the header is borrowed.
        h.owner
            .get()
            .map(|o| unsafe { o.cast::<ScopeNode>().as_ref() })
    }

    fn release_block(&self, h: &BlockHeader) {
        self.detach(h, EventKind::Free);
        self.free_bytes(h);
        self.tree().slab.borrow().give(h);
    }

    fn free_bytes(&self, h: &BlockHeader) {
        match h.home.get() {
            Home::Empty => {}
            // A block freed while its GPU is captured may be written by every replay of the graph:
            // it is never reused (leaked until the process ends; a captured step that frees tensors
            // from outside its workspace is rare).
            Home::Heap if raw::capturing(h.device.get()) => {}
            // SAFETY: heap blocks came from the tree's pool of their device with a class capacity,
            // and the block has no user left: its last handle dropped, or its scope is closing (for a
            // GPU, later users of the bytes are ordered after earlier ones by the device's stream).
            Home::Heap => unsafe {
                self.tree()
                    .give(h.device.get(), h.ptr.get(), h.bytes.get(), h.capacity.get())
            },
            Home::Arena => {
                self.with_arena(|a| a.pop(h.ptr.get(), h.bytes.get()));
            }
        }
    }

    /// Moves ownership of a pool or empty block to `self` without copying.
    pub(crate) fn adopt_block(&self, h: &BlockHeader) -> Result<()> {
        let from = ScopeNode::owning(h).expect("a tree block has an owner");
        if ptr::eq(from, self) {
            return Ok(());
        }
        debug_assert!(
            h.home.get() != Home::Arena || from.in_cycle_with(self),
            "arena blocks are copied out of their cycle, never adopted there"
        );
        self.admit(h.device.get(), h.bytes.get(), Some(from))?;
        from.detach_within(h, EventKind::MoveOut, Some(self));
        self.attach(h, EventKind::MoveIn);
        self.stats.borrow_mut().moved_in += 1;
        Ok(())
    }

    /// Hands a unique heap block's bytes over to the system scope: the pool gives the block up, and
    /// the node unlinks it and recycles its header without freeing the bytes. Returns
    /// `(ptr, capacity)`, or `None`, changing nothing, when the block shares its pool segment with
    /// other blocks (the caller copies it instead).
    pub(crate) fn surrender(&self, h: &BlockHeader) -> Option<(NonNull<u8>, usize)> {
        debug_assert!(h.home.get() == Home::Heap && h.is_unique());
        let (ptr, bytes, capacity) = (h.ptr.get(), h.bytes.get(), h.capacity.get());
        let handed = self
            .tree()
            .with_pool(h.device.get(), |pool| pool.hand_over(ptr, bytes, capacity));
        if handed != Some(true) {
            return None;
        }
        self.detach(h, EventKind::Detach);
        self.tree().slab.borrow().give(h);
        Some((ptr, capacity))
    }

    /// Closes the node: reclaims what forgotten handles still hold, finishes a workspace cycle, folds
    /// the counters into the parent and unlinks from it.
    pub(crate) fn close(&self) {
        while let Some(h) = self.blocks().next() {
            let bytes = h.bytes.get() as u64;
            self.detach(h, EventKind::Reclaim);
            self.free_bytes(h);
            self.tree().slab.borrow().give(h);
            let mut s = self.stats.borrow_mut();
            s.reclaimed_tensors += 1;
            s.reclaimed_bytes += bytes;
        }
        let make_room = |device| {
            self.tree().with_pool(device, |pool| pool.empty());
        };
        // The device of an arena that had to grow, if any. (Not an `Option<(bool, Device)>`: with
        // the enum's niche in `Device`, the `None` case leaves the `bool` uninitialised, and at
        // opt-level 1 the test of `true` can read it first — valgrind then reports a jump on an
        // uninitialised value, though the result is right.)
        let grown: Option<Device> = self
            .with_own_arena(|ws| ws.end_cycle(make_room).then(|| ws.device()))
            .flatten();
        if let Some(device) = grown {
            let mut stats = self.stats.borrow_mut();
            match device {
                Device::Cpu => stats.system_allocations += 1,
                Device::Cuda(_) => stats.device_allocations += 1,
            }
        }
        self.arena.set(None);
        if let Some(p) = self.parent() {
            p.stats.borrow_mut().absorb(&self.stats.borrow());
            let (prev, next) = (self.prev_sibling.get(), self.next_sibling.get());
            // SAFETY: siblings in the list are open nodes.
            unsafe {
                match prev.as_ref() {
                    Some(s) => s.next_sibling.set(next),
                    None => p.first_child.set(next),
                }
                if let Some(n) = next.as_ref() {
                    n.prev_sibling.set(prev);
                }
            }
        }
    }
}

/// Closes a node when dropped, including while unwinding from a panic inside the scope.
pub(crate) struct CloseOnDrop<'a>(pub(crate) &'a ScopeNode);

impl Drop for CloseOnDrop<'_> {
    fn drop(&mut self) {
        self.0.close();
    }
}
