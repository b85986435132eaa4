//! Where a scope's memory lives.

use std::fmt;

use crate::error::{Error, Result};

/// A memory space. Every scope has one; its children inherit it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Device {
    /// Host memory; always available.
    #[default]
    Cpu,
    /// An NVIDIA GPU by ordinal.
    Cuda(usize),
}

impl Device {
    /// Checks that this build of ndscope can open scopes on the device.
    pub(crate) fn check_available(self) -> Result<()> {
        match self {
            Device::Cpu => Ok(()),
            Device::Cuda(_) => Err(Error::DeviceUnavailable {
                device: self.to_string(),
                reason: "this build of ndscope has no CUDA backend; only Device::Cpu is available"
                    .into(),
            }),
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
