//! The kernel modules a Mamba training run loads on a GPU (steps, validation, the checkpoint) are
//! the ones `mamba::kernels` lists, which `MambaRun::new` warms at the start. Its own test binary,
//! so that the device's loaded modules are this test's alone. Prints one line and passes without
//! a GPU.

use ferrograd_core::cuda::CudaDevice;
use ferrograd_core::{Device, Result};
use ferrograd_models::gpt::shards::write_shard;
use ferrograd_models::gpt::train::Precision;
use ferrograd_models::mamba::train::{train, MambaTrainConfig};
use ferrograd_models::mamba::{kernels, MambaLmConfig};
use std::collections::BTreeSet;
use std::time::Instant;

#[test]
fn cuda_training_loads_only_the_modules_it_lists() -> Result<()> {
    let cuda = match CudaDevice::get(0) {
        Ok(d) => d,
        Err(e) => {
            println!("skipping CUDA test: {e}");
            return Ok(());
        }
    };
    let data = tempfile::tempdir()?;
    let toks: Vec<u16> = (0..20_000u32).map(|i| ((i * 7 + i / 13) % 40) as u16).collect();
    write_shard(&data.path().join("train_000000.bin"), &toks)?;
    write_shard(&data.path().join("val_000000.bin"), &toks[..4_000])?;
    let mut listed = BTreeSet::new();
    // Contexts on both sides of the backward scan's short / long chunks (256 steps).
    for (precision, context) in [(Precision::Bf16, 64), (Precision::F32, 300)] {
        let out = tempfile::tempdir()?;
        let mut cfg = MambaTrainConfig::defaults(data.path().to_path_buf(), out.path().to_path_buf(), Device::Cuda(0));
        cfg.model = MambaLmConfig { vocab_size: 40, d_model: 32, n_layer: 2, d_state: 8, ..MambaLmConfig::small() };
        cfg.steps = 2;
        cfg.batch = 2;
        cfg.context = context;
        cfg.val_every = 0;
        cfg.val_batches = 1;
        cfg.precision = precision;
        let list = kernels::modules(&cfg)?;
        listed.extend(list.iter().map(|m| m.name));
        train(cfg, Instant::now(), |_| {})?;
        // Loaded modules accumulate over the runs, so each is checked against every list so far.
        let loaded: BTreeSet<&str> = cuda.loaded_modules().into_iter().collect();
        let extra: Vec<&&str> = loaded.difference(&listed).collect();
        println!("{precision:?}, context {context}: listed {:?}", list.iter().map(|m| m.name).collect::<Vec<_>>());
        assert!(extra.is_empty(), "{precision:?}: loaded {extra:?}, which mamba::kernels does not list");
    }
    Ok(())
}
