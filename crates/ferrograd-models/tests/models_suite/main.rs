//! ferrograd-models' integration tests, one binary (one link) with a module per file. The
//! `*_modules` tests stay binaries of their own in `tests/`: each checks the modules a run loads,
//! which must be that test's alone.

#[path = "../common/mod.rs"]
mod common;

mod gpt;
mod gpt_quant;
mod kernels_compile;
mod mamba;
mod monster_walk;
mod monster_walk_graph;
mod persistent_mlp;
mod robust;
