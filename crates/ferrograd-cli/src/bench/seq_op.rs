//! What `bench selective-scan` and `bench conv1d` share: the flags' checks, and for each sequence
//! length the small problem's forward (into poisoned memory) and backward checked against the
//! float64 CPU op, then the forward and forward + backward of the fused op timed with CUDA events
//! (median per call, `timing::measure_device`), the allocator's peak over one forward + backward
//! (inputs included), the table row and the three report rows (`fwd …`, `fwd+bwd …`,
//! `peak fwd+bwd …`). Each op's workload is its own (`ferrograd_core::fused::*::bench`).

use super::check::{poisoned, require};
use super::{cuda_device, finish_json, write_head, Environment, Report, Row, EVENT_TIMING};
use crate::timing::{measure_device, Clock, DevicePlan, DeviceTiming};
use crate::CliResult;
use ferrograd_core::cuda::CudaDevice;
use ferrograd_core::{DType, Device, Rng, Tensor};
use std::io::Write;
use std::path::PathBuf;

/// A sequence op's bench workload: `[batch, dim, len]` inputs and one more size (the conv's width,
/// the scan's state), built from Philox, with its float64 CPU checks.
pub trait Workload: Sized {
    fn new(
        rng: &mut Rng,
        shape: (usize, usize, usize, usize),
        dtype: DType,
        device: Device,
    ) -> ferrograd_core::Result<Self>;
    fn forward(&self) -> ferrograd_core::Result<Tensor>;
    fn forward_backward(&self) -> ferrograd_core::Result<(Tensor, Vec<Tensor>)>;
    /// The least bytes the forward (or the forward + backward) moves.
    fn bytes(&self, backward: bool) -> f64;
    fn check_forward(&self, y: &Tensor) -> ferrograd_core::Result<f64>;
    fn check_backward(&self) -> ferrograd_core::Result<f64>;
    fn tolerance(dtype: DType) -> f64;
}

macro_rules! workload {
    ($op:ident) => {
        impl Workload for ferrograd_core::fused::$op::bench::Workload {
            fn new(
                rng: &mut Rng,
                shape: (usize, usize, usize, usize),
                dtype: DType,
                device: Device,
            ) -> ferrograd_core::Result<Self> {
                Self::new(rng, shape, dtype, device)
            }
            fn forward(&self) -> ferrograd_core::Result<Tensor> {
                self.forward()
            }
            fn forward_backward(&self) -> ferrograd_core::Result<(Tensor, Vec<Tensor>)> {
                self.forward_backward()
            }
            fn bytes(&self, backward: bool) -> f64 {
                self.bytes(backward)
            }
            fn check_forward(&self, y: &Tensor) -> ferrograd_core::Result<f64> {
                self.check_forward(y)
            }
            fn check_backward(&self) -> ferrograd_core::Result<f64> {
                self.check_backward()
            }
            fn tolerance(dtype: DType) -> f64 {
                ferrograd_core::fused::$op::bench::tolerance(dtype)
            }
        }
    };
}
workload!(conv1d_causal);
workload!(selective_scan);

/// The flags every sequence-op bench takes.
#[derive(Debug, Clone)]
pub struct Sizes {
    pub device: Device,
    pub dtype: DType,
    pub batch: usize,
    pub dim: usize,
    pub seqs: Vec<usize>,
    pub json: Option<PathBuf>,
    pub seed: u64,
}

/// One sequence-op bench: the sizes, and what its table and report say.
pub struct Spec<'a> {
    /// The `bench` subcommand (`conv1d`, `selective-scan`), for the device error.
    pub command: &'static str,
    /// The report's name.
    pub report: &'static str,
    /// The op as the check failures name it.
    pub what: &'static str,
    pub sizes: &'a Sizes,
    /// The fourth size of the workload's shape (the conv's width, the scan's state).
    pub extra: usize,
    /// The lines above the table (the device and the GPU's name are appended to the first).
    pub title: [String; 2],
    pub notes: [String; 2],
    /// A row's name from its mode (`fwd`, `fwd+bwd`, `peak fwd+bwd`, or "" for the table) and length.
    pub name: &'a dyn Fn(&str, usize) -> String,
}

/// The checks every sequence-op bench makes of its flags: the dtype, positive sizes, the lengths
/// within `max_len`, and the largest problem's byte count (`bytes(len)`) without overflow (issue 11).
pub fn check_sizes(command: &str, s: &Sizes, max_len: usize, bytes: impl Fn(usize) -> Option<usize>) -> CliResult<()> {
    if !matches!(s.dtype, DType::BF16 | DType::F32) {
        return Err(format!("--dtype {}: the {command} bench runs bf16 or f32", s.dtype).into());
    }
    if s.batch == 0 || s.dim == 0 || s.seqs.is_empty() {
        return Err("--batch, --dim and --seqs need positive values".into());
    }
    if let Some(l) = s.seqs.iter().find(|&&l| l == 0 || l > max_len) {
        return Err(format!("sequence length {l} out of range (1..={max_len})").into());
    }
    let l = s.seqs.iter().max().copied().unwrap_or(1);
    if bytes(l).is_none() {
        return Err(
            format!("bench {command}: B={} D={} L={l} is too large: its byte count overflows", s.batch, s.dim).into()
        );
    }
    Ok(())
}

/// `a * b * ...` of `n` and `factors`, `None` on overflow.
pub fn product(n: usize, factors: &[usize]) -> Option<usize> {
    factors.iter().try_fold(n, |a, &v| a.checked_mul(v))
}

/// Check, time and report `W` at every length of `spec`.
pub fn run<W: Workload>(spec: Spec, out: &mut dyn Write) -> CliResult<()> {
    let sz = spec.sizes;
    let dev = cuda_device(spec.command, sz.device)?;
    let env = Environment::for_device(sz.device);
    let clock = Clock::new(sz.device)?;
    let (b, d, x, dtype) = (sz.batch, sz.dim, spec.extra, sz.dtype);
    writeln!(out, "{}, on {} ({})", spec.title[0], sz.device, env.gpu.as_deref().unwrap_or("?"))?;
    writeln!(out, "{}", spec.title[1])?;
    writeln!(out)?;
    write_head(out, &head())?;
    let mut rng = Rng::new(sz.seed);
    let mut report = Report::new(spec.report, sz.device, env, EVENT_TIMING);
    let tol = W::tolerance(dtype);
    for &l in &sz.seqs {
        let small = W::new(&mut rng, (1, 8, l, x), dtype, sz.device)?;
        let y = poisoned(|| Ok(small.forward()?))?;
        let fwd_err = small.check_forward(&y)?;
        require(&format!("{} {dtype} L={l} forward (8 channels)", spec.what), fwd_err, tol)?;
        let bwd_err = poisoned(|| Ok(small.check_backward()?))?;
        require(&format!("{} {dtype} L={l} backward (8 channels)", spec.what), bwd_err, tol * 2.0)?;
        drop((small, y));
        let w = W::new(&mut rng, (b, d, l, x), dtype, sz.device)?;
        let m = measure(&clock, &dev, || w.forward(), || w.forward_backward())?;
        let name = |mode: &str| (spec.name)(mode, l);
        record(out, &mut report, name, &m, (w.bytes(false), w.bytes(true)), (fwd_err, bwd_err))?;
    }
    report.notes.extend(spec.notes);
    finish_json(&sz.json, &report, out)
}

/// One length's measurements.
pub struct Measured {
    pub fwd: DeviceTiming,
    pub fwd_bwd: DeviceTiming,
    pub peak_mib: f64,
}

/// Time `fwd` and `fwd_bwd`, then the peak memory of one more `fwd_bwd`.
fn measure<A, B>(
    clock: &Clock,
    dev: &CudaDevice,
    fwd: impl FnMut() -> ferrograd_core::Result<A>,
    mut fwd_bwd: impl FnMut() -> ferrograd_core::Result<B>,
) -> CliResult<Measured> {
    let tf = measure_device(clock, DevicePlan::GPU, fwd)?;
    let tb = measure_device(clock, DevicePlan::GPU, &mut fwd_bwd)?;
    clock.synchronize()?;
    dev.reset_peak_stats();
    drop(fwd_bwd()?);
    clock.synchronize()?;
    let peak_mib = dev.memory_stats().allocated_bytes.peak as f64 / (1 << 20) as f64;
    Ok(Measured { fwd: tf, fwd_bwd: tb, peak_mib })
}

/// Print the table row (`label`, ms and GB/s of both, peak, the worse error) and push the report
/// rows named by `name(mode)`. `bytes` = the least bytes the forward and the forward + backward
/// move; `errs` = the small problem's forward and backward errors.
fn record(
    out: &mut dyn Write,
    report: &mut Report,
    name: impl Fn(&str) -> String,
    m: &Measured,
    bytes: (f64, f64),
    errs: (f64, f64),
) -> CliResult<()> {
    let (tf, tb) = (m.fwd.median_s(), m.fwd_bwd.median_s());
    let (gf, gb) = (bytes.0 / tf / 1e9, bytes.1 / tb / 1e9);
    writeln!(
        out,
        "{:34} | {:>9.4} | {:>7.1} | {:>9.4} | {:>7.1} | {:>9.1} | {:>9.2e}",
        name("").trim(),
        tf * 1e3,
        gf,
        tb * 1e3,
        gb,
        m.peak_mib,
        errs.0.max(errs.1)
    )?;
    out.flush()?;
    report.rows.push(
        Row::new(name("fwd"), tf * 1e3, "ms", false)
            .with("reps", m.fwd.reps())
            .with("gb_per_s", gf)
            .with("rel_err_small", errs.0),
    );
    report.rows.push(
        Row::new(name("fwd+bwd"), tb * 1e3, "ms", false)
            .with("reps", m.fwd_bwd.reps())
            .with("gb_per_s", gb)
            .with("rel_err_small", errs.1),
    );
    report.rows.push(Row::new(name("peak fwd+bwd"), m.peak_mib, "MiB", false));
    Ok(())
}

/// The table's head, as both benches print it.
fn head() -> String {
    format!(
        "{:34} | {:>9} | {:>7} | {:>9} | {:>7} | {:>9} | {:>9}",
        "what", "fwd ms", "GB/s", "f+b ms", "GB/s", "peak MiB", "rel err"
    )
}

/// What the benches' flag tests share.
#[cfg(test)]
pub(crate) mod testing {
    use super::*;

    /// Mamba's sizes, on the CPU.
    pub fn sizes() -> Sizes {
        Sizes {
            device: Device::Cpu,
            dtype: DType::BF16,
            batch: 4,
            dim: 1536,
            seqs: vec![256, 1024, 4096],
            json: None,
            seed: 1,
        }
    }

    /// What every sequence-op bench refuses whatever its own size: f16, a zero length, a batch
    /// whose bytes overflow, and (at run time) a device that is not a GPU.
    pub fn refuses_bad_sizes(check: impl Fn(Sizes) -> CliResult<()>, run: impl Fn(Sizes) -> CliResult<()>) {
        assert!(check(sizes()).is_ok());
        assert!(check(Sizes { dtype: DType::F16, ..sizes() }).is_err());
        assert!(check(Sizes { seqs: vec![0], ..sizes() }).is_err());
        let e = check(Sizes { batch: usize::MAX, ..sizes() }).unwrap_err().to_string();
        assert!(e.contains("overflows"), "{e}");
        let e = run(sizes()).unwrap_err().to_string();
        assert!(e.contains("measures a CUDA device"), "{e}");
    }
}
