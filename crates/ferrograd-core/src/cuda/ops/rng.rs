//! Launches of `kernels/rng.cu`: Philox numbers drawn on the device, the same as the CPU draws.

use crate::cpu::CpuStorage;
use crate::cuda::device::CudaDevice;
use crate::cuda::launch::{cfg_1d, launch};
use crate::cuda::modules;
use crate::cuda::storage::CudaStorage;
use crate::{DType, Result};
use std::sync::Arc;

impl CudaStorage {
    /// Philox random numbers, the same as the CPU backend draws for (seed, offset): uniform in
    /// `[a, b)`, or normal with mean `a` and standard deviation `b`. Integer dtypes are drawn on
    /// the host (the kernels are float only).
    #[allow(clippy::too_many_arguments)]
    pub fn random(
        dev: &Arc<CudaDevice>,
        normal: bool,
        n: usize,
        dtype: DType,
        seed: u64,
        offset: u64,
        a: f64,
        b: f64,
    ) -> Result<CudaStorage> {
        if !dtype.is_float() {
            let cpu = if normal {
                CpuStorage::from_f64_iter((0..n).map(|i| a + b * crate::rng::normal_at(seed, offset, i as u64)), dtype)?
            } else {
                CpuStorage::from_f64_iter(
                    (0..n).map(|i| a + (b - a) * crate::rng::uniform_at(seed, offset, i as u64)),
                    dtype,
                )?
            };
            return Self::from_cpu(dev, &cpu);
        }
        let s = Self::uninit(dev, n, dtype)?;
        if n > 0 {
            let kind = if normal { "normal" } else { "uniform" };
            launch!(dev, modules::RNG, format!("rand_{kind}_{dtype}"), cfg_1d(dev, n); s.buf.ptr(), n as u64, seed, offset, a, b);
        }
        Ok(s)
    }
}
