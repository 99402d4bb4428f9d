//! The kernel modules a Mamba training run loads on a GPU, compiled all at once when the run starts
//! (`MambaRun::new`, a warm start: `CudaDevice::warm`). Before, each compiled when its first
//! kernel launched, one after another on the training thread: on a cold kernel cache the default
//! `mamba train` started its first step after 28 s on an H100 (16 modules of NVRTC in a row). A
//! module left out of this list still compiles when first used; the CUDA test `mamba_modules`
//! fails when a run loads one.

use super::train::MambaTrainConfig;
use ferrograd_core::cuda::modules::{Module, BINARY, CAST, COPY, INDEX, OPTIM, REDUCE, RNG, UNARY};
use ferrograd_core::fused::{add_layer_norm, classifier, conv1d_causal, cross_entropy, layer_norm, selective_scan};
use ferrograd_core::{DType, Result};

/// The modules a run of `cfg` loads on a GPU.
pub fn modules(cfg: &MambaTrainConfig) -> Result<Vec<&'static Module>> {
    // The weights drawn on the device, the embedding (index), the fused norms and residual adds,
    // the classifier and validation's cross entropy, SiLU and softplus (unary), sums and AdamW,
    // the causal convolution; the scan runs in f32 under either precision.
    let mut v: Vec<&'static Module> = vec![
        &RNG,
        &COPY,
        &CAST,
        &UNARY,
        &INDEX,
        &BINARY,
        &REDUCE,
        &OPTIM,
        &layer_norm::MODULE,
        &layer_norm::MODULE_BWD,
        &add_layer_norm::MODULE,
        &classifier::MODULE,
        &cross_entropy::MODULE,
        &conv1d_causal::MODULE,
    ];
    v.extend(selective_scan::training_modules(DType::F32, cfg.context)?);
    Ok(v)
}
