//! Copies between host memory and a GPU, on the GPU's stream.

use cudarc::driver::result;

use crate::cuda::{cuda_error, gpu_of};
use crate::dtype::Element;
use crate::error::Result;
use crate::tensor::Tensor;

/// Writes `data` into `out`, a contiguous GPU tensor of `data.len()` elements of `T`, in place (the
/// caller owns `out` uniquely or made it so).
pub(crate) fn upload<T: Element>(data: &[T], out: &mut Tensor<'_>) -> Result<()> {
    debug_assert!(out.is_contiguous() && out.numel() == data.len() && out.dtype() == T::DTYPE);
    if data.is_empty() {
        return Ok(());
    }
    let gpu = gpu_of(out.device())?;
    gpu.bind()?;
    // SAFETY: `out` views `data.len()` elements of `T` from its device address, inside its block;
    // the source is pageable host memory, which the driver stages before this call returns, so
    // `data` may be dropped afterwards. The copy is ordered on the stream with every kernel.
    unsafe { result::memcpy_htod_async(out.device_ptr(), data, gpu.stream.cu_stream()) }
        .map_err(|e| cuda_error("copying to the GPU", e))
}

/// Fills `out` (host memory of `t.numel()` elements) with the elements of the GPU tensor `t` in
/// row-major order; returns once they have arrived.
pub(crate) fn download_into<T: Element>(t: &Tensor<'_>, out: &mut [T]) -> Result<()> {
    debug_assert!(out.len() == t.numel() && t.dtype() == T::DTYPE);
    if out.is_empty() {
        return Ok(());
    }
    // A strided view is gathered on the GPU first, into a temporary of the tensor's scope.
    let src = t.contiguous()?;
    let gpu = gpu_of(src.device())?;
    gpu.bind()?;
    // SAFETY: `src` is contiguous and views `out.len()` elements of `T` in its block; the copy is
    // ordered after every kernel queued so far, and the synchronisation below waits for it before
    // `out` is read (or the temporary freed).
    unsafe { result::memcpy_dtoh_async(out, src.device_ptr(), gpu.stream.cu_stream()) }
        .map_err(|e| cuda_error("copying from the GPU", e))?;
    gpu.synchronize()
}

/// The elements of a GPU tensor in row-major order.
pub(crate) fn download<T: Element>(t: &Tensor<'_>) -> Result<Vec<T>> {
    let mut out = vec![T::zero(); t.numel()];
    download_into(t, &mut out)?;
    Ok(out)
}
