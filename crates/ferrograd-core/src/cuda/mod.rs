//! The CUDA backend. Everything here loads the driver libraries at run time (cudarc's dynamic
//! loading), so a machine without CUDA builds and runs the same binary; each entry point checks
//! that the library exists first because cudarc panics on a missing one.

#[cfg(test)]
mod abi;
pub mod alloc;
pub mod blaslt;
pub(crate) mod buffer;
mod cooperative;
pub mod device;
mod driver;
pub(crate) mod error_flag;
pub mod event;
pub mod file_read;
pub mod file_write;
pub mod graph;
mod interop;
pub mod klayout;
pub mod launch;
pub mod managed;
mod matmul;
pub mod memory;
pub mod modules;
pub mod nvrtc;
pub mod nvtx;
pub(crate) mod ops;
pub mod peer;
pub mod pinned;
pub mod predictor;
pub mod probe;
pub mod profile;
pub mod shadow;
pub mod startup;
pub mod storage;
pub mod stream;
pub mod sync;
mod timer;
pub mod tma;
pub mod transfer;

pub use buffer::set_poison_allocations;
pub use cooperative::MappedF32;
pub use device::CudaDevice;
pub use event::Event;
pub use graph::{Capture, Graph};
pub use matmul::{matmul_precision, set_matmul_precision, MatmulPrecision};
pub use memory::{memory_status, DeviceMemoryStatus};
pub use predictor::{PredictMode, Predictor};
pub use probe::{device_count, devices, CudaDeviceInfo};
pub use shadow::ShadowSet;
pub use storage::CudaStorage;
pub use stream::{Stream, StreamGuard};
pub use sync::{is_capturing, sync_call_count, SyncCounter};
pub use timer::GpuTimer;
