//! `ferrograd bench optim`: one fused Adam step over 100 parameter tensors (issue 4's figure).
//! Twin: `bench/torch_optim.py` (`torch.optim.Adam(fused=True)` on the same sizes).
//!
//! The sizes cycle through 4 Ki, 64 Ki, 256 Ki and 1 Mi elements (34 M parameters in all), so the
//! step is neither all launch overhead nor all bandwidth. Gradients, moments and parameters are
//! random (never zeros). CUDA events around each step (3 launches of up to 40 tensors), median.

use super::{check_bytes, f32_bytes, finish_json, finish_plot, open_device, print_rows, Environment, Report, Row};
use crate::timing::{measure_device, Clock, DevicePlan};
use crate::CliResult;
use ferrograd_core::optim::{adam_step, AdamConfig};
use ferrograd_core::{DType, Device, Rng, Tensor};
use std::io::Write;
use std::path::PathBuf;

pub const SIZES: [usize; 4] = [4 << 10, 64 << 10, 256 << 10, 1 << 20];

#[derive(Debug, Clone)]
pub struct Config {
    pub device: Device,
    pub tensors: usize,
    pub json: Option<PathBuf>,
    pub plot: Option<PathBuf>,
    pub seed: u64,
}

/// Parameters of `tensors` tensors cycling through [`SIZES`], or None on overflow.
fn parameters(tensors: usize) -> Option<usize> {
    let cycle: usize = SIZES.iter().sum();
    let full = (tensors / SIZES.len()).checked_mul(cycle)?;
    full.checked_add(SIZES[..tensors % SIZES.len()].iter().sum())
}

/// The flags, and the five groups of tensors (parameters, gradients, two moments, one temporary)
/// against the host's memory on the CPU. Issue 11: `--tensors 1000000` (5.4 TB) ran for minutes.
pub fn check(cfg: &Config) -> CliResult<()> {
    if cfg.tensors == 0 {
        return Err("--tensors must be at least 1".into());
    }
    let bytes = parameters(cfg.tensors).and_then(|n| f32_bytes(n, 5));
    let what = || match parameters(cfg.tensors) {
        Some(n) => format!("bench optim --tensors {} (5 groups of {n} f32 parameters)", cfg.tensors),
        None => format!("bench optim --tensors {}", cfg.tensors),
    };
    check_bytes(cfg.device, what, bytes)
}

pub fn run(cfg: &Config, out: &mut dyn Write) -> CliResult<()> {
    check(cfg)?;
    open_device("optim", cfg.device)?;
    let bytes = parameters(cfg.tensors).and_then(|n| f32_bytes(n, 5));
    super::fit_device(cfg.device, || format!("bench optim --tensors {}", cfg.tensors), bytes)?;
    let env = Environment::for_device(cfg.device);
    let mut rng = Rng::new(cfg.seed);
    let mut group = |scale: f64| -> CliResult<Vec<Tensor>> {
        (0..cfg.tensors)
            .map(|i| Ok(Tensor::randn_with(&mut rng, 0.0, scale, SIZES[i % SIZES.len()], DType::F32, cfg.device)?))
            .collect()
    };
    let params = group(1.0)?;
    let grads = group(1.0)?;
    let m = group(0.1)?;
    let v: Vec<Tensor> = group(0.1)?.iter().map(|t| t.sqr()).collect::<Result<_, _>>()?;
    let total: usize = params.iter().map(|p| p.elem_count()).sum();
    writeln!(
        out,
        "Adam step over {} f32 tensors ({:.1} M parameters) on {}",
        cfg.tensors,
        total as f64 / 1e6,
        cfg.device
    )?;
    let clock = Clock::new(cfg.device)?;
    let adam = AdamConfig::default();
    let mut step = 0u64;
    let t = measure_device(&clock, DevicePlan::GPU, || {
        step += 1;
        adam_step(&params, &grads, &m, &v, &adam, step)
    })?;
    // Bytes a step must move: read p, g, m, v; write p, m, v.
    let gbps = (7 * 4 * total) as f64 / t.median_s() / 1e9;
    let rows = vec![
        Row::new(format!("adam step, {} tensors", cfg.tensors), t.median_s() * 1e6, "µs", false)
            .with("median_s", t.median_s())
            .with("reps", t.reps()),
        Row::new(format!("adam bandwidth, {} tensors", cfg.tensors), gbps, "GB/s", true),
    ];
    print_rows(out, &rows, None)?;
    let mut report = Report::new("optim", cfg.device, env, "CUDA events around each step; median per step");
    report.rows = rows;
    report.notes.push(format!("sizes cycle {SIZES:?}; {total} parameters; bytes = 7 x 4 x parameters"));
    finish_plot(&cfg.plot, &report, None, out)?;
    finish_json(&cfg.json, &report, out)
}
