//! CUDA graphs: the GPU's stream recorded while a step runs, then replayed with one launch.
//!
//! While a capture is open the stream records kernels and copies instead of running them, so the
//! layers above refuse everything that would wait for the GPU or need the host during a replay
//! (`Gpu::capturing` is what they ask). cuBLAS has a workspace of its own (`blas.rs`), so it
//! allocates nothing inside a captured product.

use std::sync::atomic::Ordering;

use cudarc::driver::{CudaGraph, sys};

use crate::backend::cuda::{cuda_error, gpu};
use crate::error::Result;

/// A captured step, replayable on its GPU's stream.
pub(crate) struct Graph {
    graph: CudaGraph,
}

impl Graph {
    /// Queues one replay of the captured work on the GPU's stream.
    pub(crate) fn launch(&self) -> Result<()> {
        self.graph
            .launch()
            .map_err(|e| cuda_error("replaying a CUDA graph", e))
    }
}

/// Starts recording the stream of GPU `ordinal`.
pub(crate) fn begin_capture(ordinal: usize) -> Result<()> {
    let gpu = gpu(ordinal)?;
    gpu.bind()?;
    gpu.blas()?; // created (with its workspace) outside the capture
    gpu.stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(|e| cuda_error("starting a CUDA graph capture", e))?;
    gpu.capturing.store(true, Ordering::Release);
    Ok(())
}

/// Stops recording the stream of GPU `ordinal` and instantiates what it recorded.
pub(crate) fn end_capture(ordinal: usize) -> Result<Graph> {
    let gpu = gpu(ordinal)?;
    gpu.capturing.store(false, Ordering::Release);
    gpu.bind()?;
    let graph = gpu
        .stream
        .end_capture(sys::CUgraphInstantiate_flags(0))
        .map_err(|e| cuda_error("ending a CUDA graph capture", e))?;
    let graph = graph.ok_or_else(|| {
        cuda_error(
            "ending a CUDA graph capture",
            "the driver returned no graph (was the capture invalidated?)",
        )
    })?;
    graph
        .upload()
        .map_err(|e| cuda_error("uploading a CUDA graph", e))?;
    Ok(Graph { graph })
}
