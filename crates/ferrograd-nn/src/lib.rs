//! ferrograd-nn: everything a training loop needs on top of `ferrograd-core`.
//!
//! - [`Module`] and the layers ([`Linear`], [`Embedding`], [`LayerNorm`], [`Dropout`],
//!   [`Sequential`], activations, [`mlp`]) with PyTorch's parameter names and initialisations;
//! - [`optim`]: SGD, Adam and AdamW over core's fused multi-tensor steps, gradient accumulation,
//!   clipping by global norm, learning-rate schedules;
//! - [`amp`]: an autocast scope and a dynamic loss scaler;
//! - [`checkpoint`]: atomic safetensors checkpoints that resume bit-identically;
//! - [`data`]: datasets, a prefetching loader, and the transfer/compute overlap benchmark;
//! - [`trainer`]: a training-loop helper with a progress bar and a JSON-lines log.
//!
//! ```
//! use ferrograd_core::{DType, Device, Rng, Tensor};
//! use ferrograd_nn::{mlp, Activation, Module};
//! use ferrograd_nn::optim::{Adam, Optimizer};
//! let mut rng = Rng::new(0);
//! let model = mlp(&[2, 8, 1], Activation::Tanh, &mut rng)?;
//! let mut opt = Adam::new(model.named_parameters(), Default::default())?;
//! let x = Tensor::randn_with(&mut rng, 0.0, 1.0, (4, 2), DType::F32, Device::Cpu)?;
//! let loss = model.forward(&x)?.sqr()?.mean_all()?;
//! opt.step(&loss.backward()?)?;
//! # Ok::<(), ferrograd_core::Error>(())
//! ```

#![warn(missing_docs)]

pub mod amp;
pub mod checkpoint;
pub mod data;
pub mod init;
pub mod layers;
pub mod module;
pub mod optim;
pub mod quant;
pub mod rng;
pub mod trainer;

pub use layers::{
    mlp, mlp_on, Activation, Dropout, Embedding, Gelu, LayerNorm, Linear, LinearActivation, Mamba, MambaConfig,
    MambaState, Relu, Sequential, Sigmoid, Silu, Tanh,
};
pub use module::Module;
pub use rng::SharedRng;
