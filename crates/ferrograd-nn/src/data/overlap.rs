//! How well a host-to-device copy hides behind compute, measured on a synthetic training step:
//! compute is a few square matmuls, the transfer one pinned batch of a given size. Each part is
//! timed alone and then both are issued the way the loader issues them (next batch's copy first,
//! then the step), all with CUDA events on the compute stream, after warm-up, taking medians.
//!
//! efficiency = (compute + transfer - overlapped) / min(compute, transfer): 1.0 when the shorter
//! one is completely hidden, 0.0 when the two run back to back.

use ferrograd_core::cuda::{CudaDevice, GpuTimer};
use ferrograd_core::{DType, Device, Error, Result, Rng, Tensor};
use serde::Serialize;

/// The synthetic step of the transfer/compute overlap benchmark (`ferrograd bench overlap`): a
/// few square matmuls beside one host-to-device copy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OverlapConfig {
    /// Side of the square matmul operands.
    pub matmul_size: usize,
    /// Matmuls per synthetic step.
    pub matmuls: usize,
    /// Matmul dtype.
    pub dtype: DType,
    /// Bytes of the batch copied to the device per step.
    pub transfer_bytes: usize,
    /// Untimed steps first.
    pub warmup: usize,
    /// Timed steps (the median is reported).
    pub iters: usize,
}

impl Default for OverlapConfig {
    /// About a millisecond each on an H100-class GPU: four f32 2048^3 matmuls and a 64 MiB copy.
    fn default() -> Self {
        OverlapConfig {
            matmul_size: 2048,
            matmuls: 4,
            dtype: DType::F32,
            transfer_bytes: 64 << 20,
            warmup: 3,
            iters: 20,
        }
    }
}

/// What the overlap benchmark measured (median milliseconds per step).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OverlapReport {
    /// The device.
    pub device: String,
    /// The matmuls alone.
    pub compute_ms: f64,
    /// The copy alone.
    pub transfer_ms: f64,
    /// Both, the copy on the copy stream beside the matmuls.
    pub overlapped_ms: f64,
    /// `(compute + transfer - overlapped) / min(compute, transfer)`.
    pub efficiency: f64,
    /// Host-to-device bandwidth of the transfer alone, GB/s.
    pub transfer_gbps: f64,
    /// Matmul side.
    pub matmul_size: usize,
    /// Matmuls per step.
    pub matmuls: usize,
    /// Matmul dtype.
    pub dtype: String,
    /// Bytes copied per step.
    pub transfer_bytes: usize,
    /// Timed steps.
    pub iters: usize,
}

impl OverlapReport {
    /// Efficiency from the three median times (0 when either part took no time).
    pub fn efficiency_of(compute_ms: f64, transfer_ms: f64, overlapped_ms: f64) -> f64 {
        let shorter = compute_ms.min(transfer_ms);
        if shorter > 0.0 {
            (compute_ms + transfer_ms - overlapped_ms) / shorter
        } else {
            0.0
        }
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => 0.5 * (v[n / 2 - 1] + v[n / 2]),
    }
}

/// Run the three measurements on `device` (a CUDA device: on the CPU there is no transfer to hide).
pub fn measure_overlap(device: Device, cfg: &OverlapConfig) -> Result<OverlapReport> {
    let Device::Cuda(ordinal) = device else {
        return Err(Error::InvalidArgument(
            "measure_overlap needs a CUDA device: on the CPU there is no host-to-device copy to overlap".into(),
        ));
    };
    if cfg.iters == 0 || cfg.matmuls == 0 || cfg.matmul_size == 0 || cfg.transfer_bytes < 4 {
        return Err(Error::InvalidArgument(format!("measure_overlap: empty workload {cfg:?}")));
    }
    let dev = CudaDevice::get(ordinal)?;
    let mut rng = Rng::new(0);
    let n = cfg.matmul_size;
    let a = Tensor::randn_with(&mut rng, 0.0, 1.0, (n, n), cfg.dtype, device)?;
    let b = Tensor::randn_with(&mut rng, 0.0, 1.0, (n, n), cfg.dtype, device)?;
    let host = Tensor::zeros(cfg.transfer_bytes / 4, DType::F32, Device::Cpu)?.pin_memory()?;

    let compute = || -> Result<()> {
        for _ in 0..cfg.matmuls {
            a.matmul(&b)?;
        }
        Ok(())
    };
    let transfer = || host.to_device(device);
    let timer = GpuTimer::new()?;
    let time = |f: &dyn Fn() -> Result<()>| -> Result<f64> {
        for _ in 0..cfg.warmup {
            f()?;
        }
        dev.synchronize()?;
        let mut ms = Vec::with_capacity(cfg.iters);
        for _ in 0..cfg.iters {
            timer.start(&dev)?;
            f()?;
            ms.push(timer.stop(&dev)?);
        }
        Ok(median(ms))
    };
    let compute_ms = time(&|| compute())?;
    let transfer_ms = time(&|| transfer().map(drop))?;
    // The loader's order: the next batch's copy is issued, then the step.
    let overlapped_ms = time(&|| {
        let next = host.to_device_async(device)?;
        compute()?;
        next.wait().map(drop)
    })?;
    dev.synchronize()?;
    Ok(OverlapReport {
        device: format!("{device} ({})", dev.info.name),
        compute_ms,
        transfer_ms,
        overlapped_ms,
        efficiency: OverlapReport::efficiency_of(compute_ms, transfer_ms, overlapped_ms),
        transfer_gbps: if transfer_ms > 0.0 { (host.elem_count() * 4) as f64 / (transfer_ms * 1e6) } else { 0.0 },
        matmul_size: n,
        matmuls: cfg.matmuls,
        dtype: cfg.dtype.to_string(),
        transfer_bytes: host.elem_count() * 4,
        iters: cfg.iters,
    })
}
