//! Raw memory of a device: the one place that decides which allocator serves a memory space. Host
//! memory comes from the system allocator (zeroed, see [`pool::system_alloc`]); GPU memory from the
//! CUDA backend's stream-ordered allocator.

use std::ptr::NonNull;

use crate::device::Device;
use crate::memory::pool;

/// Takes `bytes` (> 0) bytes of `device` memory; `None` when the allocator refuses. For a GPU the
/// pointer is a device address, never dereferenced on the host.
pub(crate) fn alloc(device: Device, bytes: usize) -> Option<NonNull<u8>> {
    match device {
        Device::Cpu => pool::system_alloc(bytes),
        #[cfg(feature = "cuda")]
        Device::Cuda(ordinal) => crate::cuda::memory::alloc(ordinal, bytes),
        // Without the CUDA backend no scope can open on a GPU (`Device::check_available`), so no
        // block asks for GPU memory; refusing keeps this total.
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => None,
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
        Device::Cpu => unsafe { pool::system_free(ptr, bytes) },
        // SAFETY: forwarded from the caller: `ptr` came from the device allocator with `bytes`.
        #[cfg(feature = "cuda")]
        Device::Cuda(ordinal) => unsafe { crate::cuda::memory::free(ordinal, ptr, bytes) },
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => {}
    }
}
