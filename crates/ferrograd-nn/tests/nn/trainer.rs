//! The training-loop helper: accumulation, logging cadence, the JSON-lines log, resuming.

use crate::common::*;
use ferrograd_core::{DType, Result, Rng, Tensor};
use ferrograd_nn::amp::{GradScaler, GradScalerConfig};
use ferrograd_nn::optim::{Optimizer, Sgd, SgdConfig};
use ferrograd_nn::trainer::{ProgressMode, Trainer, TrainerConfig};
use ferrograd_nn::*;

#[test]
fn json_log_has_one_line_per_logged_step() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let log = dir.path().join("train.jsonl");
    let model = mlp(&[2, 4, 1], Activation::Relu, &mut Rng::new(0))?;
    let opt = Sgd::new(model.named_parameters(), SgdConfig { lr: 0.05, momentum: 0.9, ..Default::default() })?;
    let cfg = TrainerConfig {
        max_steps: 10,
        log_every: 4,
        grad_accum: 3,
        clip_grad_norm: Some(1.0),
        progress: ProgressMode::Lines,
        json_log: Some(log.clone()),
        ..Default::default()
    };
    let mut t = Trainer::new(opt, cfg)?;
    let x = Tensor::randn_with(&mut Rng::new(1), 0.0, 1.0, (8, 2), DType::F32, CPU)?;
    let mut calls = 0;
    let mut logged = vec![];
    for _ in 0..10 {
        let out = t.train_step(|i| {
            calls += 1;
            let xs = x.narrow(0, 2 * i, 2)?;
            Ok((model.forward(&xs)?.sqr()?.mean_all()?, 2))
        })?;
        assert!(out.stepped && out.grad_norm.is_some());
        if let Some(l) = out.logged_loss {
            logged.push((out.step, l));
        }
    }
    assert_eq!(calls, 30, "three micro-batches per step");
    assert_eq!(logged.iter().map(|l| l.0).collect::<Vec<_>>(), [4, 8, 10], "every 4 steps and the last");
    let text = std::fs::read_to_string(&log)?;
    let lines: Vec<serde_json::Value> =
        text.lines().map(serde_json::from_str).collect::<std::result::Result<_, _>>()?;
    assert_eq!(lines.len(), 3);
    assert_eq!(lines[1]["step"], 8);
    assert!((lines[1]["loss"].as_f64().unwrap_or(f64::NAN) - logged[1].1).abs() < 1e-12);
    assert!(lines[0]["samples_per_sec"].as_f64().is_some() && lines[0]["lr"].as_f64() == Some(0.05));
    assert!(lines[0]["device_mem_bytes"].is_null(), "no device memory on the CPU");
    Ok(())
}

#[test]
fn trainer_state_round_trips_with_a_scaler() -> Result<()> {
    let model = mlp(&[2, 3, 1], Activation::Relu, &mut Rng::new(0))?;
    let opt = Sgd::new(model.named_parameters(), SgdConfig::default())?;
    let cfg = TrainerConfig { progress: ProgressMode::Quiet, ..Default::default() };
    let scaler = GradScaler::new(GradScalerConfig { init_scale: 8.0, ..Default::default() })?;
    let mut t = Trainer::new(opt, cfg.clone())?.with_scaler(scaler.clone());
    let x = Tensor::ones((2, 2), DType::F32, CPU)?;
    t.train_step(|_| Ok((model.forward(&x)?.sum_all()?, 2)))?;
    (t.epoch, t.next_batch) = (3, 7);
    let st = t.state();
    let opt2 = Sgd::new(model.named_parameters(), SgdConfig::default())?;
    let mut t2 = Trainer::new(opt2, cfg)?.with_scaler(scaler);
    t2.resume(&st)?;
    assert_eq!((t2.step, t2.epoch, t2.next_batch), (1, 3, 7));
    assert_eq!(t2.scaler.as_ref().map(|s| s.state()), t.scaler.as_ref().map(|s| s.state()));
    assert_eq!(t.optimizer.step_count(), 1);
    Ok(())
}
