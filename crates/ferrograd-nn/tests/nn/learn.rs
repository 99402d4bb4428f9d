//! Small models learn: XOR and a synthetic regression.

use crate::common::*;
use ferrograd_core::{Device, Result, Rng, Tensor};
use ferrograd_nn::data::{DataLoader, LoaderConfig, TensorDataset};
use ferrograd_nn::optim::{Adam, AdamConfig, Optimizer};
use ferrograd_nn::trainer::{ProgressMode, Trainer, TrainerConfig};
use ferrograd_nn::*;
use std::sync::Arc;

/// Train XOR with Adam; returns (first loss, last loss, predictions).
pub fn xor(device: Device) -> Result<(f64, f64, Vec<f32>)> {
    let mut rng = Rng::new(42);
    let model = mlp_on(&[2, 8, 1], Activation::Tanh, &mut rng, device)?;
    let x = Tensor::from_vec(vec![0f32, 0., 0., 1., 1., 0., 1., 1.], (4, 2), device)?;
    let y = Tensor::from_vec(vec![0f32, 1., 1., 0.], (4, 1), device)?;
    let mut opt = Adam::new(model.named_parameters(), AdamConfig { lr: 0.05, ..Default::default() })?;
    let mut first = None;
    for _ in 0..300 {
        let loss = model.forward(&x)?.mse_loss(&y)?;
        first.get_or_insert(loss.item_f64()?);
        opt.step(&loss.backward()?)?;
    }
    let last = model.forward(&x)?.mse_loss(&y)?.item_f64()?;
    Ok((first.unwrap_or(f64::NAN), last, vec_f32(&model.forward(&x)?)))
}

pub fn check_xor(device: Device) -> Result<()> {
    let (first, last, pred) = xor(device)?;
    eprintln!("xor on {device}: loss {first:.4} -> {last:.2e}, predictions {pred:?}");
    assert!(last < 1e-2, "xor loss {last}");
    for (p, want) in pred.iter().zip([0.0, 1.0, 1.0, 0.0]) {
        assert!((p - want).abs() < 0.25, "xor prediction {p} for {want}");
    }
    Ok(())
}

#[test]
fn mlp_learns_xor() -> Result<()> {
    check_xor(CPU)
}

/// Regression through the full stack: loader (shuffled mini-batches), Trainer, AdamW, schedule.
pub fn regression(device: Device) -> Result<(f64, f64)> {
    let (x, y) = regression_data(256, 4, 1)?;
    let ds = Arc::new(TensorDataset::new(vec![x.clone(), y.clone()])?);
    let loader = DataLoader::new(ds, LoaderConfig { batch_size: 32, seed: 1, device, ..Default::default() })?;
    let model = mlp_on(&[4, 32, 32, 1], Activation::Silu, &mut Rng::new(8), device)?;
    let opt = optim::adamw(model.named_parameters(), 1e-2, 1e-4)?;
    let cfg = TrainerConfig {
        max_steps: 400,
        log_every: 50,
        schedule: Some(optim::LrSchedule::WarmupCosine { peak: 1e-2, warmup: 20, total: 400, min: 1e-4 }),
        progress: ProgressMode::Quiet,
        ..Default::default()
    };
    let mut t = Trainer::new(opt, cfg)?;
    let (xd, yd) = (x.to_device(device)?, y.to_device(device)?);
    let before = model.forward(&xd)?.mse_loss(&yd)?.item_f64()?;
    let summary = t.fit(&loader, |b| model.forward(&b.tensors[0])?.mse_loss(&b.tensors[1]))?;
    assert_eq!(summary.steps, 400);
    assert_eq!(summary.losses.len(), 8);
    assert_eq!(t.optimizer.step_count(), 400);
    let after = model.forward(&xd)?.mse_loss(&yd)?.item_f64()?;
    Ok((before, after))
}

#[test]
fn mlp_learns_a_synthetic_regression() -> Result<()> {
    let (before, after) = regression(CPU)?;
    eprintln!("regression: mse {before:.4} -> {after:.2e} ({:.0}x)", before / after);
    assert!(before / after > 50.0, "mse {before} -> {after}");
    Ok(())
}
