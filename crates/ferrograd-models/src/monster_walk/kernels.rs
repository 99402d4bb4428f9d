//! The kernel modules a Monster Walk run launches on a GPU. `train::run` starts compiling them all
//! at once before it draws the weights and builds the data (a warm start, `CudaDevice::warm`: on a
//! cold kernel cache the run waits about as long as its longest module, not their sum) and loads
//! them before the timed loop, so that the loop measures training only.
//!
//! Why a list: until 2026-11-24 the run loaded every module of the library instead, one after
//! another, to keep compiles out of the timed loop. On a cold cache (a new machine or a new
//! ferrograd version) that was ~50 modules of NVRTC on one thread, most of them kernels Monster
//! Walk never launches (attention, the selective scan, layer norms, ...), before the first step of
//! the README's first command. The CUDA test `monster_walk_modules` runs each step and fails if a
//! run loads a module this list leaves out.

use super::persistent::spec;
use super::train::TrainConfig;
use super::walk::SAMPLES;
use crate::persistent::trainer::module_on;
use ferrograd_core::cuda::modules::{Module, BINARY, BINARY_REST, CAST, COPY, OPTIM, REDUCE, RNG, UNARY};
use ferrograd_core::cuda::CudaDevice;
use ferrograd_core::fused::{linear, mse_loss};
use ferrograd_core::Result;

/// The modules a run of `cfg` launches on `dev`.
pub fn modules(cfg: &TrainConfig, dev: &CudaDevice) -> Result<Vec<&'static Module>> {
    // Every step: the weights drawn on the device (rng), a copy's representations (data.rs:
    // remainder and divisions in f32, the one-hot comparison in binary_rest, casts, affine / cos /
    // sin, stack), fills and copies of parameters and snapshots.
    let mut v: Vec<&'static Module> = vec![&RNG, &COPY, &CAST, &UNARY, &BINARY, &BINARY_REST];
    if cfg.fused {
        // The fused step: its own module (also what the persistent kernel falls back to, and the
        // data-parallel step).
        v.push(&super::fused::MODULE);
        if cfg.persistent && cfg.dist.is_none() && !cfg.skip_nonfinite {
            v.push(module_on(&spec()?, dev, cfg.batch.min(SAMPLES), cfg.precision));
        }
    } else {
        // The autograd step: Linear's ReLU gradients (linear's f32 part), the loss, the backward's
        // sums, Adam.
        v.extend([&linear::LINEAR_F32, &mse_loss::MODULE, &REDUCE, &OPTIM]);
    }
    Ok(v)
}
