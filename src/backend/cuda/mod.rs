//! The CUDA backend: one context, stream, kernel module and cuBLAS handle per GPU, opened the first
//! time a scope or a copy asks for the GPU and kept for the life of the process.
//!
//! Everything a GPU runs goes through its one stream, in program order. That is what lets the tree's
//! caching pool hand a freed block to the next op at once (the stream runs the old reads before the
//! new writes), and what lets host code read results after a single synchronisation in
//! `transfer`. cudarc loads `libcuda`, NVRTC and cuBLAS at run time, so a build with the `cuda`
//! feature runs everywhere and reports a missing driver as [`Error::DeviceUnavailable`].

mod attention;
mod blas;
mod graph;
mod kernels;
mod memory;
mod nccl;
mod ops;
mod paged;
mod quant;
mod transfer;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream};
use cudarc::nvrtc::CompileOptions;

use crate::backend::{Backend, GpuMemory};
use crate::device::Device;
use crate::error::{Error, Result};

pub(crate) use graph::{Graph, begin_capture, end_capture};
pub(crate) use memory::{alloc, free, note_block};
pub(crate) use nccl::{Nccl, nccl_unique_id};
pub(crate) use transfer::{copy_from_device, copy_to_device};

/// What the backend holds for one GPU.
pub(crate) struct Gpu {
    pub(crate) ordinal: usize,
    pub(crate) ctx: Arc<CudaContext>,
    /// The stream every op, copy, allocation and free of this GPU is ordered on.
    pub(crate) stream: Arc<CudaStream>,
    module: Arc<CudaModule>,
    functions: Mutex<HashMap<&'static str, CudaFunction>>,
    blas: OnceLock<std::result::Result<CudaBlas, String>>,
    /// Whether the driver has stream-ordered allocation (`cuMemAllocAsync`).
    pub(crate) async_alloc: bool,
    pub(crate) counters: Counters,
    /// Whether the stream is being captured into a CUDA graph (`graph.rs`).
    pub(crate) capturing: AtomicBool,
    /// Device address of a scratch block of `ops::REDUCE_PARTIALS` 8-byte values, for the partial
    /// results of split reductions. Allocated when the GPU is opened (so a captured step never
    /// allocates it) and never freed: the GPU lives as long as the process.
    pub(crate) partials: u64,
}

/// Allocator traffic of one GPU, and the host's waits for it, over the whole process.
#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) allocator_calls: AtomicU64,
    pub(crate) free_calls: AtomicU64,
    pub(crate) reserved_bytes: AtomicUsize,
    pub(crate) peak_reserved_bytes: AtomicUsize,
    /// Times the host waited for the stream's queue ([`Gpu::wait`]).
    pub(crate) host_waits: AtomicU64,
}

/// GPUs opened so far, with the outcome (a failure is remembered too, so a missing driver is looked
/// for once).
static GPUS: Mutex<Vec<(usize, std::result::Result<&'static Gpu, String>)>> =
    Mutex::new(Vec::new());

/// The backend of GPU `ordinal`, opened on first use.
pub(crate) fn gpu(ordinal: usize) -> Result<&'static Gpu> {
    let mut gpus = GPUS.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let outcome = match gpus.iter().find(|(o, _)| *o == ordinal) {
        Some((_, outcome)) => outcome.clone(),
        None => {
            let outcome = Gpu::open(ordinal).map(|g| &*Box::leak(Box::new(g)));
            gpus.push((ordinal, outcome.clone()));
            outcome
        }
    };
    outcome.map_err(|reason| Error::DeviceUnavailable {
        device: Device::Cuda(ordinal).to_string(),
        reason,
    })
}

/// The backend of GPU `ordinal`, opened on first use.
pub(crate) fn backend(ordinal: usize) -> Result<&'static dyn Backend> {
    Ok(gpu(ordinal)?)
}

impl Gpu {
    fn open(ordinal: usize) -> std::result::Result<Gpu, String> {
        // SAFETY: only tries to load the library by its usual names; nothing is called through it.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(
                "no NVIDIA driver found (libcuda could not be loaded); install the driver on a \
                        machine with an NVIDIA GPU, or use Device::Cpu"
                    .into(),
            );
        }
        let count = CudaContext::device_count()
            .map_err(|e| format!("the CUDA driver does not answer: {e}"))?;
        if count <= 0 {
            return Err("the NVIDIA driver loads but sees no CUDA device".into());
        }
        if ordinal >= count as usize {
            return Err(format!(
                "this machine has {count} CUDA device(s); valid devices are cuda:0 to cuda:{}",
                count - 1
            ));
        }
        let ctx =
            CudaContext::new(ordinal).map_err(|e| format!("cannot create a CUDA context: {e}"))?;
        let stream = ctx
            .new_stream()
            .map_err(|e| format!("cannot create a CUDA stream: {e}"))?;
        // SAFETY: as above, a load attempt only.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return Err(
                "NVRTC (libnvrtc) could not be loaded; ndscope compiles its kernels at run \
                        time and needs the CUDA toolkit's NVRTC library on the library path"
                    .into(),
            );
        }
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| format!("cannot read the compute capability: {e}"))?;
        // One string per opened GPU, kept for the process like the GPU itself.
        let arch: &'static str = Box::leak(format!("compute_{major}{minor}").into_boxed_str());
        let options = CompileOptions {
            arch: Some(arch),
            name: Some("ndscope.cu".into()),
            ..Default::default()
        };
        let ptx = cudarc::nvrtc::compile_ptx_with_opts(kernels::SOURCES.concat(), options)
            .map_err(|e| format!("NVRTC could not compile ndscope's kernels for {arch}: {e:?}"))?;
        let module = ctx
            .load_module(ptx)
            .map_err(|e| format!("cannot load ndscope's kernels: {e}"))?;
        let async_alloc = ctx.has_async_alloc();
        ctx.bind_to_thread()
            .map_err(|e| format!("cannot make the CUDA context current: {e}"))?;
        // SAFETY: the GPU's context is current; the block is only ever written by `reduce_part`
        // kernels before `reduce_join` kernels read it, on this GPU's one stream.
        let partials = unsafe { cudarc::driver::result::malloc_sync(ops::REDUCE_PARTIALS * 8) }
            .map_err(|e| format!("the GPU refused 32 KiB for reduction partials: {e}"))?;
        Ok(Gpu {
            ordinal,
            ctx,
            stream,
            module,
            functions: Mutex::new(HashMap::new()),
            blas: OnceLock::new(),
            async_alloc,
            counters: Counters::default(),
            capturing: AtomicBool::new(false),
            partials,
        })
    }

    /// A kernel of ndscope's module by name (looked up once, then cached).
    pub(crate) fn function(&self, name: &'static str) -> Result<CudaFunction> {
        let mut functions = self
            .functions
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(f) = functions.get(name) {
            return Ok(f.clone());
        }
        let f = self
            .module
            .load_function(name)
            .map_err(|e| cuda_error("loading a kernel", e))?;
        functions.insert(name, f.clone());
        Ok(f)
    }

    /// The GPU's cuBLAS handle, created on first use.
    pub(crate) fn blas(&self) -> Result<&CudaBlas> {
        let blas = self.blas.get_or_init(|| {
            // SAFETY: a load attempt only.
            if !unsafe { cudarc::cublas::sys::is_culib_present() } {
                return Err(
                    "cuBLAS (libcublas) could not be loaded; matrix products on a GPU need \
                            the CUDA toolkit's cuBLAS library on the library path"
                        .into(),
                );
            }
            let blas = CudaBlas::new(self.stream.clone())
                .map_err(|e| format!("cannot create a cuBLAS handle: {e}"))?;
            blas::give_workspace(self, &blas)?;
            Ok(blas)
        });
        blas.as_ref().map_err(|reason| Error::DeviceUnavailable {
            device: Device::Cuda(self.ordinal).to_string(),
            reason: reason.clone(),
        })
    }

    /// Makes the GPU's context current on this thread (driver calls act on the current context).
    pub(crate) fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_error("binding the CUDA context", e))
    }

    /// Waits until the stream has run everything queued on it, and counts the wait: each one stops
    /// the host from queueing more work, so the GPU idles until the host catches up.
    pub(crate) fn wait(&self) -> Result<()> {
        self.counters
            .host_waits
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.stream
            .synchronize()
            .map_err(|e| cuda_error("synchronizing the stream", e))
    }
}

/// A CUDA library error as an ndscope error.
pub(crate) fn cuda_error(op: &'static str, e: impl std::fmt::Display) -> Error {
    Error::Cuda {
        op,
        reason: e.to_string(),
    }
}

/// Allocator traffic of GPU `ordinal` over the whole process.
pub(crate) fn memory_stats(ordinal: usize) -> Result<GpuMemory> {
    use std::sync::atomic::Ordering::Relaxed;
    let gpu = gpu(ordinal)?;
    let (free_bytes, total_bytes) = gpu
        .ctx
        .mem_get_info()
        .map_err(|e| cuda_error("cuMemGetInfo", e))?;
    let c = &gpu.counters;
    Ok(GpuMemory {
        total_bytes,
        free_bytes,
        allocator_calls: c.allocator_calls.load(Relaxed),
        free_calls: c.free_calls.load(Relaxed),
        reserved_bytes: c.reserved_bytes.load(Relaxed),
        peak_reserved_bytes: c.peak_reserved_bytes.load(Relaxed),
        host_waits: c.host_waits.load(Relaxed),
    })
}

/// Resets the reserved-bytes peak of GPU `ordinal` to the bytes reserved now.
pub(crate) fn reset_memory_peak(ordinal: usize) -> Result<()> {
    use std::sync::atomic::Ordering::Relaxed;
    let c = &gpu(ordinal)?.counters;
    c.peak_reserved_bytes
        .store(c.reserved_bytes.load(Relaxed), Relaxed);
    Ok(())
}
