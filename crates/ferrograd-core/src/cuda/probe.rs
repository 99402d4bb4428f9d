//! Find CUDA devices without creating a context: name, memory, compute capability.

use crate::{Error, Result};
use cudarc::driver::{result, sys};

/// What the driver reports about one GPU, read without creating a context.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaDeviceInfo {
    /// Device ordinal.
    pub ordinal: usize,
    /// Marketing name (`NVIDIA H100 80GB HBM3`).
    pub name: String,
    /// Bytes of device memory.
    pub total_memory: usize,
    /// `(major, minor)`: (9, 0) on Hopper.
    pub compute_capability: (i32, i32),
    /// Streaming multiprocessors.
    pub multiprocessors: i32,
}

fn driver_err(what: &str, e: result::DriverError) -> Error {
    Error::Cuda(format!("{what}: {e:?}"))
}

/// Load and initialise the driver, or say why not.
pub fn init_driver() -> Result<()> {
    // SAFETY: only probes whether the shared library can be opened.
    if !unsafe { sys::is_culib_present() } {
        return Err(Error::CudaUnavailable {
            reason: "libcuda.so (the NVIDIA driver library) was not found on this machine".into(),
        });
    }
    result::init().map_err(|e| match e.0 {
        sys::CUresult::CUDA_ERROR_NO_DEVICE => {
            Error::CudaUnavailable { reason: "the driver reports no CUDA device".into() }
        }
        _ => Error::CudaUnavailable { reason: format!("the CUDA driver failed to initialise: {e:?}") },
    })
}

/// How many CUDA devices are visible; an error when the driver cannot be loaded.
pub fn device_count() -> Result<usize> {
    init_driver()?;
    let n = result::device::get_count().map_err(|e| driver_err("cuDeviceGetCount", e))?;
    Ok(n.max(0) as usize)
}

/// Every visible device's info.
pub fn devices() -> Result<Vec<CudaDeviceInfo>> {
    let n = device_count()?;
    (0..n).map(device_info).collect()
}

/// One device's info.
pub fn device_info(ordinal: usize) -> Result<CudaDeviceInfo> {
    let n = device_count()?;
    if ordinal >= n {
        return Err(Error::CudaDeviceNotFound { ordinal, visible: n });
    }
    let dev = result::device::get(ordinal as i32).map_err(|e| driver_err("cuDeviceGet", e))?;
    let attr = |a| unsafe { result::device::get_attribute(dev, a) }.map_err(|e| driver_err("cuDeviceGetAttribute", e));
    use sys::CUdevice_attribute as A;
    Ok(CudaDeviceInfo {
        ordinal,
        name: result::device::get_name(dev).map_err(|e| driver_err("cuDeviceGetName", e))?,
        // SAFETY: `dev` came from cuDeviceGet.
        total_memory: unsafe { result::device::total_mem(dev) }.map_err(|e| driver_err("cuDeviceTotalMem", e))?,
        compute_capability: (
            attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        ),
        multiprocessors: attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probing_never_panics() {
        match devices() {
            Ok(d) => println!("{} CUDA device(s): {d:?}", d.len()),
            Err(e) => println!("no CUDA: {e}"),
        }
        let e = device_info(99).unwrap_err();
        assert!(matches!(e, Error::CudaDeviceNotFound { ordinal: 99, .. } | Error::CudaUnavailable { .. }), "{e}");
    }
}
