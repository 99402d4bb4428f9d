//! The Mamba language model (`ferrograd_models::mamba`): its loss falls when `mamba train` runs on
//! generated token shards on the CPU (and on CUDA, as a replayed graph, where there is a GPU); the
//! recurrent decode equals the full forward's logits position by position (f64); mamba_ssm's names.

use ferrograd_core::{DType, Device, Result, Tensor};
use ferrograd_models::gpt::shards::write_shard;
use ferrograd_models::gpt::train::Precision;
use ferrograd_models::mamba::train::{train, MambaTrainConfig};
use ferrograd_models::mamba::{MambaLm, MambaLmConfig};
use ferrograd_nn::Module;
use std::path::Path;
use std::time::Instant;

fn tiny() -> MambaLmConfig {
    MambaLmConfig { vocab_size: 40, d_model: 32, n_layer: 2, d_state: 8, ..MambaLmConfig::small() }
}

/// Shards of a generated language: runs of a token repeated then counting up mod 40, with a
/// pseudo-random start per run, so the next token is predictable from the recent past.
fn shards(dir: &Path) -> Result<()> {
    let mut toks = Vec::new();
    let mut s = 12345u64;
    while toks.len() < 40_000 {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let start = (s >> 33) % 40;
        for i in 0..16 {
            toks.push(((start + i / 2) % 40) as u16);
        }
    }
    write_shard(&dir.join("train_000000.bin"), &toks)?;
    write_shard(&dir.join("val_000000.bin"), &toks[..8_000])
}

fn run_training(device: Device, graph: bool) -> Result<(f64, f64, f64)> {
    let data = tempfile::tempdir().expect("tempdir");
    shards(data.path())?;
    let out = tempfile::tempdir().expect("tempdir");
    let mut cfg = MambaTrainConfig::defaults(data.path().to_path_buf(), out.path().to_path_buf(), device);
    cfg.model = tiny();
    cfg.steps = 60;
    cfg.batch = 4;
    cfg.context = 32;
    cfg.lr = 3e-3;
    cfg.warmup = Some(5);
    cfg.log_every = 5;
    cfg.val_every = 0;
    cfg.val_batches = 2;
    cfg.precision = Precision::F32;
    cfg.graph = graph;
    let mut first_logged = None;
    let s = train(cfg, Instant::now(), |e| {
        if let ferrograd_models::gpt::train::Event::Logged(st) = e {
            first_logged.get_or_insert(st.loss);
        }
    })?;
    assert!(out.path().join("checkpoint.safetensors").is_file() && out.path().join("log.jsonl").is_file());
    let (first, last) = (s.first_loss.expect("first"), s.final_loss.expect("last"));
    assert_eq!(Some(first), first_logged);
    Ok((first, last, s.final_val_loss.expect("val")))
}

#[test]
fn loss_falls_on_generated_data_cpu() -> Result<()> {
    let (first, last, val) = run_training(Device::Cpu, false)?;
    // Uniform over 40 tokens is ln 40 = 3.69.
    assert!(first > 3.0, "first loss {first}");
    assert!(last < first - 1.0 && val < first - 1.0, "loss {first} -> {last} (val {val})");
    Ok(())
}

#[test]
fn loss_falls_on_generated_data_cuda_graph() -> Result<()> {
    if ferrograd_core::cuda::CudaDevice::get(0).is_err() {
        println!("skipping CUDA test: no GPU");
        return Ok(());
    }
    ferrograd_core::cuda::set_poison_allocations(true);
    let (first, last, val) = run_training(Device::Cuda(0), true)?;
    assert!(last < first - 1.0 && val < first - 1.0, "loss {first} -> {last} (val {val})");
    Ok(())
}

#[test]
fn step_decode_equals_full_logits_f64() -> Result<()> {
    let m = MambaLm::new(tiny(), 3, Device::Cpu)?.to_dtype(DType::F64)?;
    let ids: Vec<u32> = vec![1, 7, 7, 30, 2, 39, 0, 11, 5, 5, 17];
    let t = ids.len();
    let x = Tensor::from_vec(ids.iter().chain(&ids).copied().collect::<Vec<u32>>(), (2, t), Device::Cpu)?;
    let full = m.hidden(&x)?;
    let full = ferrograd_models::gpt::ops::lm_logits(&full, &m.embedding, 40)?.reshape((2, t, 40))?;
    assert_eq!(full.dtype(), DType::F64);
    let mut st = m.zero_state(2)?;
    for (i, &id) in ids.iter().enumerate() {
        let step = m.step(&Tensor::from_vec(vec![id, id], 2, Device::Cpu)?, &mut st)?;
        assert_eq!(step.dims(), [2, 40]);
        let want = full.narrow(1, i, 1)?.squeeze(1)?.to_f64_vec()?;
        let got = step.to_f64_vec()?;
        let err = got.iter().zip(&want).fold(0.0f64, |a, (g, w)| a.max((g - w).abs()));
        assert!(err < 1e-10, "position {i}: err {err:e}");
    }
    Ok(())
}

#[test]
fn names_follow_mamba_ssm() -> Result<()> {
    let m = MambaLm::new(tiny(), 0, Device::Cpu)?;
    let names: Vec<String> = m.named_parameters().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names[0], "backbone.embedding.weight");
    assert!(names.contains(&"backbone.layers.1.mixer.A_log".to_string()));
    assert!(names.contains(&"backbone.layers.0.norm.weight".to_string()));
    assert_eq!(names.last().map(String::as_str), Some("backbone.norm_f.bias"));
    assert_eq!(m.num_parameters(), tiny().num_parameters());
    Ok(())
}
