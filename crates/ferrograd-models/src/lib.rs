//! Models and workloads built on ferrograd. `monster_walk` is the first end-to-end workload
//! (see `docs/monster-walk.md`); `gpt` is GPT-2 trained on real text.

pub mod gpt;
pub mod mamba;
pub mod monster_walk;
pub mod persistent;

use ferrograd_core::cuda::modules::Module;

/// The models' own kernel sources as shipped (the core's are `ferrograd_core::cuda::modules::ALL`):
/// what the compile test walks. The persistent kernel's general modules are compiled there but
/// never launched: a launch uses a module specialized to its layout (see [`modules`]).
pub const MODULES: &[&Module] = &[
    &monster_walk::fused::MODULE,
    persistent::trainer::MODULES[0],
    persistent::trainer::MODULES[1],
    persistent::trainer::MODULES[2],
];

/// What `ferrograd kernels --precompile` compiles beside the core's modules: Monster Walk's fused
/// step, and its persistent kernel specialized for a GPU of
/// [`monster_walk::persistent::PRECOMPILE_SMS`] SMs (each precision): the modules the default
/// `ferrograd monster-walk` launches on an H100 or H200.
pub fn modules() -> ferrograd_core::Result<Vec<&'static Module>> {
    let mut all = vec![&monster_walk::fused::MODULE];
    all.extend(monster_walk::persistent::modules_for(monster_walk::persistent::PRECOMPILE_SMS)?);
    Ok(all)
}
