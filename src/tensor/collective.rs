//! Collectives between processes on GPU tensors: the safe, tensor-taking face of the backend's
//! NCCL communicator. `dist` decides what to exchange and when; this module owns how a tensor's
//! device memory is handed to NCCL, so no device address leaves the tensor and backend modules.

use crate::backend::{Nccl, nccl_unique_id};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// How an all-reduce combines the ranks' values (a mean is a sum its caller divides).
pub(crate) use crate::backend::NcclReduce as GpuReduce;

/// This process's communicator with the other ranks' GPUs (one GPU per process).
pub(crate) struct GpuCommunicator(Nccl);

impl GpuCommunicator {
    /// A new unique id for a communicator (rank 0 makes it; every rank gets it over MPI).
    ///
    /// # Errors
    /// [`Error::DeviceUnavailable`] when NCCL cannot be loaded.
    pub(crate) fn unique_id(ordinal: usize) -> Result<[u8; 128]> {
        nccl_unique_id(ordinal)
    }

    /// Joins the communicator of `world` ranks that rank 0's `id` names, as `rank`, on GPU
    /// `ordinal`. Every rank calls it at once (it waits for all of them).
    ///
    /// # Errors
    /// [`Error::DeviceUnavailable`]; NCCL's errors.
    pub(crate) fn join(
        ordinal: usize,
        rank: usize,
        world: usize,
        id: &[u8; 128],
    ) -> Result<GpuCommunicator> {
        Nccl::new(ordinal, rank, world, id).map(GpuCommunicator)
    }

    /// The GPU the communicator is on.
    pub(crate) fn ordinal(&self) -> usize {
        self.0.ordinal()
    }

    /// Enqueues the all-reduce of `src` into `out` (a fresh tensor of its shape and dtype) on
    /// the GPU's stream.
    ///
    /// # Errors
    /// As for [`Tensor::device_address`]; NCCL's errors.
    pub(crate) fn all_reduce(
        &self,
        op: &'static str,
        src: &Tensor<'_>,
        out: &mut Tensor<'_>,
        reduce: GpuReduce,
    ) -> Result<()> {
        same_size(op, src, out, 1)?;
        let ((_, send), (_, recv)) = (src.device_address(op)?, out.device_address_mut(op)?);
        // SAFETY: both are live blocks of this GPU, `src.numel()` elements each (checked above),
        // that free stream-ordered (after the collective); `out` is borrowed mutably and unique
        // after the copy-on-write step, so nothing else writes it meanwhile.
        unsafe {
            self.0
                .all_reduce(send, recv, src.numel(), src.dtype(), reduce)
        }
    }

    /// Enqueues the broadcast of rank `root`'s `t` into every rank's `t`.
    ///
    /// # Errors
    /// As for [`Tensor::device_address`]; NCCL's errors.
    pub(crate) fn broadcast_(
        &self,
        op: &'static str,
        t: &mut Tensor<'_>,
        root: usize,
    ) -> Result<()> {
        let (_, buf) = t.device_address_mut(op)?;
        let bytes = t.numel() * t.dtype().size();
        // SAFETY: `t`'s block is live, `bytes` long from `buf`, and frees stream-ordered, after
        // the collective; `t` is borrowed mutably and unique after the copy-on-write step.
        unsafe { self.0.broadcast(buf, bytes, root) }
    }

    /// Enqueues the all-gather of every rank's `src` into `out` (`[world, ..src.shape()]`).
    ///
    /// # Errors
    /// As for [`Tensor::device_address`]; NCCL's errors.
    pub(crate) fn all_gather(
        &self,
        op: &'static str,
        src: &Tensor<'_>,
        out: &mut Tensor<'_>,
        world: usize,
    ) -> Result<()> {
        same_size(op, src, out, world)?;
        let ((_, send), (_, recv)) = (src.device_address(op)?, out.device_address_mut(op)?);
        // SAFETY: as in `all_reduce`; `out` holds `world` times `src`'s bytes (checked above).
        unsafe {
            self.0
                .all_gather(send, recv, src.numel() * src.dtype().size())
        }
    }
}

/// Checks that `out` holds `times` copies of `src`'s elements, of its dtype, on its GPU: what the
/// raw NCCL calls rely on.
fn same_size(op: &'static str, src: &Tensor<'_>, out: &Tensor<'_>, times: usize) -> Result<()> {
    let fits = out.numel() == src.numel() * times
        && out.dtype() == src.dtype()
        && out.device() == src.device()
        && matches!(src.device(), Device::Cuda(_));
    if fits {
        return Ok(());
    }
    Err(Error::Distributed {
        op,
        reason: format!(
            "a GPU collective needs an output of {times} x {} {} elements on {}, not {} {} on {}",
            src.numel(),
            src.dtype(),
            src.device(),
            out.numel(),
            out.dtype(),
            out.device()
        ),
    })
}
