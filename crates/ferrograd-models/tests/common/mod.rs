//! What the model tests share (`tests/models_suite/main.rs` and each `tests/*.rs` that needs it
//! include it with `mod common;`).
#![allow(dead_code)] // each test crate uses a different part

use ferrograd_core::Device;

/// CUDA device 0, or `None` with a one-line reason where no GPU is usable (the CUDA tests then pass).
pub fn gpu() -> Option<Device> {
    match ferrograd_core::cuda::CudaDevice::get(0) {
        Ok(_) => Some(Device::Cuda(0)),
        Err(e) => {
            println!("skipping CUDA test: {e}");
            None
        }
    }
}

/// [`gpu`] with every device allocation poisoned (NaN bytes), so a test fails on any output
/// element a kernel did not write.
pub fn gpu_poisoned() -> Option<Device> {
    let dev = gpu()?;
    ferrograd_core::cuda::set_poison_allocations(true);
    Some(dev)
}
