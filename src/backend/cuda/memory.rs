//! GPU memory from the driver: the raw allocator behind the tree pools and workspace arenas of GPU
//! scopes. Allocations and frees are ordered on the GPU's stream (`cuMemAllocAsync`/`cuMemFreeAsync`
//! where the driver has them), so freeing never waits for the GPU.

use std::ptr::{self, NonNull};
use std::sync::OnceLock;
use std::sync::atomic::Ordering::Relaxed;

use cudarc::driver::{result, sys};

use crate::backend::cuda::gpu;

/// `bytes` (> 0) of memory on GPU `ordinal`, as a device address in a pointer (never dereferenced
/// on the host); `None` when the driver refuses.
pub(crate) fn alloc(ordinal: usize, bytes: usize) -> Option<NonNull<u8>> {
    let gpu = gpu(ordinal).ok()?;
    gpu.bind().ok()?;
    let address = if gpu.async_alloc {
        // SAFETY: the stream belongs to this GPU's context, which is current; the memory is used only
        // by work on this stream (every op of the GPU runs there).
        let first = unsafe { result::malloc_async(gpu.stream.cu_stream(), bytes) };
        first.or_else(|_| {
            // Memory freed with `cuMemFreeAsync` goes back to the driver's pool, not to the device: a
            // request of another size can be refused while that pool holds the memory it needs. Let
            // the pool return what it holds once the frees have run, and ask again.
            trim_driver_pool(gpu);
            // SAFETY: as above.
            unsafe { result::malloc_async(gpu.stream.cu_stream(), bytes) }
        })
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

/// Waits for the GPU's stream (so that every queued free has happened) and releases all the unused
/// memory of the device's default memory pool, the one `cuMemAllocAsync` serves from.
fn trim_driver_pool(gpu: &crate::backend::cuda::Gpu) {
    if gpu.wait().is_err() {
        return;
    }
    let mut pool: sys::CUmemoryPool = ptr::null_mut();
    // SAFETY: `pool` is a valid out-pointer and the device handle is this context's; the default
    // pool belongs to the device and lives as long as it.
    let found = unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, gpu.ctx.cu_device()) };
    if found == sys::CUresult::CUDA_SUCCESS {
        // SAFETY: `pool` is the device's default pool; trimming releases only memory no allocation
        // uses (the stream was synchronised, so every queued free has completed).
        unsafe { sys::cuMemPoolTrimTo(pool, 0) };
    }
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

/// What the CUDA simulator exports to hear of the blocks a pool lends out of its driver allocations
/// (`cudasimNoteBlock` in cudasim/src/memory.cpp): address, bytes, lent (1) or returned (0).
type NoteBlock = unsafe extern "C" fn(u64, usize, i32) -> i32;

/// Tells a memory checker standing in for the driver that `bytes` at `ptr` were lent to one block
/// (`lent`) or came back, as compute-sanitizer hears of a caching allocator's blocks through NVTX's
/// memory-region calls. With a real driver the symbol does not exist and this does nothing.
pub(crate) fn note_block(_ordinal: usize, ptr: NonNull<u8>, bytes: usize, lent: bool) {
    static NOTE: OnceLock<Option<NoteBlock>> = OnceLock::new();
    let note = NOTE.get_or_init(|| {
        // SAFETY: the driver library is already loaded (this memory came from it); looking a symbol up
        // calls nothing, and the simulator's function has exactly the `NoteBlock` signature.
        unsafe {
            cudarc::driver::sys::culib()
                .get::<NoteBlock>(b"cudasimNoteBlock\0")
                .ok()
                .map(|f| *f)
        }
    });
    if let Some(note) = note {
        // SAFETY: the simulator only updates its own records of the address range (its answer, a
        // status, matters only to the simulator, which reports a bad range itself).
        unsafe { note(ptr.as_ptr() as usize as u64, bytes, i32::from(lent)) };
    }
}
