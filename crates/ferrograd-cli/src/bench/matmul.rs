//! `ferrograd bench matmul`: square matmul.
//!
//! **CPU** (f32): a naive triple loop against ferrograd's `Tensor::matmul`, GFLOPS for both and
//! the ratio. The baseline is honestly naive: one thread, the i-k-j loop order (so the inner loop
//! streams rows of B and C; the compiler may vectorise it, as it would any plain loop), no
//! blocking, no packing, no intrinsics. Both sides allocate their output on every run, as
//! `Tensor::matmul` does. Every size checks that the two results agree before its figures are
//! reported.
//!
//! **CUDA** (f32, bf16, f16): `Tensor::matmul` (cuBLAS) timed with CUDA events after warm-up,
//! median over batches (`timing::measure_device`), TFLOP/s = 2n³ / median. f32 is exact (TF32
//! off), as PyTorch's default. Before timing, the product is checked against a float64 CPU
//! computation: every row up to n = 512, else the first, the last and six random rows; the
//! output buffer is poisoned first and must be finite everywhere. Twin: `bench/torch_matmul.py`.
//!
//! Inputs are normal samples from a seeded Philox stream, never zeros.

use super::check::{self, rel_err, require};
use super::{finish_json, plot_title, write_head, Environment, Report, Row};
use crate::plot::{line_chart, Series};
use crate::timing::{measure, measure_device, Clock, DevicePlan, Plan, Timing};
use crate::CliResult;
use ferrograd_core::cuda::{set_matmul_precision, MatmulPrecision};
use ferrograd_core::{DType, Device, Rng, Tensor};
use rayon::prelude::*;
use serde::Serialize;
use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

/// Largest CPU size accepted: the naive loop at 4096 already takes about a minute per run.
const MAX_SIZE: usize = 4096;
/// Largest CUDA size accepted (three 16384² f32 matrices are 3 GiB).
const MAX_CUDA_SIZE: usize = 16384;
/// Largest relative difference (to the largest |C| entry) tolerated between the two CPU results.
pub const TOLERANCE: f64 = 1e-4;

/// CPU sizes when `--sizes` is not given.
pub const CPU_SIZES: &[usize] = &[128, 256, 512, 1024];
/// CUDA sizes per dtype when `--sizes` is not given (the targets: f32 128..4096, bf16 8192³).
pub const CUDA_F32_SIZES: &[usize] = &[128, 256, 512, 1024, 2048, 4096];
pub const CUDA_HALF_SIZES: &[usize] = &[8192];

pub const NAIVE_PLAN: Plan = Plan { warmup: 1, min_reps: 3, max_reps: 50, budget: Duration::from_millis(1000) };
/// Host-clock timing of ferrograd's CPU `Tensor::matmul` (the first error, if any, ends it).
pub fn measure_cpu_matmul(a: &Tensor, b: &Tensor) -> CliResult<Timing> {
    let mut err = None;
    let t = measure(FERROGRAD_PLAN, || match a.matmul(b) {
        Ok(c) => Some(c),
        Err(e) => {
            err.get_or_insert(e);
            None
        }
    });
    match err {
        Some(e) => Err(e.into()),
        None => Ok(t),
    }
}

pub const FERROGRAD_PLAN: Plan = Plan { warmup: 3, min_reps: 5, max_reps: 200, budget: Duration::from_millis(500) };

#[derive(Debug, Clone)]
pub struct Config {
    pub device: Device,
    /// None: f32 on the CPU; f32 and bf16 (each at its default sizes) on CUDA.
    pub dtypes: Option<Vec<DType>>,
    /// None: the defaults above.
    pub sizes: Option<Vec<usize>>,
    pub json: Option<PathBuf>,
    /// Also draw GFLOP/s against n (PNG) here.
    pub plot: Option<PathBuf>,
    pub seed: u64,
}

impl Config {
    /// (dtype, sizes) in the order they run.
    pub fn plan(&self) -> CliResult<Vec<(DType, Vec<usize>)>> {
        let dtypes = match (&self.dtypes, self.device, &self.sizes) {
            (Some(d), _, _) => d.clone(),
            (None, Device::Cuda(_), None) => vec![DType::F32, DType::BF16],
            (None, _, _) => vec![DType::F32],
        };
        if dtypes.is_empty() {
            return Err("--dtype needs at least one dtype".into());
        }
        let mut plan = Vec::new();
        for dt in dtypes {
            if !matches!(dt, DType::F32 | DType::BF16 | DType::F16) {
                return Err(format!("--dtype {dt}: the matmul bench runs f32, bf16 or f16").into());
            }
            if self.device.is_cpu() && dt != DType::F32 {
                return Err(
                    format!("--dtype {dt}: the CPU matmul bench is f32 only (its naive baseline is f32)").into()
                );
            }
            let sizes = match (&self.sizes, self.device, dt) {
                (Some(s), _, _) => s.clone(),
                (None, Device::Cpu, _) => CPU_SIZES.to_vec(),
                (None, Device::Cuda(_), DType::F32) => CUDA_F32_SIZES.to_vec(),
                (None, Device::Cuda(_), _) => CUDA_HALF_SIZES.to_vec(),
            };
            check_sizes(&sizes, if self.device.is_cpu() { MAX_SIZE } else { MAX_CUDA_SIZE })?;
            plan.push((dt, sizes));
        }
        Ok(plan)
    }
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

/// The x axis of the matmul plot.
const MATMUL_X: &str = "n (C = A B, all n x n; log scale)";

/// A row's name, in the table and the JSON alike: `f32 n=1024`. PyTorch's twin uses the same
/// names, which is how `bench/compare.py` pairs the rows.
pub fn row_name(dtype: DType, n: usize) -> String {
    format!("{} n={n}", dtype.as_str())
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

/// The flags: dtypes and sizes within the bench's bounds (`Config::plan`).
pub fn check(cfg: &Config) -> CliResult<()> {
    cfg.plan().map(|_| ())
}

pub fn run(cfg: &Config, out: &mut dyn Write) -> CliResult<()> {
    let plan = cfg.plan()?;
    super::open_device("matmul", cfg.device)?;
    match cfg.device {
        Device::Cpu => run_cpu(cfg, &plan[0].1, out),
        Device::Cuda(_) => run_cuda(cfg, &plan, out),
    }
}

fn run_cpu(cfg: &Config, sizes: &[usize], out: &mut dyn Write) -> CliResult<()> {
    let env = Environment::detect();
    writeln!(
        out,
        "f32 square matmul on {} ({}, {} rayon threads); median of timed runs after warm-up",
        cfg.device, env.cpu, env.rayon_threads
    )?;
    writeln!(out, "naive: single-threaded i-k-j triple loop over Vec<f32>; ferrograd: Tensor::matmul")?;
    writeln!(out)?;
    // The first column is the row's name in the JSON (`f32 n=1024`), so table and file pair up.
    let w = sizes.iter().map(|&n| row_name(DType::F32, n).len()).max().unwrap_or(4).max(4);
    let head = format!(
        "{:w$} | {:>10} {:>8} {:>5} | {:>12} {:>8} {:>5} | {:>8}",
        "what", "naive ms", "GFLOPS", "reps", "ferrograd ms", "GFLOPS", "reps", "speedup"
    );
    write_head(out, &head)?;

    let mut rng = Rng::new(cfg.seed);
    let mut results = Vec::with_capacity(sizes.len());
    for &n in sizes {
        let r = bench_size(n, cfg.device, &mut rng)?;
        writeln!(
            out,
            "{:w$} | {:>10.3} {:>8.2} {:>5} | {:>12.3} {:>8.2} {:>5} | {:>7.1}x",
            row_name(DType::F32, r.n),
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

    let mut report =
        Report::new("matmul", cfg.device, env, "host clock, median of timed runs after warm-up (timing::measure)");
    report.rows = results
        .iter()
        .map(|r| {
            Row::new(row_name(DType::F32, r.n), r.ferrograd.gflops, "GFLOP/s", true)
                .with("median_s", r.ferrograd.median_s)
                .with("reps", r.ferrograd.reps)
                .with("naive_gflops", r.naive.gflops)
                .with("speedup_over_naive", r.speedup)
        })
        .collect();
    report.extra.insert("dtype".into(), "f32".into());
    report.extra.insert("seed".into(), cfg.seed.into());
    report.extra.insert("results".into(), serde_json::to_value(&results)?);
    if let Some(p) = &cfg.plot {
        let line = |label: &str, f: fn(&SizeResult) -> f64| Series {
            label: label.into(),
            points: results.iter().map(|r| (r.n as f64, f(r))).collect(),
        };
        let series = [
            line("CPU naive loop (1 thread)", |r| r.naive.gflops),
            line(&format!("ferrograd CPU backend ({} threads)", rayon::current_num_threads()), |r| r.ferrograd.gflops),
        ];
        line_chart(p, &plot_title(&report), MATMUL_X, "GFLOP/s (log scale)", &series)?;
        writeln!(out, "\nwrote {}", p.display())?;
    }
    finish_json(&cfg.json, &report, out)
}

fn run_cuda(cfg: &Config, plan: &[(DType, Vec<usize>)], out: &mut dyn Write) -> CliResult<()> {
    // Exact f32, as PyTorch's default (torch.backends.cuda.matmul.allow_tf32 = False).
    set_matmul_precision(MatmulPrecision::Highest);
    let env = Environment::for_device(cfg.device);
    let clock = Clock::new(cfg.device)?;
    writeln!(out, "square matmul C = A B on {} ({})", cfg.device, env.gpu.as_deref().unwrap_or("?"))?;
    writeln!(
        out,
        "Tensor::matmul (cuBLAS), f32 exact (no TF32); CUDA events, median over batches after warm-up; \
         TFLOP/s = 2n^3 / median"
    )?;
    writeln!(out, "checked first against a float64 CPU reference (all rows up to n=512, else 8 sampled rows)")?;
    writeln!(out)?;
    // The first column is the row's name in the JSON (`bf16 n=8192`), so table and file pair up.
    let w = plan.iter().flat_map(|(dt, ns)| ns.iter().map(|&n| row_name(*dt, n).len())).max().unwrap_or(4).max(4);
    let head = format!(
        "{:w$} | {:>10} | {:>8} | {:>12} | {:>9} {:>5}",
        "what", "median ms", "TFLOP/s", "reps x inner", "rel err", "rows"
    );
    write_head(out, &head)?;

    let mut rng = Rng::new(cfg.seed);
    // (dtype, n, GFLOP/s) for the plot.
    let mut points: Vec<(DType, usize, f64)> = Vec::new();
    let mut report = Report::new(
        "matmul",
        cfg.device,
        env,
        "CUDA events on the compute stream; warm-up, batches of calls, median per call",
    );
    for (dtype, sizes) in plan {
        for &n in sizes {
            let r = bench_cuda_size(&clock, *dtype, n, cfg.device, &mut rng)?;
            writeln!(
                out,
                "{:w$} | {:>10.4} | {:>8.2} | {:>5} x {:>4} | {:>9.2e} {:>5}",
                row_name(*dtype, n),
                r.median_s * 1e3,
                r.tflops,
                r.reps,
                r.inner,
                r.rel_err,
                r.rows_checked
            )?;
            out.flush()?;
            report.rows.push(
                Row::new(row_name(*dtype, n), r.tflops, "TFLOP/s", true)
                    .with("median_s", r.median_s)
                    .with("min_s", r.min_s)
                    .with("reps", r.reps)
                    .with("inner", r.inner)
                    .with("rel_err", r.rel_err)
                    .with("rows_checked", r.rows_checked),
            );
            points.push((*dtype, n, r.tflops * 1e3));
        }
    }
    report.notes.push(format!("seed {}; inputs N(0,1) from Philox, drawn on the device", cfg.seed));
    if let Some(p) = &cfg.plot {
        let series: Vec<Series> = plan
            .iter()
            .map(|(dt, _)| Series {
                label: format!("CUDA {} (cuBLAS{})", dt.as_str(), if *dt == DType::F32 { ", exact f32" } else { "" }),
                points: points.iter().filter(|q| q.0 == *dt).map(|q| (q.1 as f64, q.2)).collect(),
            })
            .collect();
        line_chart(p, &plot_title(&report), MATMUL_X, "GFLOP/s (log scale)", &series)?;
        writeln!(out, "\nwrote {}", p.display())?;
    }
    finish_json(&cfg.json, &report, out)
}

struct CudaResult {
    median_s: f64,
    min_s: f64,
    tflops: f64,
    reps: usize,
    inner: usize,
    rel_err: f64,
    rows_checked: usize,
}

/// Relative error allowed against the float64 reference: f32 is exact arithmetic (far under
/// 1e-3; TF32 would land near 3e-4 and fail, on purpose); half types round the output.
fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-4,
        DType::F16 => 5e-3,
        _ => 1e-2,
    }
}

fn bench_cuda_size(clock: &Clock, dtype: DType, n: usize, device: Device, rng: &mut Rng) -> CliResult<CudaResult> {
    let a = Tensor::randn_with(rng, 0.0, 1.0, (n, n), dtype, device)?;
    let b = Tensor::randn_with(rng, 0.0, 1.0, (n, n), dtype, device)?;

    // Correctness first, on a poisoned output.
    let c = check::poisoned(|| Ok(a.matmul(&b)?))?;
    if !check::all_finite(&c)? {
        return Err(format!("{dtype} n={n}: the product has non-finite elements (unwritten output?)").into());
    }
    let rows = check::sample_rows(n, 512, 6, rng);
    let a_rows = check::rows_f64(&a, &rows)?;
    let c_rows = check::rows_f64(&c, &rows)?;
    drop(c);
    // B as f32 is exact for every dtype here and half the host memory of f64.
    let bv = b.to_dtype(DType::F32)?.to_vec::<f32>()?;
    let (got, want): (Vec<f64>, Vec<f64>) = a_rows
        .par_iter()
        .zip(c_rows.par_iter())
        .map(|(ar, cr)| {
            let mut acc = vec![0.0f64; n];
            for (k, &aik) in ar.iter().enumerate() {
                for (o, &bkj) in acc.iter_mut().zip(&bv[k * n..(k + 1) * n]) {
                    *o += aik * bkj as f64;
                }
            }
            (cr.clone(), acc)
        })
        .collect::<Vec<_>>()
        .into_iter()
        .fold((Vec::new(), Vec::new()), |(mut g, mut w), (c, r)| {
            g.extend(c);
            w.extend(r);
            (g, w)
        });
    drop(bv);
    let rel_err = rel_err(&got, &want);
    require(&format!("{dtype} matmul n={n}"), rel_err, tolerance(dtype))?;

    let t = measure_device(clock, DevicePlan::GPU, || a.matmul(&b))?;
    let flops = 2.0 * (n as f64).powi(3);
    let median_s = t.median_s();
    Ok(CudaResult {
        median_s,
        min_s: t.min_s(),
        tflops: flops / median_s / 1e12,
        reps: t.reps(),
        inner: t.inner,
        rel_err,
        rows_checked: rows.len(),
    })
}

fn check_sizes(sizes: &[usize], max: usize) -> CliResult<()> {
    if sizes.is_empty() {
        return Err("--sizes needs at least one size".into());
    }
    if let Some(&n) = sizes.iter().find(|&&n| n == 0 || n > max) {
        return Err(format!("matrix size {n} out of range: sizes must be between 1 and {max} on this device").into());
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
    let ours = measure_cpu_matmul(&a, &b)?;
    let (naive, ferrograd) = (Measured::new(&naive, flops), Measured::new(&ours, flops));
    Ok(SizeResult { n, flops, speedup: ferrograd.gflops / naive.gflops, naive, ferrograd, max_rel_diff })
}

/// max |x - y| over max |y|, in f64; zero when both are all zero, infinite when a value is not
/// finite (`f64::max` alone would skip a NaN) or the lengths differ.
pub fn max_rel_diff(x: &[f32], y: &[f32]) -> f64 {
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
    fn rejects_bad_sizes() {
        assert!(check_sizes(&[], MAX_SIZE).is_err());
        assert!(check_sizes(&[64, 0], MAX_SIZE).is_err());
        assert!(check_sizes(&[MAX_SIZE + 1], MAX_SIZE).is_err());
        assert!(check_sizes(&[1, MAX_SIZE], MAX_SIZE).is_ok());
    }

    #[test]
    fn default_plans_per_device() {
        let cfg = |device, dtypes: Option<Vec<DType>>, sizes: Option<Vec<usize>>| Config {
            device,
            dtypes,
            sizes,
            json: None,
            plot: None,
            seed: 1,
        };
        assert_eq!(cfg(Device::Cpu, None, None).plan().unwrap(), vec![(DType::F32, CPU_SIZES.to_vec())]);
        assert_eq!(
            cfg(Device::Cuda(0), None, None).plan().unwrap(),
            vec![(DType::F32, CUDA_F32_SIZES.to_vec()), (DType::BF16, vec![8192])]
        );
        assert_eq!(cfg(Device::Cuda(0), None, Some(vec![64])).plan().unwrap(), vec![(DType::F32, vec![64])]);
        assert_eq!(cfg(Device::Cuda(0), Some(vec![DType::F16]), None).plan().unwrap(), vec![(DType::F16, vec![8192])]);
        assert!(cfg(Device::Cpu, Some(vec![DType::BF16]), None).plan().is_err());
        assert!(cfg(Device::Cuda(0), Some(vec![DType::I32]), None).plan().is_err());
        assert!(cfg(Device::Cpu, None, Some(vec![MAX_SIZE + 1])).plan().is_err());
        assert!(cfg(Device::Cuda(0), None, Some(vec![MAX_SIZE + 1])).plan().is_ok());
    }
}
