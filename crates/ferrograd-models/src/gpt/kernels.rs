//! The kernel modules a GPT training run loads on a GPU, compiled all at once when the run starts
//! (`Run::new`, a warm start: `CudaDevice::warm`). Before, each compiled when its first kernel
//! launched, one after another on the training thread: on a cold kernel cache (a new machine or a
//! new ferrograd version) GPT-2 124M in bf16 started its first step after 14.7 s on an H100, 14
//! modules of NVRTC in a row. `gpt sample` warms its own (`sample_modules`): right after a
//! training run it compiled 4 more modules one after another (11.9 s for 32 tokens, 0.9 s once
//! cached). A module left out of these lists still compiles when first used; the CUDA test
//! `gpt_modules` fails when a run or a sample loads one.

use super::quant::Linears;
use super::settings::{Precision, TrainConfig};
use super::Gpt;
use ferrograd_core::cuda::modules::{
    Module, BINARY, BINARY_HALF, BINARY_REST, CAST, COPY, INDEX, OPTIM, REDUCE, RNG, UNARY,
};
use ferrograd_core::cuda::CudaDevice;
use ferrograd_core::fused::{
    add_layer_norm, attention, classifier, cross_entropy, fake_quantize, layer_norm, linear, softmax,
};
use ferrograd_core::{DType, Result};

/// What a language model's training run over token shards loads whatever its blocks are: the
/// weights drawn on the device, copies and autocast's casts, the embedding (index), the fused layer
/// norms and residual adds, the classifier and validation's cross entropy, sums and AdamW. Mamba's
/// run (`mamba::kernels`) adds its own to the same list.
pub const LM_MODULES: [&Module; 12] = [
    &RNG,
    &COPY,
    &CAST,
    &INDEX,
    &BINARY,
    &REDUCE,
    &OPTIM,
    &layer_norm::MODULE,
    &layer_norm::MODULE_BWD,
    &add_layer_norm::MODULE,
    &classifier::MODULE,
    &cross_entropy::MODULE,
];

/// The modules a run of `cfg` loads on `dev`.
pub fn modules(cfg: &TrainConfig, dev: &CudaDevice) -> Result<Vec<&'static Module>> {
    // The linear layers' activation gradients: f32 (the master weights' bias sums) and the
    // autocast dtype's.
    let mut v: Vec<&'static Module> = LM_MODULES.to_vec();
    v.push(&linear::LINEAR_F32);
    let dtype = match cfg.precision {
        Precision::Bf16 => DType::BF16,
        Precision::F32 => DType::F32,
    };
    if dtype == DType::BF16 {
        v.push(&linear::LINEAR_BF16);
    }
    if cfg.qat {
        v.push(&fake_quantize::MODULE);
    }
    v.extend(attention::call_modules(dev, cfg.context, cfg.model.head_dim(), dtype)?);
    Ok(v)
}

/// The modules `gpt sample` loads for `model` (`bf16`: its `--bf16` projections and autocast):
/// the prompt's forward and then one token at a time with the KV cache. Copies, the embedding
/// (index), adds and comparisons, GELU and the logits' scaling (unary), the layer norms, the
/// sampling softmax; attention's for the prompt (cuDNN's where it takes it) and for a single
/// query (ours); int8 projections (`--int8`, an int8 file) their quantize, dequantize, int8 GEMM
/// and rescale kernels.
pub fn sample_modules(model: &Gpt, dev: &CudaDevice, bf16: bool) -> Result<Vec<&'static Module>> {
    let config = &model.config;
    let dtype = if bf16 { DType::BF16 } else { DType::F32 };
    let mut v: Vec<&'static Module> = vec![
        &COPY,
        &INDEX,
        &BINARY,
        &BINARY_REST,
        &UNARY,
        &layer_norm::MODULE,
        &add_layer_norm::MODULE,
        &softmax::MODULE,
    ];
    if bf16 {
        v.extend([&CAST, &BINARY_HALF]);
    }
    if matches!(model.linears, Linears::Int8 { .. }) {
        v.push(&ferrograd_core::quant::MODULE);
    }
    let d = config.head_dim();
    v.extend(attention::call_modules(dev, 2, d, dtype)?);
    v.extend(attention::call_modules(dev, 1, d, dtype)?);
    Ok(v)
}
