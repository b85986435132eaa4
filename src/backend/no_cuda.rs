//! The CUDA backend of a build without the `cuda` feature: every GPU is unavailable, for one
//! reason, said here once. It has the same items as `cuda/mod.rs`, so no module above the backend
//! depends on the feature.

use std::ptr::NonNull;

use crate::backend::{Backend, GpuMemory};
use crate::device::Device;
use crate::error::{Error, Result};

fn unavailable(ordinal: usize) -> Error {
    Error::DeviceUnavailable {
        device: Device::Cuda(ordinal).to_string(),
        reason: "this build of ndscope has no CUDA backend; rebuild with `--features cuda` or use \
                 Device::Cpu"
            .into(),
    }
}

/// The backend of GPU `ordinal`: never available in this build.
pub(crate) fn backend(ordinal: usize) -> Result<&'static dyn Backend> {
    Err(unavailable(ordinal))
}

/// Allocator traffic of GPU `ordinal`: never available in this build.
pub(crate) fn memory_stats(ordinal: usize) -> Result<GpuMemory> {
    Err(unavailable(ordinal))
}

/// Resets the reserved-bytes peak of GPU `ordinal`: never available in this build.
pub(crate) fn reset_memory_peak(ordinal: usize) -> Result<()> {
    Err(unavailable(ordinal))
}

/// GPU memory: refused, since no scope can open on a GPU in this build (`backend` refuses first).
pub(crate) fn alloc(_ordinal: usize, _bytes: usize) -> Option<NonNull<u8>> {
    None
}

/// Never called: [`alloc`] hands out nothing to free.
///
/// # Safety
/// None needed; the signature matches the CUDA backend's.
pub(crate) unsafe fn free(_ordinal: usize, _ptr: NonNull<u8>, _bytes: usize) {}

/// Nothing listens to block notes in this build (no GPU memory exists).
pub(crate) fn note_block(_ordinal: usize, _ptr: NonNull<u8>, _bytes: usize, _lent: bool) {}

/// A captured step: none exist in this build.
pub(crate) enum Graph {}

impl Graph {
    /// Never called: no graph exists.
    pub(crate) fn launch(&self) -> Result<()> {
        match *self {}
    }
}

/// Captures are refused: no GPU opens in this build.
pub(crate) fn begin_capture(ordinal: usize) -> Result<()> {
    Err(unavailable(ordinal))
}

/// Captures are refused: no GPU opens in this build.
pub(crate) fn end_capture(ordinal: usize) -> Result<Graph> {
    Err(unavailable(ordinal))
}

/// Refused: no GPU opens in this build.
///
/// # Safety
/// None needed; the signature matches the CUDA backend's.
pub(crate) unsafe fn copy_to_device(ordinal: usize, _ptr: NonNull<u8>, _data: &[u8]) -> Result<()> {
    Err(unavailable(ordinal))
}

/// Refused: no GPU opens in this build.
///
/// # Safety
/// None needed; the signature matches the CUDA backend's.
pub(crate) unsafe fn copy_from_device(
    ordinal: usize,
    _ptr: NonNull<u8>,
    _out: &mut [u8],
) -> Result<()> {
    Err(unavailable(ordinal))
}

/// An NCCL communicator: none exist in this build.
pub(crate) enum Nccl {}

/// Refused: no GPU opens in this build.
pub(crate) fn nccl_unique_id(ordinal: usize) -> Result<[u8; 128]> {
    Err(unavailable(ordinal))
}

impl Nccl {
    /// Refused: no GPU opens in this build.
    pub(crate) fn new(
        ordinal: usize,
        _rank: usize,
        _world: usize,
        _id: &[u8; 128],
    ) -> Result<Nccl> {
        Err(unavailable(ordinal))
    }

    /// Never called: no communicator exists.
    pub(crate) fn ordinal(&self) -> usize {
        match *self {}
    }

    /// Never called: no communicator exists.
    ///
    /// # Safety
    /// None needed; the signature matches the CUDA backend's.
    pub(crate) unsafe fn all_reduce(
        &self,
        _send: u64,
        _recv: u64,
        _elements: usize,
        _dtype: crate::dtype::DType,
        _reduce: crate::backend::NcclReduce,
    ) -> Result<()> {
        match *self {}
    }

    /// Never called: no communicator exists.
    ///
    /// # Safety
    /// None needed; the signature matches the CUDA backend's.
    pub(crate) unsafe fn broadcast(&self, _buf: u64, _bytes: usize, _root: usize) -> Result<()> {
        match *self {}
    }

    /// Never called: no communicator exists.
    ///
    /// # Safety
    /// None needed; the signature matches the CUDA backend's.
    pub(crate) unsafe fn all_gather(&self, _send: u64, _recv: u64, _bytes: usize) -> Result<()> {
        match *self {}
    }
}
