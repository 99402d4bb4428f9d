//! `ferrograd bench ...`: micro-benchmarks. Each module takes a plain `Config` (no clap types),
//! prints a table, and can write its results as JSON in one schema shared with the PyTorch twins
//! under `bench/` (see [`Report`]), so `bench/compare.py` can put ours and PyTorch's side by side.

pub mod alloc;
pub mod allreduce;
pub mod attention;
pub mod check;
pub mod conv1d;
pub mod elementwise;
pub mod fused;
pub mod guide;
pub mod int8;
pub mod launch;
pub mod linear;
pub mod matmul;
pub mod optim;
pub mod overlap;
pub mod predictor;
pub mod selective_scan;
pub mod seq_op;
pub mod transfer;

use crate::CliResult;
use ferrograd_core::cuda::CudaDevice;
use ferrograd_core::Device;
use serde::Serialize;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The `schema` field of every JSON result; `bench/benchlib.py` writes the same string.
pub const SCHEMA: &str = "ferrograd-bench/1";

/// Facts about the machine and build that every JSON result carries.
#[derive(Debug, Clone, Serialize)]
pub struct Environment {
    pub ferrograd_version: &'static str,
    pub cpu: String,
    pub rayon_threads: usize,
    pub os: &'static str,
    pub arch: &'static str,
    /// `NVIDIA H200, 139.7 GiB, sm_90, 132 SMs` when the bench ran on a GPU.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu: Option<String>,
}

impl Environment {
    pub fn detect() -> Self {
        Environment {
            ferrograd_version: env!("CARGO_PKG_VERSION"),
            cpu: crate::info::cpu_model(),
            rayon_threads: rayon::current_num_threads(),
            os: std::env::consts::OS,
            arch: std::env::consts::ARCH,
            gpu: None,
        }
    }

    /// As [`detect`](Self::detect), naming the GPU when `device` is one.
    pub fn for_device(device: Device) -> Self {
        let mut e = Self::detect();
        if let Device::Cuda(n) = device {
            e.gpu = CudaDevice::get(n).ok().map(|d| gpu_line(&d));
        }
        e
    }

    /// What `device_name` says: the GPU's name, or the CPU model.
    pub fn device_name(&self) -> String {
        match &self.gpu {
            Some(g) => g.split(',').next().unwrap_or(g).to_string(),
            None => self.cpu.clone(),
        }
    }
}

fn gpu_line(d: &CudaDevice) -> String {
    let (ma, mi) = d.info.compute_capability;
    format!(
        "{}, {:.1} GiB, sm_{ma}{mi}, {} SMs",
        d.info.name,
        d.info.total_memory as f64 / (1u64 << 30) as f64,
        d.info.multiprocessors
    )
}

/// One measured figure. `name` is the key that pairs our row with the PyTorch twin's row.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub name: String,
    pub value: f64,
    pub unit: &'static str,
    pub higher_is_better: bool,
    /// Optional facts about the row (`median_s`, `reps`, `pct_of_copy`, `check`, ...).
    #[serde(flatten)]
    pub extra: BTreeMap<String, serde_json::Value>,
}

impl Row {
    pub fn new(name: impl Into<String>, value: f64, unit: &'static str, higher_is_better: bool) -> Row {
        Row { name: name.into(), value, unit, higher_is_better, extra: BTreeMap::new() }
    }

    pub fn with(mut self, key: &str, v: impl Into<serde_json::Value>) -> Row {
        self.extra.insert(key.to_string(), v.into());
        self
    }
}

/// The JSON every bench writes (schema `ferrograd-bench/1`):
///
/// ```json
/// {"schema": "ferrograd-bench/1", "bench": "transfer", "impl": "ferrograd", "device": "cuda:0",
///  "device_name": "NVIDIA H200", "version": "0.1.0", "timing": "...", "environment": {...},
///  "rows": [{"name": "h2d pinned 256 MiB", "value": 52.1, "unit": "GB/s",
///            "higher_is_better": true, "median_s": 0.0051, "reps": 10}],
///  "notes": ["..."]}
/// ```
///
/// Bench-specific extras (the CPU matmul's per-size `results`) sit beside these keys.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub schema: &'static str,
    pub bench: &'static str,
    #[serde(rename = "impl")]
    pub implementation: &'static str,
    pub device: String,
    pub device_name: String,
    pub version: &'static str,
    /// How the figures were timed, in one sentence.
    pub timing: String,
    pub environment: Environment,
    pub rows: Vec<Row>,
    pub notes: Vec<String>,
    #[serde(flatten)]
    pub extra: BTreeMap<String, serde_json::Value>,
}

impl Report {
    pub fn new(bench: &'static str, device: Device, env: Environment, timing: impl Into<String>) -> Report {
        Report {
            schema: SCHEMA,
            bench,
            implementation: "ferrograd",
            device: device.to_string(),
            device_name: env.device_name(),
            version: env!("CARGO_PKG_VERSION"),
            timing: timing.into(),
            environment: env,
            rows: Vec::new(),
            notes: Vec::new(),
            extra: BTreeMap::new(),
        }
    }
}

/// Write `value` as pretty JSON to `path`, atomically (`ferrograd_core::io::write_atomic`: a
/// previous file stays whole until the new one replaces it), naming the file in any error.
pub fn write_json<T: Serialize>(path: &Path, value: &T) -> CliResult<()> {
    let text = serde_json::to_string_pretty(value)?;
    ferrograd_core::io::write_atomic(path, (text + "\n").as_bytes())?;
    Ok(())
}

/// Write the report when `--json` was given (its path was checked before the bench started,
/// `Job::outputs`) and say so.
pub fn finish_json(json: &Option<PathBuf>, report: &Report, out: &mut dyn Write) -> CliResult<()> {
    if let Some(path) = json {
        write_json(path, report)?;
        writeln!(out, "\nwrote {}", path.display())?;
    }
    Ok(())
}

/// Refuse a bench whose tensors cannot be held: `bytes` is `None` when the byte count itself
/// overflows (a typed error naming `what`); on the CPU the count is checked against the memory
/// the host reports available. On a GPU the device's allocator reports its own out-of-memory
/// error with the figures once the device is open.
pub fn check_bytes(device: Device, what: impl Fn() -> String, bytes: Option<usize>) -> CliResult<()> {
    let bytes = bytes.ok_or_else(|| format!("{} is too large: its byte count overflows", what()))?;
    if device.is_cpu() {
        ferrograd_core::host::check_fits(&what, bytes)?;
    }
    Ok(())
}

/// Once the device is open: refuse tensors that cannot fit in its memory before allocating
/// any (`ferrograd_core::host::check_fits_on`). `bytes` was checked for overflow by `check_bytes`.
pub fn fit_device(device: Device, what: impl FnOnce() -> String, bytes: Option<usize>) -> CliResult<()> {
    if let (Device::Cuda(_), Some(b)) = (device, bytes) {
        ferrograd_core::host::check_fits_on(device, what, b)?;
    }
    Ok(())
}

/// `n` elements of 4 bytes, `copies` times over, or None on overflow.
pub fn f32_bytes(n: usize, copies: usize) -> Option<usize> {
    n.checked_mul(4)?.checked_mul(copies)
}

/// Draw the rows as bar panels (one per unit) into `path` when `--plot` was given, and say so.
/// `extra` names a row extra printed as a percentage beside each value (e.g. `pct_of_copy`).
pub fn finish_plot(path: &Option<PathBuf>, report: &Report, extra: Option<&str>, out: &mut dyn Write) -> CliResult<()> {
    if let Some(p) = path {
        crate::plot::bar_chart(p, &plot_title(report), &report.rows, extra)?;
        writeln!(out, "\nwrote {}", p.display())?;
    }
    Ok(())
}

/// "ferrograd bench transfer: cuda:0 (NVIDIA H200)".
pub fn plot_title(report: &Report) -> String {
    format!("ferrograd bench {}: {} ({})", report.bench, report.device, report.device_name)
}

/// The CUDA device a GPU-only bench runs on, or one line saying why there is none.
pub fn cuda_device(bench: &str, device: Device) -> CliResult<Arc<CudaDevice>> {
    match device {
        Device::Cpu => Err(format!("bench {bench} measures a CUDA device; --device cpu is not meaningful here").into()),
        Device::Cuda(n) => {
            CudaDevice::get(n).map_err(|e| format!("bench {bench} needs a CUDA device ({device}): {e}").into())
        }
    }
}

/// Open the device a bench that also runs on the CPU was asked for, with a hint on failure.
pub fn open_device(bench: &str, device: Device) -> CliResult<()> {
    if let Device::Cuda(_) = device {
        cuda_device(bench, device).map_err(|e| format!("{e}; use --device cpu to run it on the CPU"))?;
    }
    Ok(())
}

/// A number with about four significant digits, for tables.
pub fn fmt_value(v: f64) -> String {
    let a = v.abs();
    if !v.is_finite() {
        format!("{v}")
    } else if a >= 1e5 {
        format!("{v:.0}")
    } else if a >= 100.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.4}")
    }
}

/// A duration in seconds as µs or ms, for tables.
pub fn fmt_secs(s: f64) -> String {
    if s < 1e-3 {
        format!("{:.2} µs", s * 1e6)
    } else {
        format!("{:.3} ms", s * 1e3)
    }
}

/// How the GPU benches time: the `timing` line of their reports.
pub const EVENT_TIMING: &str = "CUDA events on the compute stream; warm-up, batches, median per call";

/// A table's header line and a rule of dashes under it.
pub fn write_head(out: &mut dyn Write, head: &str) -> CliResult<()> {
    writeln!(out, "{head}")?;
    writeln!(out, "{}", "-".repeat(head.chars().count()))?;
    Ok(())
}

/// The common table: name, value and unit, then the median time and repetition count where the
/// row has them, then `extra` (a key of the row's extras, printed as a percentage when it starts
/// with `pct`).
pub fn print_rows(out: &mut dyn Write, rows: &[Row], extra: Option<(&str, &str)>) -> CliResult<()> {
    let w = rows.iter().map(|r| r.name.chars().count()).max().unwrap_or(4).max(4);
    let mut head = format!("{:w$} | {:>12} {:<8} | {:>11} | {:>5}", "what", "value", "unit", "median", "reps");
    if let Some((title, _)) = extra {
        head += &format!(" | {title:>10}");
    }
    write_head(out, &head)?;
    for r in rows {
        let median = r.extra.get("median_s").and_then(|v| v.as_f64()).map_or_else(|| "-".into(), fmt_secs);
        let reps = r.extra.get("reps").and_then(|v| v.as_u64()).map_or_else(|| "-".into(), |n| n.to_string());
        let mut line = format!("{:w$} | {:>12} {:<8} | {median:>11} | {reps:>5}", r.name, fmt_value(r.value), r.unit);
        if let Some((_, key)) = extra {
            let v = match r.extra.get(key).and_then(|v| v.as_f64()) {
                Some(x) if key.starts_with("pct") => format!("{x:.1}%"),
                Some(x) => fmt_value(x),
                None => "-".into(),
            };
            line += &format!(" | {v:>10}");
        }
        writeln!(out, "{line}")?;
    }
    out.flush()?;
    Ok(())
}

/// Parse `ROWSxCOLS` (e.g. `8192x8192`).
pub fn parse_shape(s: &str) -> Result<(usize, usize), String> {
    let bad = || format!("`{s}` is not a shape: expected ROWSxCOLS, e.g. 8192x8192");
    let (r, c) = s.trim().split_once(['x', 'X']).ok_or_else(bad)?;
    let (r, c) = (r.trim().parse::<usize>().map_err(|_| bad())?, c.trim().parse::<usize>().map_err(|_| bad())?);
    if r == 0 || c == 0 {
        return Err(format!("`{s}`: both dimensions must be at least 1"));
    }
    Ok((r, c))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_parse() {
        assert_eq!(parse_shape("8192x1024"), Ok((8192, 1024)));
        assert_eq!(parse_shape(" 3X4 "), Ok((3, 4)));
        assert!(parse_shape("8192").is_err());
        assert!(parse_shape("0x4").is_err());
        assert!(parse_shape("ax4").is_err());
    }

    #[test]
    fn report_serialises_in_the_shared_schema() {
        let mut r = Report::new("launch", Device::Cpu, Environment::detect(), "host clock");
        r.rows.push(Row::new("cpu: time per add", 1.5, "us/op", false).with("reps", 5));
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["schema"], SCHEMA);
        assert_eq!(v["impl"], "ferrograd");
        assert_eq!(v["device"], "cpu");
        assert_eq!(v["rows"][0]["name"], "cpu: time per add");
        assert_eq!(v["rows"][0]["higher_is_better"], false);
        assert_eq!(v["rows"][0]["reps"], 5);
        assert!(v["device_name"].as_str().is_some_and(|s| !s.is_empty()));
    }

    #[test]
    fn cpu_is_refused_for_gpu_only_benches() {
        let e = cuda_device("transfer", Device::Cpu).unwrap_err().to_string();
        assert!(e.contains("bench transfer measures a CUDA device"), "{e}");
    }
}
