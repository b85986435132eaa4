//! Where a scope's memory lives.

use std::fmt;

#[cfg(not(feature = "cuda"))]
use crate::error::Error;
use crate::error::Result;

/// A memory space. Every scope has one; its children inherit it, and tensors created in a scope
/// (`zeros`, `from_slice`, ...) live there. An op's result lives on its operands' device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Device {
    /// Host memory; always available.
    #[default]
    Cpu,
    /// An NVIDIA GPU by ordinal (needs the `cuda` feature, an NVIDIA driver and the device).
    Cuda(usize),
}

impl Device {
    /// Whether this is a GPU.
    pub const fn is_cuda(self) -> bool {
        matches!(self, Device::Cuda(_))
    }

    /// Checks that this build of ndscope, on this machine, can use the device: for a GPU, that the
    /// `cuda` feature is on, the driver loads, the ordinal exists, and its context and kernels are
    /// ready (the first call per GPU compiles the kernels; later calls are a lookup).
    ///
    /// ```
    /// use ndscope::Device;
    /// assert!(Device::Cpu.check_available().is_ok());
    /// match Device::Cuda(0).check_available() {
    ///     Ok(()) => println!("a GPU is ready"),
    ///     Err(e) => println!("{e}"), // says why: no `cuda` feature, no driver, no such GPU, ...
    /// }
    /// ```
    ///
    /// # Errors
    /// [`Error::DeviceUnavailable`] with the reason and what to do about it.
    pub fn check_available(self) -> Result<()> {
        match self {
            Device::Cpu => Ok(()),
            #[cfg(feature = "cuda")]
            Device::Cuda(ordinal) => crate::cuda::gpu(ordinal).map(|_| ()),
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => Err(Error::DeviceUnavailable {
                device: self.to_string(),
                reason:
                    "this build of ndscope has no CUDA backend; rebuild with `--features cuda` \
                         or use Device::Cpu"
                        .into(),
            }),
        }
    }
}

impl Device {
    /// Waits until every op queued on the device has finished (a GPU runs ops asynchronously; the
    /// host never waits for the CPU). Reading results (`to_vec`, `to_device`) waits by itself; this
    /// is for timing.
    ///
    /// # Errors
    /// As for [`check_available`](Self::check_available); CUDA errors a kernel reported.
    pub fn synchronize(self) -> Result<()> {
        match self {
            Device::Cpu => Ok(()),
            #[cfg(feature = "cuda")]
            Device::Cuda(ordinal) => crate::cuda::gpu(ordinal)?.synchronize(),
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => self.check_available(),
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}
