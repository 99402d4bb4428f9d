//! ferrograd-core: tensors with reverse-mode autograd over a CPU backend (rayon + `gemm`) and a
//! CUDA backend that is loaded at run time, so one binary runs with or without a GPU.
//!
//! ```
//! use ferrograd_core::{DType, Device, Tensor};
//! let x = Tensor::randn(0.0, 1.0, (4, 3), DType::F64, Device::Cpu)?.requires_grad();
//! let loss = x.sqr()?.sum_all()?;
//! let grads = loss.backward()?;
//! let gx = grads.get(&x).unwrap().to_vec::<f64>()?;
//! let want: Vec<f64> = x.to_vec::<f64>()?.iter().map(|v| 2.0 * v).collect();
//! assert_eq!(gx, want);
//! # Ok::<(), ferrograd_core::Error>(())
//! ```

#![warn(missing_docs)]

pub mod backend;
pub mod backprop;
mod compressed;
pub mod cpu;
pub mod cuda;
pub mod device;
pub mod dtype;
pub mod error;
pub mod fused;
pub mod host;
mod host_pinned;
pub mod io;
pub mod layout;
mod narrow_grads;
mod nn_ops;
pub mod op;
mod ops;
pub mod optim;
pub mod quant;
pub mod rng;
pub mod shape;
pub mod storage;
mod tensor;
mod transfer;
mod unified;
mod views;

pub use backprop::{is_grad_enabled, no_grad, with_no_grad, GradStore, NoGradGuard};
pub use compressed::CompressionRule;
pub use cuda::memory_status;
pub use device::Device;
pub use dtype::{DType, WithDType};
pub use error::{Error, Result};
pub use fused::attention::AttentionOpts;
pub use fused::fake_quantize::FakeQuant;
pub use half::{bf16, f16};
pub use host_pinned::HostCopy;
pub use layout::Layout;
pub use rng::{manual_seed, Rng};
pub use shape::{AllDims, Dim, Dims, Shape};
pub use tensor::{Tensor, TensorId};
pub use transfer::Prefetch;
