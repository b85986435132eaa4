//! NCCL: collectives between the GPUs of different processes, enqueued on each GPU's one stream,
//! so they are ordered with every kernel, copy and free of that GPU. `libnccl` is loaded at run time
//! like the other CUDA libraries (the `nvidia-nccl-cu12` wheel puts `libnccl.so.2` on disk).

use std::ffi::c_void;
use std::mem::MaybeUninit;

use cudarc::nccl::{result, sys};

use super::{Gpu, cuda_error, gpu};
use crate::backend::NcclReduce;
use crate::dtype::DType;
use crate::error::{Error, Result};

/// Checks that libnccl loads, before any NCCL call (cudarc panics on a missing library).
fn loaded(ordinal: usize) -> Result<()> {
    // SAFETY: only tries to load the library by its usual names; nothing is called through it.
    if unsafe { sys::is_culib_present() } {
        return Ok(());
    }
    Err(Error::DeviceUnavailable {
        device: format!("cuda:{ordinal}"),
        reason: "NCCL (libnccl.so) could not be loaded; collectives on GPU tensors need it: \
                 `pip install nvidia-nccl-cu12` puts libnccl.so.2 in site-packages/nvidia/nccl/lib, \
                 which wants a `libnccl.so` link beside it and that directory on LD_LIBRARY_PATH"
            .into(),
    })
}

/// A new NCCL unique id (rank 0 makes it; every rank gets it over MPI).
pub(crate) fn nccl_unique_id(ordinal: usize) -> Result<[u8; 128]> {
    loaded(ordinal)?;
    let id = result::get_uniqueid().map_err(|e| cuda_error("ncclGetUniqueId", format!("{e:?}")))?;
    Ok(id.internal.map(|c| c as u8))
}

/// This process's NCCL communicator, on one GPU.
pub(crate) struct Nccl {
    comm: sys::ncclComm_t,
    gpu: &'static Gpu,
}

impl Nccl {
    /// Joins the communicator of `world` ranks that rank 0's `id` names, as `rank`, on GPU
    /// `ordinal`. Every rank calls it at once (it waits for all of them).
    pub(crate) fn new(ordinal: usize, rank: usize, world: usize, id: &[u8; 128]) -> Result<Nccl> {
        loaded(ordinal)?;
        let gpu = gpu(ordinal)?;
        gpu.bind()?;
        let id = sys::ncclUniqueId {
            internal: id.map(|b| b as std::ffi::c_char),
        };
        let mut comm = MaybeUninit::uninit();
        // SAFETY: `comm` is valid for writes; the GPU's context is current on this thread.
        unsafe { result::comm_init_rank(comm.as_mut_ptr(), world as i32, id, rank as i32) }
            .map_err(|e| cuda_error("ncclCommInitRank", format!("{e:?}")))?;
        // SAFETY: ncclCommInitRank succeeded, so it wrote the communicator.
        let comm = unsafe { comm.assume_init() };
        Ok(Nccl { comm, gpu })
    }

    /// The GPU the communicator is on.
    pub(crate) fn ordinal(&self) -> usize {
        self.gpu.ordinal
    }

    fn stream(&self) -> sys::cudaStream_t {
        self.gpu.stream.cu_stream().cast()
    }

    /// Enqueues an all-reduce of `elements` values of `dtype` from `send` into `recv` (device
    /// addresses on this GPU).
    ///
    /// # Safety
    /// Both addresses start `elements * dtype.size()` bytes of live memory of this GPU that stays
    /// allocated until the stream has run the collective (the pool frees stream-ordered), and
    /// nothing else writes `recv` meanwhile.
    pub(crate) unsafe fn all_reduce(
        &self,
        send: u64,
        recv: u64,
        elements: usize,
        dtype: DType,
        reduce: NcclReduce,
    ) -> Result<()> {
        let datatype = match dtype {
            DType::F32 => sys::ncclDataType_t::ncclFloat32,
            DType::F64 => sys::ncclDataType_t::ncclFloat64,
            DType::I64 => sys::ncclDataType_t::ncclInt64,
            DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
            DType::F16 => sys::ncclDataType_t::ncclFloat16,
        };
        let op = match reduce {
            NcclReduce::Sum => sys::ncclRedOp_t::ncclSum,
            NcclReduce::Max => sys::ncclRedOp_t::ncclMax,
            NcclReduce::Min => sys::ncclRedOp_t::ncclMin,
        };
        self.gpu.bind()?;
        // SAFETY: by the caller's contract; the communicator and stream belong to this GPU.
        unsafe {
            result::all_reduce(
                send as *const c_void,
                recv as *mut c_void,
                elements,
                datatype,
                op,
                self.comm,
                self.stream(),
            )
        }
        .map(drop)
        .map_err(|e| cuda_error("ncclAllReduce", format!("{e:?}")))
    }

    /// Enqueues a broadcast of `bytes` bytes at `buf` from rank `root`.
    ///
    /// # Safety
    /// As for [`all_reduce`](Self::all_reduce), for `buf`.
    pub(crate) unsafe fn broadcast(&self, buf: u64, bytes: usize, root: usize) -> Result<()> {
        self.gpu.bind()?;
        // SAFETY: by the caller's contract; in-place (send and receive buffers are the same).
        unsafe {
            result::broadcast(
                buf as *const c_void,
                buf as *mut c_void,
                bytes,
                sys::ncclDataType_t::ncclUint8,
                root as i32,
                self.comm,
                self.stream(),
            )
        }
        .map(drop)
        .map_err(|e| cuda_error("ncclBroadcast", format!("{e:?}")))
    }

    /// Enqueues an all-gather of `bytes` bytes from every rank into `recv`, rank by rank.
    ///
    /// # Safety
    /// As for [`all_reduce`](Self::all_reduce); `recv` holds `bytes` times the world size.
    pub(crate) unsafe fn all_gather(&self, send: u64, recv: u64, bytes: usize) -> Result<()> {
        self.gpu.bind()?;
        // SAFETY: by the caller's contract.
        unsafe {
            result::all_gather(
                send as *const c_void,
                recv as *mut c_void,
                bytes,
                sys::ncclDataType_t::ncclUint8,
                self.comm,
                self.stream(),
            )
        }
        .map(drop)
        .map_err(|e| cuda_error("ncclAllGather", format!("{e:?}")))
    }
}

impl Drop for Nccl {
    fn drop(&mut self) {
        // Collectives still queued finish first: destroying waits for none, so wait here.
        let _ = self.gpu.wait();
        // SAFETY: the communicator was made by `new` and is destroyed once.
        let _ = unsafe { result::comm_destroy(self.comm) };
    }
}
