//! Storage blocks: a header per block, a counted handle to it, and the slab headers come from.
//!
//! A block is owned either by a scope of a tree (its header lives in the tree's [`HeaderSlab`] and is
//! linked into the owning scope's list) or by the never-closing system scope (its header is boxed and
//! its owner pointer is null). Tensors reach storage only through their own [`BlockRef`], never through
//! "the scope their brand names": a `Tensor<'parent>` may pose as a `Tensor<'child>`.
//!
//! Thread confinement: headers of tree-owned blocks are only reachable from handles of non-`'static`
//! tensors, which are neither `Send` nor `Sync`, so their `Cell`s are touched by one thread. Headers
//! of system-owned blocks may be shared between threads; their cells are written only while a single
//! handle exists (at creation, or through a unique handle), and the count is atomic.

use std::cell::Cell;
use std::fmt;
use std::panic::Location;
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering, fence};

use crate::backend::{Buf, BufMut};
use crate::device::Device;
use crate::dtype::DType;
use crate::memory::raw;

/// Where a block's bytes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Home {
    /// A zero-byte block: no memory behind the (dangling, aligned) pointer.
    Empty,
    /// A pool-class allocation of `capacity` bytes from the device's allocator (the system allocator
    /// for host memory).
    Heap,
    /// A region of a workspace arena (reset when the workspace scope closes).
    Arena,
}

/// Dimensions a [`ShapeSummary`] keeps; the rest are only counted.
const SUMMARY_DIMS: usize = 6;

/// The shape a block was created with, kept for dumps as a plain `Copy` value (writing it costs a
/// few stores, not a `SmallVec` copy). Dimensions past the sixth are summarised.
#[derive(Clone, Copy, Default)]
pub(crate) struct ShapeSummary {
    rank: usize,
    dims: [usize; SUMMARY_DIMS],
}

impl ShapeSummary {
    pub(crate) fn of(shape: &[usize]) -> ShapeSummary {
        let mut dims = [0; SUMMARY_DIMS];
        let kept = shape.len().min(SUMMARY_DIMS);
        dims[..kept].copy_from_slice(&shape[..kept]);
        ShapeSummary {
            rank: shape.len(),
            dims,
        }
    }
}

impl fmt::Debug for ShapeSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut list = f.debug_list();
        list.entries(&self.dims[..self.rank.min(SUMMARY_DIMS)]);
        if self.rank > SUMMARY_DIMS {
            list.entry(&format_args!("... {} more", self.rank - SUMMARY_DIMS));
        }
        list.finish()
    }
}

/// Where a block's bytes are: the memory behind a header.
#[derive(Clone, Copy)]
pub(crate) struct Region {
    pub(crate) ptr: NonNull<u8>,
    /// Bytes the tensor uses (`numel * dtype.size()`).
    pub(crate) bytes: usize,
    /// Bytes of the allocation (a pool class for `Home::Heap`).
    pub(crate) capacity: usize,
    pub(crate) home: Home,
    /// The memory space `ptr` points into (a device address for a GPU).
    pub(crate) device: Device,
    /// The allocation's slot in a planned workspace cycle, or [`NO_SLOT`].
    pub(crate) slot: u32,
}

/// The slot of a block that is not an allocation of a planned workspace cycle.
pub(crate) const NO_SLOT: u32 = u32::MAX;

impl Region {
    /// A pool or system allocation of `capacity` bytes at `ptr` holding `bytes` used bytes.
    pub(crate) fn heap(ptr: NonNull<u8>, bytes: usize, capacity: usize, device: Device) -> Region {
        Region {
            ptr,
            bytes,
            capacity,
            home: Home::Heap,
            device,
            slot: NO_SLOT,
        }
    }

    /// The region of a zero-byte block: an aligned, non-null pointer that is never read through.
    pub(crate) fn empty(device: Device) -> Region {
        let ptr = NonNull::new(ptr::without_provenance_mut(raw::ALIGN)).expect("ALIGN is non-zero");
        Region {
            ptr,
            bytes: 0,
            capacity: 0,
            home: Home::Empty,
            device,
            slot: NO_SLOT,
        }
    }
}

/// The owner of tree blocks (a scope): takes a block back when its last handle drops. Memory calls
/// it without knowing the type behind it, so memory does not depend on the scope layer above it.
pub(crate) trait BlockOwner {
    /// Takes back `header`'s block, whose last handle just dropped.
    fn release(&self, header: &BlockHeader);
}

/// Header of a storage block.
pub(crate) struct BlockHeader {
    refs: AtomicUsize,
    pub(crate) ptr: Cell<NonNull<u8>>,
    /// Bytes the tensor uses (`numel * dtype.size()`).
    pub(crate) bytes: Cell<usize>,
    /// Bytes of the allocation behind `ptr` (a pool class for `Home::Heap`).
    pub(crate) capacity: Cell<usize>,
    pub(crate) home: Cell<Home>,
    pub(crate) device: Cell<Device>,
    /// The block's slot in its planned workspace cycle ([`NO_SLOT`] for other blocks, and once the
    /// block has left the cycle's scope).
    pub(crate) slot: Cell<u32>,
    /// The owning scope; `None` for the system scope. Memory does not name scopes: the scope layer
    /// implements [`BlockOwner`] and reads its own type back (`ScopeNode::owning`).
    pub(crate) owner: Cell<Option<NonNull<dyn BlockOwner>>>,
    /// Neighbours in the owner's list of blocks (and `next` links the slab's free list).
    pub(crate) prev: Cell<*const BlockHeader>,
    pub(crate) next: Cell<*const BlockHeader>,
    pub(crate) dtype: Cell<DType>,
    pub(crate) shape: Cell<ShapeSummary>,
    pub(crate) name: Cell<Option<&'static str>>,
    pub(crate) created_at: Cell<&'static Location<'static>>,
    /// The least and greatest of the block's `i64` elements, when they came from host data and
    /// nothing has written the block since ([`BlockRef::note_index_range`]): what lets an op check
    /// indices in GPU memory without reading them back, which would wait for the GPU's queue.
    /// Every write goes through [`BlockRef::buf_mut`], which forgets it.
    pub(crate) index_range: Cell<Option<(i64, i64)>>,
}

// SAFETY: see the module docs: cells of a header that more than one thread can reach are written only
// while a single handle to it exists, and the reference count is atomic.
unsafe impl Sync for BlockHeader {}
// SAFETY: as above; a header holds no thread-bound resource.
unsafe impl Send for BlockHeader {}

impl BlockHeader {
    fn blank() -> BlockHeader {
        BlockHeader {
            refs: AtomicUsize::new(0),
            ptr: Cell::new(NonNull::dangling()),
            bytes: Cell::new(0),
            capacity: Cell::new(0),
            home: Cell::new(Home::Empty),
            device: Cell::new(Device::Cpu),
            slot: Cell::new(NO_SLOT),
            owner: Cell::new(None),
            prev: Cell::new(ptr::null()),
            next: Cell::new(ptr::null()),
            dtype: Cell::new(DType::F32),
            shape: Cell::new(ShapeSummary::default()),
            name: Cell::new(None),
            created_at: Cell::new(Location::caller()),
            index_range: Cell::new(None),
        }
    }

    /// Fills a recycled or fresh header for a new block with one reference.
    pub(crate) fn init(
        &self,
        region: Region,
        dtype: DType,
        shape: ShapeSummary,
        created_at: &'static Location<'static>,
    ) {
        self.refs.store(1, Ordering::Relaxed);
        self.ptr.set(region.ptr);
        self.bytes.set(region.bytes);
        self.capacity.set(region.capacity);
        self.home.set(region.home);
        self.device.set(region.device);
        self.slot.set(region.slot);
        self.owner.set(None);
        self.prev.set(ptr::null());
        self.next.set(ptr::null());
        self.dtype.set(dtype);
        self.shape.set(shape);
        self.name.set(None);
        self.created_at.set(created_at);
        self.index_range.set(None);
    }

    pub(crate) fn is_system(&self) -> bool {
        self.owner.get().is_none()
    }

    /// Handles to this block (for dumps).
    pub(crate) fn refs(&self) -> usize {
        self.refs.load(Ordering::Relaxed)
    }

    pub(crate) fn is_unique(&self) -> bool {
        // Acquire pairs with the Release of other handles' drops, as in `Arc::get_mut`.
        self.refs.load(Ordering::Acquire) == 1
    }
}

/// A counted reference to a block header; the last one to drop returns the block to its owner.
pub(crate) struct BlockRef(NonNull<BlockHeader>);

impl BlockRef {
    /// Adopts a header whose count is already 1.
    ///
    /// # Safety
    /// `header` is initialised with `refs == 1` and stays valid while this handle exists.
    pub(crate) unsafe fn adopt(header: NonNull<BlockHeader>) -> BlockRef {
        BlockRef(header)
    }

    #[inline]
    pub(crate) fn header(&self) -> &BlockHeader {
        // SAFETY: a header outlives every handle to it: system headers are freed by the last handle,
        // tree headers are recycled only when their count reaches zero or when their owner closes, and
        // no handle survives its owner's close (the brand lifetime of the tensor ends first).
        unsafe { self.0.as_ref() }
    }

    pub(crate) fn as_ptr(&self) -> *const BlockHeader {
        self.0.as_ptr()
    }

    /// The block's bytes for kernels to read, while this handle is borrowed.
    #[inline]
    pub(crate) fn buf(&self) -> Buf<'_> {
        let h = self.header();
        // SAFETY: the block holds `bytes` initialised bytes (host blocks are zeroed when first taken
        // from the system and written since; device memory is only read by kernels), aligned to 64,
        // valid while this handle lives. Nothing writes them while the borrow lasts: writing needs a
        // unique handle borrowed mutably (`buf_mut`).
        unsafe { Buf::new(h.ptr.get(), h.bytes.get(), h.device.get()) }
    }

    /// The block's bytes for kernels to write; `None` unless this handle is the block's only one.
    #[inline]
    pub(crate) fn buf_mut(&mut self) -> Option<BufMut<'_>> {
        let h = self.header();
        if !h.is_unique() {
            return None;
        }
        // Whatever is written may break the range noted from host data.
        h.index_range.set(None);
        // SAFETY: as in `buf`, and this is the only handle, borrowed mutably, so no other view of the
        // block exists while the borrow lasts.
        Some(unsafe { BufMut::new(h.ptr.get(), h.bytes.get(), h.device.get()) })
    }

    /// Notes that every element of this `i64` block lies in `lo..=hi` (the caller wrote them from
    /// host data it has seen); ignored unless this is the block's only handle, as header cells are
    /// written only then.
    pub(crate) fn note_index_range(&mut self, lo: i64, hi: i64) {
        let h = self.header();
        if h.is_unique() && h.dtype.get() == DType::I64 {
            h.index_range.set(Some((lo, hi)));
        }
    }

    /// The range noted by [`note_index_range`](Self::note_index_range), if no write came since.
    pub(crate) fn index_range(&self) -> Option<(i64, i64)> {
        self.header().index_range.get()
    }
}

impl Clone for BlockRef {
    fn clone(&self) -> BlockRef {
        // Relaxed suffices for an increment from an existing reference (as in `Arc::clone`).
        self.header().refs.fetch_add(1, Ordering::Relaxed);
        BlockRef(self.0)
    }
}

impl Drop for BlockRef {
    fn drop(&mut self) {
        if self.header().refs.fetch_sub(1, Ordering::Release) != 1 {
            return;
        }
        fence(Ordering::Acquire);
        let header = self.header();
        match header.owner.get() {
            // SAFETY: this was the last handle to a boxed system header; nothing else refers to it.
            None => unsafe { free_system_block(self.0) },
            // SAFETY: the owner is open (a handle existed, so its scope has not closed), so the
            // pointer is valid; this was the last handle, so the block may be returned.
            Some(owner) => unsafe { owner.as_ref() }.release(header),
        }
    }
}

/// Counters of the system-owned blocks of every thread (they keep no list: each is freed by its last
/// handle).
pub(crate) struct SystemBlocks {
    live_blocks: AtomicUsize,
    live_bytes: AtomicUsize,
    allocations: AtomicU64,
}

/// The system scope's blocks.
pub(crate) static SYSTEM: SystemBlocks = SystemBlocks {
    live_blocks: AtomicUsize::new(0),
    live_bytes: AtomicUsize::new(0),
    allocations: AtomicU64::new(0),
};

impl SystemBlocks {
    fn on_alloc(&self, bytes: usize) {
        self.live_blocks.fetch_add(1, Ordering::Relaxed);
        self.live_bytes.fetch_add(bytes, Ordering::Relaxed);
        self.allocations.fetch_add(1, Ordering::Relaxed);
    }

    fn on_free(&self, bytes: usize) {
        self.live_blocks.fetch_sub(1, Ordering::Relaxed);
        self.live_bytes.fetch_sub(bytes, Ordering::Relaxed);
    }

    /// Live blocks, live bytes, and blocks allocated so far.
    pub(crate) fn counts(&self) -> (usize, usize, u64) {
        (
            self.live_blocks.load(Ordering::Relaxed),
            self.live_bytes.load(Ordering::Relaxed),
            self.allocations.load(Ordering::Relaxed),
        )
    }
}

/// Creates a system-owned block (a boxed header with one reference).
pub(crate) fn new_system_block(
    region: Region,
    dtype: DType,
    shape: ShapeSummary,
    created_at: &'static Location<'static>,
) -> BlockRef {
    debug_assert!(
        region.home != Home::Arena,
        "system blocks never live in an arena"
    );
    let header = BlockHeader::blank();
    header.init(region, dtype, shape, created_at);
    SYSTEM.on_alloc(region.bytes);
    BlockRef(NonNull::from(Box::leak(Box::new(header))))
}

/// # Safety
/// `header` is a boxed system header with no handle left.
unsafe fn free_system_block(header: NonNull<BlockHeader>) {
    // SAFETY: the caller guarantees the header was boxed by `new_system_block` and is unreferenced.
    let boxed = unsafe { Box::from_raw(header.as_ptr()) };
    SYSTEM.on_free(boxed.bytes.get());
    if boxed.home.get() == Home::Heap {
        // SAFETY: heap blocks of system headers came from `raw::alloc(device, capacity)` (directly,
        // or from a tree's pool that handed them over in `surrender`), and have no user left.
        unsafe { raw::free(boxed.device.get(), boxed.ptr.get(), boxed.capacity.get()) };
    }
}

/// Headers for one tree, allocated in chunks and recycled through a free list, so that a steady-state
/// loop creates tensors without touching the system allocator.
#[derive(Default)]
pub(crate) struct HeaderSlab {
    chunks: Vec<Box<[BlockHeader]>>,
    free: Cell<*const BlockHeader>,
}

const CHUNK: usize = 64;

impl HeaderSlab {
    /// A free header (not yet initialised for its block), and whether a new chunk had to be allocated.
    pub(crate) fn take(&mut self) -> (NonNull<BlockHeader>, bool) {
        let mut grew = false;
        if self.free.get().is_null() {
            let chunk: Box<[BlockHeader]> = (0..CHUNK).map(|_| BlockHeader::blank()).collect();
            for h in chunk.iter() {
                h.next.set(self.free.get());
                self.free.set(h);
            }
            self.chunks.push(chunk);
            grew = true;
        }
        let head = self.free.get();
        // SAFETY: `head` is non-null and points into a chunk this slab owns (chunks never move: they are
        // boxed slices, and only dropped with the slab).
        let next = unsafe { (*head).next.get() };
        self.free.set(next);
        (
            NonNull::new(head.cast_mut()).expect("free list head is non-null"),
            grew,
        )
    }

    /// Puts a header back on the free list.
    pub(crate) fn give(&self, header: &BlockHeader) {
        header.next.set(self.free.get());
        self.free.set(header);
    }

    /// Bytes the slab holds (for the dump).
    pub(crate) fn bytes(&self) -> usize {
        self.chunks.len() * CHUNK * std::mem::size_of::<BlockHeader>()
    }
}
