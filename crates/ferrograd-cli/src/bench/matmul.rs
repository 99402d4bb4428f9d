//! `ferrograd bench matmul`: square f32 matmul, a naive triple loop against ferrograd's
//! `Tensor::matmul`, GFLOPS for both and the ratio.
//!
//! The baseline is honestly naive: one thread, the i-k-j loop order (so the inner loop streams
//! rows of B and C; the compiler may vectorise it, as it would any plain loop), no blocking, no
//! packing, no intrinsics. Both sides allocate their output on every run, as `Tensor::matmul` does.
//! Inputs are normal samples from a seeded Philox stream, never zeros, and every size checks that
//! the two results agree before its figures are reported.

use super::{write_json, Environment};
use crate::timing::{measure, Plan, Timing};
use crate::CliResult;
use ferrograd_core::{DType, Device, Rng, Tensor};
use serde::Serialize;
use std::fs::File;
use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

/// Largest size accepted: the naive loop at 4096 already takes about a minute per run.
const MAX_SIZE: usize = 4096;
/// Largest relative difference (to the largest |C| entry) tolerated between the two results.
const TOLERANCE: f64 = 1e-4;

const NAIVE_PLAN: Plan = Plan { warmup: 1, min_reps: 3, max_reps: 50, budget: Duration::from_millis(1000) };
const FERROGRAD_PLAN: Plan = Plan { warmup: 3, min_reps: 5, max_reps: 200, budget: Duration::from_millis(500) };

#[derive(Debug, Clone)]
pub struct Config {
    pub device: Device,
    pub sizes: Vec<usize>,
    pub json: Option<PathBuf>,
    pub seed: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub bench: &'static str,
    pub dtype: &'static str,
    pub device: String,
    pub seed: u64,
    pub environment: Environment,
    pub results: Vec<SizeResult>,
}

#[derive(Debug, Clone, Serialize)]
pub struct SizeResult {
    pub n: usize,
    /// 2 n^3.
    pub flops: f64,
    pub naive: Measured,
    pub ferrograd: Measured,
    /// ferrograd GFLOPS / naive GFLOPS (medians).
    pub speedup: f64,
    /// max |C_ferrograd - C_naive| / max |C_naive|.
    pub max_rel_diff: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Measured {
    pub median_s: f64,
    pub min_s: f64,
    /// From the median time.
    pub gflops: f64,
    pub reps: usize,
}

impl Measured {
    fn new(t: &Timing, flops: f64) -> Self {
        let median_s = t.median().as_secs_f64();
        Measured { median_s, min_s: t.min().as_secs_f64(), gflops: flops / median_s / 1e9, reps: t.reps() }
    }
}

/// C = A B for row-major n x n matrices: i-k-j loop, one thread, no blocking.
pub fn naive_matmul(a: &[f32], b: &[f32], n: usize) -> Vec<f32> {
    let mut c = vec![0.0f32; n * n];
    for i in 0..n {
        for k in 0..n {
            let aik = a[i * n + k];
            for j in 0..n {
                c[i * n + j] += aik * b[k * n + j];
            }
        }
    }
    c
}

pub fn run(cfg: &Config, out: &mut dyn Write) -> CliResult<()> {
    if cfg.device.is_cuda() {
        return Err(format!(
            "CUDA matmul benchmark not available in this build (device {}): ferrograd-core has no CUDA \
             tensors yet; use --device cpu",
            cfg.device
        )
        .into());
    }
    check_sizes(&cfg.sizes)?;
    // Open the JSON file first, so a bad path fails before minutes of benchmarking.
    let mut json_file = match &cfg.json {
        Some(p) => Some((p, File::create(p).map_err(|e| format!("cannot create {}: {e}", p.display()))?)),
        None => None,
    };

    let env = Environment::detect();
    writeln!(
        out,
        "f32 square matmul on {} ({}, {} rayon threads); median of timed runs after warm-up",
        cfg.device, env.cpu, env.rayon_threads
    )?;
    writeln!(out, "naive: single-threaded i-k-j triple loop over Vec<f32>; ferrograd: Tensor::matmul")?;
    writeln!(out)?;
    writeln!(
        out,
        "{:>6} | {:>10} {:>8} {:>5} | {:>12} {:>8} {:>5} | {:>8}",
        "n", "naive ms", "GFLOPS", "reps", "ferrograd ms", "GFLOPS", "reps", "speedup"
    )?;
    writeln!(out, "{}", "-".repeat(6 + 3 + 25 + 3 + 27 + 3 + 8))?;

    let mut rng = Rng::new(cfg.seed);
    let mut results = Vec::with_capacity(cfg.sizes.len());
    for &n in &cfg.sizes {
        let r = bench_size(n, cfg.device, &mut rng)?;
        writeln!(
            out,
            "{:>6} | {:>10.3} {:>8.2} {:>5} | {:>12.3} {:>8.2} {:>5} | {:>7.1}x",
            r.n,
            r.naive.median_s * 1e3,
            r.naive.gflops,
            r.naive.reps,
            r.ferrograd.median_s * 1e3,
            r.ferrograd.gflops,
            r.ferrograd.reps,
            r.speedup
        )?;
        out.flush()?;
        results.push(r);
    }

    let report = Report {
        bench: "matmul",
        dtype: "f32",
        device: cfg.device.to_string(),
        seed: cfg.seed,
        environment: env,
        results,
    };
    if let Some((path, file)) = json_file.take() {
        drop(file);
        write_json(path, &report)?;
        writeln!(out, "\nwrote {}", path.display())?;
    }
    Ok(())
}

fn check_sizes(sizes: &[usize]) -> CliResult<()> {
    if sizes.is_empty() {
        return Err("--sizes needs at least one size".into());
    }
    if let Some(&n) = sizes.iter().find(|&&n| n == 0 || n > MAX_SIZE) {
        return Err(format!("matrix size {n} out of range: sizes must be between 1 and {MAX_SIZE}").into());
    }
    Ok(())
}

fn bench_size(n: usize, device: Device, rng: &mut Rng) -> CliResult<SizeResult> {
    let a = Tensor::randn_with(rng, 0.0, 1.0, (n, n), DType::F32, device)?;
    let b = Tensor::randn_with(rng, 0.0, 1.0, (n, n), DType::F32, device)?;
    let (av, bv) = (a.to_vec::<f32>()?, b.to_vec::<f32>()?);

    // Agreement first: a fast wrong answer is not a result.
    let want = naive_matmul(&av, &bv, n);
    let got = a.matmul(&b)?.to_vec::<f32>()?;
    let max_rel_diff = max_rel_diff(&got, &want);
    if max_rel_diff.is_nan() || max_rel_diff > TOLERANCE {
        return Err(format!(
            "n={n}: Tensor::matmul disagrees with the naive loop (max relative difference {max_rel_diff:e} > \
             {TOLERANCE:e})"
        )
        .into());
    }

    let flops = 2.0 * (n as f64).powi(3);
    let naive = measure(NAIVE_PLAN, || naive_matmul(&av, &bv, n));
    let mut err = None;
    let ours = measure(FERROGRAD_PLAN, || match a.matmul(&b) {
        Ok(c) => Some(c),
        Err(e) => {
            err.get_or_insert(e);
            None
        }
    });
    if let Some(e) = err {
        return Err(e.into());
    }
    let (naive, ferrograd) = (Measured::new(&naive, flops), Measured::new(&ours, flops));
    Ok(SizeResult { n, flops, speedup: ferrograd.gflops / naive.gflops, naive, ferrograd, max_rel_diff })
}

/// max |x - y| over max |y|, in f64; zero when both are all zero, infinite when a value is not
/// finite (`f64::max` alone would skip a NaN) or the lengths differ.
fn max_rel_diff(x: &[f32], y: &[f32]) -> f64 {
    if x.len() != y.len() {
        return f64::INFINITY;
    }
    let diff = x
        .iter()
        .zip(y)
        .map(|(&p, &q)| (p as f64 - q as f64).abs())
        .map(|d| if d.is_finite() { d } else { f64::INFINITY })
        .fold(0.0, f64::max);
    let scale = y.iter().map(|&q| (q as f64).abs()).fold(0.0, f64::max);
    if diff == 0.0 {
        0.0
    } else {
        diff / scale
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn naive_matches_a_hand_computed_product() {
        // [[1,2],[3,4]] x [[5,6],[7,8]] = [[19,22],[43,50]]
        assert_eq!(naive_matmul(&[1., 2., 3., 4.], &[5., 6., 7., 8.], 2), vec![19., 22., 43., 50.]);
    }

    #[test]
    fn naive_agrees_with_tensor_matmul_on_odd_sizes() {
        let mut rng = Rng::new(3);
        for n in [1, 7, 33] {
            let a = Tensor::randn_with(&mut rng, 0.0, 1.0, (n, n), DType::F32, Device::Cpu).unwrap();
            let b = Tensor::randn_with(&mut rng, 0.0, 1.0, (n, n), DType::F32, Device::Cpu).unwrap();
            let want = naive_matmul(&a.to_vec::<f32>().unwrap(), &b.to_vec::<f32>().unwrap(), n);
            let got = a.matmul(&b).unwrap().to_vec::<f32>().unwrap();
            assert!(max_rel_diff(&got, &want) < 1e-5, "n={n}");
        }
    }

    #[test]
    fn relative_difference_catches_nan_and_length() {
        assert_eq!(max_rel_diff(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
        assert!((max_rel_diff(&[1.0, 2.5], &[1.0, 2.0]) - 0.25).abs() < 1e-12);
        assert_eq!(max_rel_diff(&[f32::NAN, 2.0], &[1.0, 2.0]), f64::INFINITY);
        assert_eq!(max_rel_diff(&[1.0], &[1.0, 2.0]), f64::INFINITY);
    }

    #[test]
    fn rejects_bad_sizes_and_cuda() {
        assert!(check_sizes(&[]).is_err());
        assert!(check_sizes(&[64, 0]).is_err());
        assert!(check_sizes(&[MAX_SIZE + 1]).is_err());
        assert!(check_sizes(&[1, MAX_SIZE]).is_ok());
        let cfg = Config { device: Device::Cuda(0), sizes: vec![8], json: None, seed: 1 };
        let e = run(&cfg, &mut Vec::new()).unwrap_err().to_string();
        assert!(e.contains("CUDA matmul benchmark not available in this build"), "{e}");
    }
}
