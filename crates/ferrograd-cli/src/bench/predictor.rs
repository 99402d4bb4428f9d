//! `ferrograd bench predictor`: the latency of one inference call of a small policy network (a
//! 3-layer MLP, width 512, ReLU) through `ferrograd_core::cuda::Predictor`, at batch 1 and 32,
//! eager and replayed as a CUDA graph. One call is what a served request pays: the input from a
//! pinned host buffer to the device, the forward, the output back, one synchronize. Reported: p50
//! and p99 of the per-call host wall time over `--calls` calls after a warm-up. Twin:
//! `bench/predictor_torch.py` (the same MLP, eager and under `torch.cuda.graphs`, pinned tensors
//! and `non_blocking` copies; the same row names), so `bench/compare.py` pairs them.
//!
//! Before timing, every mode's output for a random input is checked against the module's own
//! forward on the device.

use super::{cuda_device, finish_json, write_head, Environment, Report, Row};
use crate::CliResult;
use ferrograd_core::cuda::{PredictMode, Predictor};
use ferrograd_core::{DType, Device, Rng, Tensor};
use ferrograd_nn::{mlp_on, Activation, Module};
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Debug, Clone)]
pub struct Config {
    pub device: Device,
    pub width: usize,
    pub layers: usize,
    pub batches: Vec<usize>,
    pub calls: usize,
    pub json: Option<PathBuf>,
    pub seed: u64,
}

pub fn check(cfg: &Config) -> CliResult<()> {
    if cfg.width == 0 || cfg.width > 1 << 16 || cfg.layers == 0 || cfg.layers > 64 {
        return Err(
            format!("--width {} (1..=65536) or --layers {} (1..=64) out of range", cfg.width, cfg.layers).into()
        );
    }
    if cfg.batches.is_empty() || cfg.batches.iter().any(|&b| b == 0 || b > 1 << 16) {
        return Err("--batches needs values in 1..=65536".into());
    }
    if cfg.calls < 10 || cfg.calls > 10_000_000 {
        return Err(format!("--calls {} out of range (10..=10000000)", cfg.calls).into());
    }
    Ok(())
}

/// The `q` quantile (0..1) of sorted samples, nearest rank.
fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

/// `graph B=1`: the row name both sides use.
pub fn row_name(mode: PredictMode, batch: usize) -> String {
    let m = match mode {
        PredictMode::Eager => "eager",
        PredictMode::Graph => "graph",
    };
    format!("{m} B={batch}")
}

pub fn run(cfg: &Config, out: &mut dyn Write) -> CliResult<()> {
    check(cfg)?;
    let _dev = cuda_device("predictor", cfg.device)?;
    let env = Environment::for_device(cfg.device);
    let sizes = vec![cfg.width; cfg.layers + 1];
    let model = mlp_on(&sizes, Activation::Relu, &mut Rng::new(cfg.seed), cfg.device)?;
    writeln!(
        out,
        "predictor: MLP {} layers x {} (ReLU, f32), on {} ({}); {} calls after {} warm-up",
        cfg.layers,
        cfg.width,
        cfg.device,
        env.device_name(),
        cfg.calls,
        cfg.calls / 10
    )?;
    let mut report =
        Report::new("predictor", cfg.device, env, "host wall time per call (H2D from pinned, forward, D2H, sync)");
    write_head(out, &format!("{:<12} | {:>10} | {:>10} | {:>10}", "what", "p50 µs", "p99 µs", "mean µs"))?;
    let mut rng = Rng::new(cfg.seed ^ 0x5eed);
    for &batch in &cfg.batches {
        let n_in = batch * cfg.width;
        let x = Tensor::randn_with(&mut rng, 0.0, 1.0, (batch, cfg.width), DType::F32, Device::Cpu)?;
        let xs = x.to_vec::<f32>()?;
        let want = ferrograd_core::with_no_grad(|| model.forward(&x.to_device(cfg.device)?))?.to_vec::<f32>()?;
        for mode in [PredictMode::Eager, PredictMode::Graph] {
            let mut p = Predictor::new(cfg.device, (batch, cfg.width), mode, |x: &Tensor| model.forward(x))?;
            let mut y = vec![f32::NAN; p.output_shape().elem_count()];
            p.predict(&xs, &mut y)?;
            let err =
                y.iter().zip(&want).fold(0.0f64, |m, (a, b)| m.max((a - b).abs() as f64 / (1.0 + b.abs() as f64)));
            // f64::max drops NaN: a non-finite output fails on its own.
            if y.iter().any(|v| !v.is_finite()) || err > 1e-4 {
                return Err(format!(
                    "predictor {}: output differs from the forward (err {err:e})",
                    row_name(mode, batch)
                )
                .into());
            }
            debug_assert_eq!(xs.len(), n_in);
            for _ in 0..cfg.calls / 10 {
                p.predict(&xs, &mut y)?;
            }
            let mut t = Vec::with_capacity(cfg.calls);
            for _ in 0..cfg.calls {
                let s = Instant::now();
                p.predict(&xs, &mut y)?;
                t.push(s.elapsed().as_secs_f64());
            }
            t.sort_by(f64::total_cmp);
            let (p50, p99) = (quantile(&t, 0.5), quantile(&t, 0.99));
            let mean = t.iter().sum::<f64>() / t.len() as f64;
            let name = row_name(mode, batch);
            writeln!(out, "{name:<12} | {:>10.1} | {:>10.1} | {:>10.1}", p50 * 1e6, p99 * 1e6, mean * 1e6)?;
            report.rows.push(
                Row::new(name, p50 * 1e6, "us", false)
                    .with("p50_us", p50 * 1e6)
                    .with("p99_us", p99 * 1e6)
                    .with("mean_us", mean * 1e6)
                    .with("calls", cfg.calls),
            );
        }
    }
    finish_json(&cfg.json, &report, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_are_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!((quantile(&v, 0.5), quantile(&v, 0.99), quantile(&v, 1.0)), (50.0, 99.0, 100.0));
        assert_eq!(quantile(&[3.0], 0.99), 3.0);
    }
}
