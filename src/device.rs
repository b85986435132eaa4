//! Where a tensor's memory lives. Whether a device can be used, and waiting for it, is the
//! backend's business (`Device::check_available` and `Device::synchronize` live in `crate::backend`).

use std::fmt;
use std::str::FromStr;

use crate::error::Error;

/// A memory space. Every scope has one; its children inherit it, and tensors created in a scope
/// (`zeros`, `from_slice`, ...) live there. An op's result lives on its operands' device.
///
/// Parsed from the names it prints as: `"cpu"`, `"cuda"` (GPU 0) and `"cuda:N"`.
///
/// ```
/// use ndscope::Device;
/// assert_eq!("cuda:1".parse::<Device>()?, Device::Cuda(1));
/// assert_eq!("cuda".parse::<Device>()?, Device::Cuda(0));
/// assert_eq!(Device::Cpu.to_string().parse::<Device>()?, Device::Cpu);
/// assert!("gpu".parse::<Device>().is_err());
/// # Ok::<(), ndscope::Error>(())
/// ```
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
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

impl FromStr for Device {
    type Err = Error;

    /// Reads `cpu`, `cuda` or `cuda:N` (ASCII case and surrounding spaces ignored).
    fn from_str(text: &str) -> Result<Device, Error> {
        let name = text.trim().to_ascii_lowercase();
        let ordinal = match name.as_str() {
            "cpu" => return Ok(Device::Cpu),
            "cuda" => Some(0),
            _ => name
                .strip_prefix("cuda:")
                .and_then(|n| n.parse::<usize>().ok()),
        };
        ordinal
            .map(Device::Cuda)
            .ok_or_else(|| Error::InvalidDevice {
                text: text.to_string(),
            })
    }
}
