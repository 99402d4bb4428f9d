//! What `ferrograd memory` and OOM messages show: per device, the driver's used/total and the
//! caching allocator's own figures.

use super::alloc::MemoryStats;
use super::device::CudaDevice;
use crate::Result;

/// One device's memory as `ferrograd memory` prints it: the driver's figures and the allocator's.
#[derive(Debug, Clone)]
pub struct DeviceMemoryStatus {
    /// Device ordinal.
    pub ordinal: usize,
    /// Device name.
    pub name: String,
    /// Driver figures for the whole device (all processes).
    pub free: usize,
    /// Total bytes.
    pub total: usize,
    /// `total - free`.
    pub used: usize,
    /// `used / total`, a fraction in `[0, 1]`.
    pub utilization: f64,
    /// The allocator cap, if one is set (`FERROGRAD_CUDA_MEMORY_LIMIT` or `set_memory_limit`).
    pub limit: Option<usize>,
    /// This process's caching-allocator counters.
    pub allocator: MemoryStats,
}

impl DeviceMemoryStatus {
    /// The figures of `dev` now.
    pub fn of(dev: &CudaDevice) -> Result<DeviceMemoryStatus> {
        let (free, total) = dev.mem_info()?;
        let used = total.saturating_sub(free);
        Ok(DeviceMemoryStatus {
            ordinal: dev.ordinal,
            name: dev.info.name.clone(),
            free,
            total,
            used,
            utilization: if total > 0 { used as f64 / total as f64 } else { 0.0 },
            limit: dev.memory_limit(),
            allocator: dev.memory_stats(),
        })
    }
}

/// Status of every visible CUDA device (opening each one); an error when CUDA is unusable.
pub fn memory_status() -> Result<Vec<DeviceMemoryStatus>> {
    (0..super::device_count()?).map(|o| DeviceMemoryStatus::of(&*CudaDevice::get(o)?)).collect()
}
