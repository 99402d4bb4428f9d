//! The kernel modules a Mamba training run loads on a GPU, compiled all at once when the run starts
//! (`MambaRun::new`, a warm start: `CudaDevice::warm`). Before, each compiled when its first
//! kernel launched, one after another on the training thread: on a cold kernel cache the default
//! `mamba train` started its first step after 28 s on an H100 (16 modules of NVRTC in a row). A
//! module left out of this list still compiles when first used; the CUDA test `mamba_modules`
//! fails when a run loads one.

use super::train::MambaTrainConfig;
use crate::gpt::kernels::LM_MODULES;
use ferrograd_core::cuda::modules::{Module, UNARY};
use ferrograd_core::fused::{conv1d_causal, selective_scan};
use ferrograd_core::{DType, Result};

/// The modules a run of `cfg` loads on a GPU.
pub fn modules(cfg: &MambaTrainConfig) -> Result<Vec<&'static Module>> {
    // A language model's (`gpt::kernels::LM_MODULES`), then SiLU and softplus (unary), the causal
    // convolution and the scan, which runs in f32 under either precision.
    let mut v: Vec<&'static Module> = LM_MODULES.to_vec();
    v.extend([&UNARY, &conv1d_causal::MODULE]);
    v.extend(selective_scan::training_modules(DType::F32, cfg.context)?);
    Ok(v)
}
