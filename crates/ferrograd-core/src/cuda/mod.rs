//! The CUDA side. Everything here loads the driver libraries at run time (cudarc's dynamic
//! loading), so a machine without CUDA builds and runs the same binary; each entry point checks
//! that the library exists first because cudarc panics on a missing one.

pub mod probe;

pub use probe::{device_count, devices, CudaDeviceInfo};
