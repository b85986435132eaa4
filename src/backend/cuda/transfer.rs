//! Copies between host memory and a GPU, on the GPU's stream.

use cudarc::driver::result;

use crate::backend::cuda::{Gpu, cuda_error};
use crate::error::Result;

/// Writes `data` to the GPU at `address` (the first of `data.len()` bytes inside a block the caller
/// owns uniquely).
pub(crate) fn upload(gpu: &Gpu, address: u64, data: &[u8]) -> Result<()> {
    if data.is_empty() {
        return Ok(());
    }
    gpu.bind()?;
    // SAFETY: `address` starts `data.len()` bytes inside a live block; the source is pageable host
    // memory, which the driver stages before this call returns, so `data` may be dropped afterwards.
    // The copy is ordered on the stream with every kernel.
    unsafe { result::memcpy_htod_async(address, data, gpu.stream.cu_stream()) }
        .map_err(|e| cuda_error("copying to the GPU", e))
}

/// Fills `out` with the bytes at `address` on the GPU (the first of `out.len()` bytes inside a live
/// block); returns once they have arrived.
pub(crate) fn download(gpu: &Gpu, address: u64, out: &mut [u8]) -> Result<()> {
    if out.is_empty() {
        return Ok(());
    }
    gpu.bind()?;
    // SAFETY: `address` starts `out.len()` bytes inside a live block; the copy is ordered after every
    // kernel queued so far, and the synchronisation below waits for it before `out` is read.
    unsafe { result::memcpy_dtoh_async(out, address, gpu.stream.cu_stream()) }
        .map_err(|e| cuda_error("copying from the GPU", e))?;
    gpu.wait()
}

/// Copies `data` to the device address `ptr` of GPU `ordinal`.
///
/// # Safety
/// `ptr` starts `data.len()` bytes of live memory of that GPU that nothing else writes until the
/// stream has run the copy.
pub(crate) unsafe fn copy_to_device(
    ordinal: usize,
    ptr: std::ptr::NonNull<u8>,
    data: &[u8],
) -> Result<()> {
    upload(
        crate::backend::cuda::gpu(ordinal)?,
        ptr.as_ptr() as u64,
        data,
    )
}

/// Copies from the device address `ptr` of GPU `ordinal` into `out`, after the queued work.
///
/// # Safety
/// `ptr` starts `out.len()` bytes of live memory of that GPU.
pub(crate) unsafe fn copy_from_device(
    ordinal: usize,
    ptr: std::ptr::NonNull<u8>,
    out: &mut [u8],
) -> Result<()> {
    download(
        crate::backend::cuda::gpu(ordinal)?,
        ptr.as_ptr() as u64,
        out,
    )
}
