//! Raw memory of a device: the one place that decides which allocator serves a memory space. Host
//! memory comes from the system allocator, zeroed; GPU memory from the CUDA backend's stream-ordered
//! allocator.

use std::alloc::{self, Layout as AllocLayout};
use std::ptr::NonNull;

use crate::backend::cuda;
use crate::device::Device;

/// Every block is aligned for the widest SIMD loads (and a cache line).
pub(crate) const ALIGN: usize = 64;

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

/// Takes `capacity` zeroed bytes from the system. Zeroing happens once per block, when it first comes
/// from the system: every byte of every block is initialised from then on, so kernels may view any
/// block as a slice of plain numbers.
fn system_alloc(capacity: usize) -> Option<NonNull<u8>> {
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
    // SAFETY: the caller guarantees `ptr` was allocated with exactly this layout.
    unsafe {
        alloc::dealloc(
            ptr.as_ptr(),
            AllocLayout::from_size_align_unchecked(capacity, ALIGN),
        )
    }
}
