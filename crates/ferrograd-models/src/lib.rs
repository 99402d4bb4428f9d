//! Models and workloads built on ferrograd. `monster_walk` is the first end-to-end workload
//! (see `docs/monster-walk.md`); `gpt` is GPT-2 trained on real text.

pub mod gpt;
pub mod mamba;
pub mod monster_walk;
pub mod persistent;

use ferrograd_core::cuda::modules::Module;

/// The models' own kernel modules (the core's are `ferrograd_core::cuda::modules::ALL`): what
/// `ferrograd kernels --precompile` compiles beside the core's and the compile test walks.
pub const MODULES: &[&Module] = &[
    &monster_walk::fused::MODULE,
    persistent::trainer::MODULES[0],
    persistent::trainer::MODULES[1],
    persistent::trainer::MODULES[2],
];
