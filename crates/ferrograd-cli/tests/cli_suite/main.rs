//! ferrograd-cli's integration tests, one binary (one link) with a module per file: most run the
//! `ferrograd` binary as a user would; `dist_gpu` and `pipeline_gpu` need two GPUs and skip
//! without them.

#[path = "../common/mod.rs"]
mod common;

mod args;
mod cli;
mod dist_gpu;
mod gpt;
mod gpt_dp;
mod gpt_quant;
mod gpt_zero;
mod launch;
mod pipeline_gpu;
mod prebuilt;
mod robust;
