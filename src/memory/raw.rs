//! Raw memory of a device: the one place that decides which allocator serves a memory space. Host
//! memory comes from the system allocator, zeroed; GPU memory from the CUDA backend's stream-ordered
//! allocator.

use std::alloc::{self, Layout as AllocLayout};
use std::ptr::NonNull;

use crate::backend::cuda;
use crate::device::Device;
use crate::memory::lazy_free;

/// Whether `device` is being captured into a CUDA graph: memory taken from or given back to a pool
/// now would be baked into the graph's replays, so the scopes refuse the first and keep the second.
pub(crate) fn capturing(device: Device) -> bool {
    crate::backend::capturing(device)
}

/// Every block is aligned for the widest SIMD loads (and a cache line).
pub(crate) const ALIGN: usize = 64;

/// An allocator of raw memory for a [`Pool`](crate::memory::pool::Pool): the device's own
/// ([`DeviceMemory`]) or, in tests, a fake with a fixed capacity that can refuse on demand.
pub(crate) trait RawMemory {
    /// `bytes` (> 0) bytes; `None` when the allocator refuses.
    fn alloc(&mut self, bytes: usize) -> Option<NonNull<u8>>;

    /// Returns memory taken with [`alloc`](Self::alloc).
    ///
    /// # Safety
    /// `ptr` came from `self.alloc(bytes)` with this `bytes`, and nothing uses it afterwards (for a
    /// GPU: no work queued later on the device's stream reads it).
    unsafe fn free(&mut self, ptr: NonNull<u8>, bytes: usize);

    /// Says that `bytes` at `ptr` (inside memory from [`alloc`](Self::alloc)) were lent to one block
    /// (`lent`), or came back. Only a memory checker listens (the CUDA simulator, which then bounds
    /// each tensor's accesses by its own block and treats a lent block as never written); for every
    /// real allocator it does nothing.
    fn note_block(&mut self, _ptr: NonNull<u8>, _bytes: usize, _lent: bool) {}
}

/// A device's own allocator ([`alloc`] and [`free`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DeviceMemory(pub(crate) Device);

impl RawMemory for DeviceMemory {
    fn alloc(&mut self, bytes: usize) -> Option<NonNull<u8>> {
        alloc(self.0, bytes)
    }

    unsafe fn free(&mut self, ptr: NonNull<u8>, bytes: usize) {
        // SAFETY: forwarded from the caller.
        unsafe { free(self.0, ptr, bytes) }
    }

    fn note_block(&mut self, ptr: NonNull<u8>, bytes: usize, lent: bool) {
        if let Device::Cuda(ordinal) = self.0 {
            cuda::note_block(ordinal, ptr, bytes, lent);
        }
    }
}

/// Takes `bytes` (> 0) bytes of `device` memory; `None` when the allocator refuses. For a GPU the
/// pointer is a device address, never dereferenced on the host.
pub(crate) fn alloc(device: Device, bytes: usize) -> Option<NonNull<u8>> {
    match device {
        Device::Cpu => system_alloc(bytes),
        Device::Cuda(ordinal) => cuda::alloc(ordinal, bytes),
    }
}

/// Returns memory taken with [`alloc`].
///
/// # Safety
/// `ptr` came from `alloc(device, bytes)` with these arguments, and nothing uses it afterwards
/// (for a GPU: no work queued later on the device's stream reads it).
pub(crate) unsafe fn free(device: Device, ptr: NonNull<u8>, bytes: usize) {
    match device {
        // SAFETY: forwarded from the caller: `ptr` came from `system_alloc(bytes)`.
        Device::Cpu => unsafe { system_free(ptr, bytes) },
        // SAFETY: forwarded from the caller: `ptr` came from the device allocator with `bytes`.
        Device::Cuda(ordinal) => unsafe { cuda::free(ordinal, ptr, bytes) },
    }
}

/// Host allocations of at least this many bytes are mapped from the kernel directly: they come as
/// zero pages mapped on first touch, so a large block costs nothing until it is written, and it goes
/// back to the kernel whole when freed: lazily, kept for a later request while the kernel does not
/// need its pages ([`lazy_free`]).
const MAP_MIN: usize = 1 << 20;

/// Takes `capacity` initialised bytes from the system: zeroed when they are new, or a lazily freed
/// mapping's last contents (zeros where the kernel took its pages). Every byte of every block is
/// initialised, so kernels may view any block as a slice of plain numbers.
fn system_alloc(capacity: usize) -> Option<NonNull<u8>> {
    if capacity >= MAP_MIN {
        return lazy_free::reuse(capacity)
            .or_else(|| map(capacity))
            .or_else(|| (lazy_free::release() > 0).then(|| map(capacity)).flatten());
    }
    let layout = AllocLayout::from_size_align(capacity, ALIGN).ok()?;
    // SAFETY: `capacity > 0` for every caller (empty tensors never allocate), so the layout is valid
    // for `alloc_zeroed`.
    NonNull::new(unsafe { alloc::alloc_zeroed(layout) })
}

/// Returns a block taken with [`system_alloc`].
///
/// # Safety
/// `ptr` came from `system_alloc(capacity)` with this `capacity`, and is not used afterwards.
unsafe fn system_free(ptr: NonNull<u8>, capacity: usize) {
    if capacity >= MAP_MIN {
        // SAFETY: forwarded from the caller: `ptr` came from `map(capacity)` (or a kept mapping cut to
        // `capacity`) and is not used afterwards; kept, or else unmapped.
        if !unsafe { lazy_free::keep(ptr, capacity) } {
            // SAFETY: as above, and not kept.
            unsafe { unmap(ptr, capacity) };
        }
        return;
    }
    // SAFETY: the caller guarantees `ptr` was allocated with exactly this layout.
    unsafe {
        alloc::dealloc(
            ptr.as_ptr(),
            AllocLayout::from_size_align_unchecked(capacity, ALIGN),
        )
    }
}

/// `bytes` of fresh zero pages (page-aligned, so aligned to [`ALIGN`]); `None` when the kernel
/// refuses (an address-space limit, or no memory to commit).
#[cfg(unix)]
pub(super) fn map(bytes: usize) -> Option<NonNull<u8>> {
    // SAFETY: an anonymous private mapping at an address of the kernel's choosing touches no existing
    // memory; the result is checked before use.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            bytes,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return None;
    }
    NonNull::new(ptr.cast())
}

/// Unmaps pages mapped by [`map`].
///
/// # Safety
/// `ptr` came from `map(bytes)` with this `bytes`, and is not used afterwards.
#[cfg(unix)]
unsafe fn unmap(ptr: NonNull<u8>, bytes: usize) {
    // SAFETY: forwarded from the caller: the range is exactly one mapping of ours, unused from now.
    // It cannot fail for a range that `mmap` returned.
    unsafe { libc::munmap(ptr.as_ptr().cast(), bytes) };
}

/// Zeroed memory from the global allocator, where the platform has no `mmap`.
#[cfg(not(unix))]
fn map(bytes: usize) -> Option<NonNull<u8>> {
    let layout = AllocLayout::from_size_align(bytes, ALIGN).ok()?;
    // SAFETY: `bytes >= MAP_MIN > 0`, so the layout is valid for `alloc_zeroed`.
    NonNull::new(unsafe { alloc::alloc_zeroed(layout) })
}

/// Returns memory taken with [`map`].
///
/// # Safety
/// `ptr` came from `map(bytes)` with this `bytes`, and is not used afterwards.
#[cfg(not(unix))]
unsafe fn unmap(ptr: NonNull<u8>, bytes: usize) {
    // SAFETY: the caller guarantees `ptr` was allocated with exactly this layout.
    unsafe {
        alloc::dealloc(
            ptr.as_ptr(),
            AllocLayout::from_size_align_unchecked(bytes, ALIGN),
        )
    }
}
