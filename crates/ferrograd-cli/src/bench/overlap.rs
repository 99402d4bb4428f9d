//! `ferrograd bench overlap`: how well the data loader's prefetch hides a host->device copy behind
//! compute (issue 4: efficiency = (compute + transfer - overlapped) / min(compute, transfer),
//! 1.0 = fully hidden). Runs `ferrograd_nn::data::measure_overlap`: a synthetic step of four
//! 2048^3 f32 matmuls and a 64 MiB pinned batch, by default.

use super::{check_bytes, f32_bytes, finish_json, print_rows, Environment, Report, Row};
use crate::CliResult;
use ferrograd_core::Device;
use ferrograd_nn::data::{measure_overlap, OverlapConfig};
use std::io::Write;
use std::path::PathBuf;

#[derive(Debug, Clone)]
pub struct Config {
    pub device: Device,
    pub mib: usize,
    pub matmul: usize,
    pub json: Option<PathBuf>,
}

pub fn check(cfg: &Config) -> CliResult<()> {
    if cfg.mib == 0 || cfg.matmul == 0 {
        return Err("--mib and --matmul must be at least 1".into());
    }
    // The pinned batch lives on the host; the matmuls' operands on the device.
    check_bytes(
        Device::Cpu,
        || format!("bench overlap --mib {} (pinned batch)", cfg.mib),
        cfg.mib.checked_mul(1 << 20),
    )?;
    let mm = cfg.matmul.checked_mul(cfg.matmul).and_then(|n| f32_bytes(n, 3));
    check_bytes(cfg.device, || format!("bench overlap --matmul {}", cfg.matmul), mm)
}

pub fn run(cfg: &Config, out: &mut dyn Write) -> CliResult<()> {
    check(cfg)?;
    if cfg.device.is_cpu() {
        return Err("bench overlap measures a CUDA device; --device cpu is not meaningful here".into());
    }
    let env = Environment::for_device(cfg.device);
    let oc = OverlapConfig { transfer_bytes: cfg.mib << 20, matmul_size: cfg.matmul, ..OverlapConfig::default() };
    let r = measure_overlap(cfg.device, &oc)?;
    writeln!(
        out,
        "overlap on {}: {} f32 {}^3 matmuls vs a {} MiB pinned copy",
        r.device, r.matmuls, r.matmul_size, cfg.mib
    )?;
    let rows = vec![
        Row::new("compute alone", r.compute_ms * 1e3, "µs", false),
        Row::new("transfer alone", r.transfer_ms * 1e3, "µs", false),
        Row::new("both, prefetch overlapped", r.overlapped_ms * 1e3, "µs", false),
        Row::new("overlap efficiency", r.efficiency * 100.0, "%", true),
        Row::new("transfer bandwidth", r.transfer_gbps, "GB/s", true),
    ];
    print_rows(out, &rows, None)?;
    let mut report = Report::new("overlap", cfg.device, env, "CUDA events on the compute stream; median of iterations");
    report.rows = rows;
    finish_json(&cfg.json, &report, out)
}
