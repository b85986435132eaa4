//! GPU memory from the driver: the raw allocator behind the tree pools and workspace arenas of GPU
//! scopes. Allocations and frees are ordered on the GPU's stream (`cuMemAllocAsync`/`cuMemFreeAsync`
//! where the driver has them), so freeing never waits for the GPU.

use std::ptr::{self, NonNull};
use std::sync::atomic::Ordering::Relaxed;

use cudarc::driver::result;

use crate::backend::cuda::gpu;

/// `bytes` (> 0) of memory on GPU `ordinal`, as a device address in a pointer (never dereferenced
/// on the host); `None` when the driver refuses.
pub(crate) fn alloc(ordinal: usize, bytes: usize) -> Option<NonNull<u8>> {
    let gpu = gpu(ordinal).ok()?;
    gpu.bind().ok()?;
    let address = if gpu.async_alloc {
        // SAFETY: the stream belongs to this GPU's context, which is current; the memory is used only
        // by work on this stream (every op of the GPU runs there).
        unsafe { result::malloc_async(gpu.stream.cu_stream(), bytes) }
    } else {
        // SAFETY: the context is current; the returned memory is uninitialised, which is fine for
        // device memory that only kernels and copies touch, always writing before reading.
        unsafe { result::malloc_sync(bytes) }
    }
    .ok()?;
    let c = &gpu.counters;
    c.allocator_calls.fetch_add(1, Relaxed);
    let reserved = c.reserved_bytes.fetch_add(bytes, Relaxed) + bytes;
    c.peak_reserved_bytes.fetch_max(reserved, Relaxed);
    NonNull::new(ptr::without_provenance_mut(address as usize))
}

/// Returns memory taken with [`alloc`].
///
/// # Safety
/// `ptr` came from `alloc(ordinal, bytes)` and no work queued on the GPU's stream after this call
/// uses it.
pub(crate) unsafe fn free(ordinal: usize, ptr: NonNull<u8>, bytes: usize) {
    let Ok(gpu) = gpu(ordinal) else {
        return; // the GPU opened when the memory was allocated, so this does not happen
    };
    if gpu.bind().is_err() {
        return;
    }
    let address = ptr.as_ptr() as usize as u64;
    // A failing free leaves the memory to the driver, which reclaims it with the context at exit;
    // there is no caller to report it to (frees run in drops).
    let _ = if gpu.async_alloc {
        // SAFETY: the caller guarantees the address came from `malloc_async` on this stream and has no
        // later user; the free is ordered after every earlier use on the stream.
        unsafe { result::free_async(address, gpu.stream.cu_stream()) }
    } else {
        // SAFETY: the address came from `malloc_sync`; `cuMemFree` waits for work that uses it.
        unsafe { result::free_sync(address) }
    };
    let c = &gpu.counters;
    c.free_calls.fetch_add(1, Relaxed);
    c.reserved_bytes.fetch_sub(bytes, Relaxed);
}
