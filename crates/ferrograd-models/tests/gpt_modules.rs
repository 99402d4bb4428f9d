//! The kernel modules a GPT training run loads on a GPU (steps, validation), and then sampling as
//! `gpt sample` does, are the ones `gpt::kernels` lists (`Run::new` and `gpt sample` warm them): a
//! module outside the lists compiles on the running thread, one after another, on a cold kernel
//! cache. Its own test binary, so that the device's loaded modules are this test's alone. Prints
//! one line and passes without a GPU.

mod common;

use common::gpu;
use ferrograd_core::cuda::CudaDevice;
use ferrograd_core::{DType, Device, Result};
use ferrograd_models::gpt::kernels;
use ferrograd_models::gpt::prepare::{prepare, PrepareConfig};
use ferrograd_models::gpt::quant::{self, QuantMode};
use ferrograd_models::gpt::sample::{generate, SampleConfig};
use ferrograd_models::gpt::train::{BatchSize, Precision, Run, TrainConfig};
use ferrograd_models::gpt::{Gpt, GptConfig};
use ferrograd_nn::amp::autocast;
use std::collections::BTreeSet;

#[test]
fn cuda_training_loads_only_the_modules_it_lists() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let Device::Cuda(o) = dev else { return Ok(()) };
    let cuda = CudaDevice::get(o)?;
    let dir = tempfile::tempdir()?;
    let text: String = (0..400).map(|i| format!("the king speaks of the sea {i}. ")).collect();
    let file = dir.path().join("text.txt");
    std::fs::write(&file, text)?;
    prepare(&[file], &dir.path().join("data"), &PrepareConfig { val_fraction: 0.1, shard_tokens: 1 << 20 }, &|_| {})?;
    // Head dim 32: the CUDA attention kernels run it (cuDNN too, where present, in bf16).
    let model =
        GptConfig { vocab_size: 50257, n_positions: 16, n_layer: 2, n_head: 2, n_embd: 64, layer_norm_epsilon: 1e-5 };
    let mut listed = BTreeSet::new();
    for precision in [Precision::Bf16, Precision::F32] {
        let cfg = TrainConfig {
            model,
            steps: 2,
            batch: BatchSize::Fixed(2),
            context: 16,
            precision,
            val_batches: 1,
            ..TrainConfig::gpu_defaults(dir.path().join("data"), dir.path().join(format!("out-{precision:?}")), dev)
        };
        let list = kernels::modules(&cfg, &cuda)?;
        listed.extend(list.iter().map(|m| m.name));
        let mut run = Run::new(cfg)?;
        for _ in 0..2 {
            run.train_step()?;
        }
        run.evaluate()?;
        // Loaded modules accumulate over the runs, so each is checked against every list so far.
        let loaded: BTreeSet<&str> = cuda.loaded_modules().into_iter().collect();
        let extra: Vec<&&str> = loaded.difference(&listed).collect();
        println!("{precision:?}: listed {:?}", list.iter().map(|m| m.name).collect::<Vec<_>>());
        assert!(extra.is_empty(), "{precision:?}: loaded {extra:?}, which gpt::kernels does not list");
    }
    // Sampling as `gpt sample` does it: in f32, with `--bf16` (projections cast, autocast), and
    // with `--int8` in both modes (quantized as on load, the float projections dropped).
    let cases = [(false, None), (true, None), (false, Some(QuantMode::W8A8)), (true, Some(QuantMode::W8A16))];
    for (bf16, int8) in cases {
        let mut m = Gpt::new(model, 3, dev)?;
        if let Some(mode) = int8 {
            quant::quantize(&mut m, mode)?;
            quant::drop_float_projections(&mut m)?;
        }
        if bf16 {
            m.cast_projections(DType::BF16)?;
        }
        let list = kernels::sample_modules(&m, &cuda, bf16)?;
        listed.extend(list.iter().map(|m| m.name));
        let _ac = if bf16 { Some(autocast(DType::BF16)?) } else { None };
        let cfg = SampleConfig {
            max_new_tokens: 4,
            temperature: 1.0,
            top_k: Some(5),
            seed: 1,
            stop_at_eot: false,
            graph: true,
        };
        generate(&m, &[5, 17, 3], &cfg, |_| Ok(()))?;
        let loaded: BTreeSet<&str> = cuda.loaded_modules().into_iter().collect();
        let extra: Vec<&&str> = loaded.difference(&listed).collect();
        println!("sample, bf16 {bf16}, int8 {int8:?}: listed {:?}", list.iter().map(|m| m.name).collect::<Vec<_>>());
        assert!(
            extra.is_empty(),
            "sample, bf16 {bf16}, int8 {int8:?}: loaded {extra:?}, which gpt::kernels does not list"
        );
    }
    Ok(())
}
