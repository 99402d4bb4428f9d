//! The layers: each file holds one module and its PyTorch-compatible parameter names.

mod activation;
mod dropout;
mod embedding;
mod layer_norm;
mod linear;
mod mamba;
mod mlp;
mod sequential;

pub use activation::{Activation, Gelu, Relu, Sigmoid, Silu, Tanh};
pub use dropout::Dropout;
pub use embedding::Embedding;
pub use layer_norm::LayerNorm;
pub use linear::{Linear, LinearActivation};
pub use mamba::{Mamba, MambaConfig, MambaState};
pub use mlp::{mlp, mlp_on};
pub use sequential::Sequential;
