//! Where a tensor lives. `Device::best()` picks a usable GPU or falls back to the CPU, and
//! `FERROGRAD_DEVICE=cpu|cuda|cuda:N` overrides the choice.

use crate::{Error, Result};
use std::fmt;

/// Where a tensor lives: the host CPU or a CUDA GPU by ordinal (`torch.device`). Parses from
/// `"cpu"`, `"cuda"`/`"gpu"` (GPU 0) and `"cuda:N"`; displays as `cpu` / `cuda:N`.
/// ```
/// use ferrograd_core::Device;
/// let d: Device = "cuda:1".parse()?;
/// assert_eq!(d, Device::Cuda(1));
/// assert_eq!(Device::Cpu.to_string(), "cpu");
/// # Ok::<(), ferrograd_core::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Device {
    /// Host memory; ops run on rayon threads.
    #[default]
    Cpu,
    /// CUDA device `N` (after `CUDA_VISIBLE_DEVICES`).
    Cuda(usize),
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl std::str::FromStr for Device {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let s = s.trim().to_ascii_lowercase();
        match s.as_str() {
            "cpu" => Ok(Device::Cpu),
            "cuda" | "gpu" => Ok(Device::Cuda(0)),
            _ => match s.strip_prefix("cuda:") {
                Some(n) => n
                    .parse::<usize>()
                    .map(Device::Cuda)
                    .map_err(|_| Error::InvalidArgument(format!("bad device ordinal in {s:?}"))),
                None => Err(Error::InvalidArgument(format!("unknown device {s:?}: expected cpu, cuda or cuda:N"))),
            },
        }
    }
}

impl Device {
    /// Whether this is [`Device::Cpu`].
    pub fn is_cpu(&self) -> bool {
        matches!(self, Device::Cpu)
    }
    /// Whether this is a CUDA device.
    pub fn is_cuda(&self) -> bool {
        matches!(self, Device::Cuda(_))
    }
}

impl Device {
    /// The device to use: `FERROGRAD_DEVICE` if set, else a usable GPU, else the CPU. The string
    /// says in one line why this device was chosen.
    pub fn best_with_reason() -> Result<(Device, String)> {
        if let Ok(s) = std::env::var("FERROGRAD_DEVICE") {
            // Name the variable in the error: the user may not remember setting it.
            let named = |e: Error| {
                let e = match e {
                    Error::InvalidArgument(m) => m,
                    e => e.to_string(),
                };
                Error::InvalidArgument(format!("FERROGRAD_DEVICE={s}: {e}"))
            };
            let d: Device = s.parse().map_err(named)?;
            if let Device::Cuda(n) = d {
                crate::cuda::CudaDevice::get(n).map_err(named)?;
            }
            return Ok((d, format!("FERROGRAD_DEVICE={s}")));
        }
        Ok(match crate::cuda::CudaDevice::get(0) {
            Ok(dev) => (Device::Cuda(0), format!("running on cuda:0 ({})", dev.info.name)),
            Err(e) => (Device::Cpu, format!("running on the CPU: {e}")),
        })
    }

    /// [`Device::best_with_reason`] without the reason: `FERROGRAD_DEVICE` if set, else `cuda:0` if
    /// usable, else the CPU. Errors only when `FERROGRAD_DEVICE` is set to something unusable.
    pub fn best() -> Result<Device> {
        Ok(Self::best_with_reason()?.0)
    }

    /// Block until all work queued on this device has finished (a no-op on the CPU).
    pub fn synchronize(&self) -> Result<()> {
        match self {
            Device::Cpu => Ok(()),
            Device::Cuda(n) => crate::cuda::CudaDevice::get(*n)?.synchronize(),
        }
    }
}
