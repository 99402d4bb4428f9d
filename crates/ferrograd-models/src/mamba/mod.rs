//! A small Mamba language model (mamba_ssm's `MambaLMHeadModel`: embedding, residual Mamba
//! blocks with pre-norm, final norm, head tied to the embedding), trained by `ferrograd mamba
//! train` on the same token shards as `gpt train` (issue 19).
//!
//! - `kernels`: the kernel modules a GPU run loads (compiled at once at its start).
//! - `model`: the model, its config, its recurrent decode ([`MambaLm::step`]).
//! - `train`: the run (GPT's loader, AdamW, log records and events; the step captured as a CUDA
//!   graph on a GPU).

pub mod kernels;
pub mod model;
pub mod train;

pub use model::{MambaLm, MambaLmConfig, MambaLmState};
