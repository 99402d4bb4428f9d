//! `ferrograd bench overlap`: how well the data loader's prefetch hides a host->device copy behind
//! compute (issue 4: efficiency = (compute + transfer - overlapped) / min(compute, transfer),
//! 1.0 = fully hidden). Runs `ferrograd_nn::data::measure_overlap`: a synthetic step of four
//! 2048^3 f32 matmuls and a 64 MiB pinned batch, by default.

use super::{finish_json, open_json, print_rows, Environment, Report, Row};
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

pub fn run(cfg: &Config, out: &mut dyn Write) -> CliResult<()> {
    let json = open_json(&cfg.json)?;
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
    finish_json(json, &report, out)
}
