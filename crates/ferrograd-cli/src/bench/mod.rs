//! `ferrograd bench ...`: micro-benchmarks. Each module takes a plain `Config` (no clap types),
//! prints a table, and can write its results as JSON. Planned next to `matmul`: transfer, alloc,
//! elementwise and launch, each with a PyTorch twin under `bench/` once CUDA tensors exist.

pub mod matmul;

use crate::CliResult;
use serde::Serialize;
use std::path::Path;

/// Facts about the machine and build that every JSON result carries.
#[derive(Debug, Clone, Serialize)]
pub struct Environment {
    pub ferrograd_version: &'static str,
    pub cpu: String,
    pub rayon_threads: usize,
    pub os: &'static str,
    pub arch: &'static str,
}

impl Environment {
    pub fn detect() -> Self {
        Environment {
            ferrograd_version: env!("CARGO_PKG_VERSION"),
            cpu: crate::info::cpu_model(),
            rayon_threads: rayon::current_num_threads(),
            os: std::env::consts::OS,
            arch: std::env::consts::ARCH,
        }
    }
}

/// Write `value` as pretty JSON to `path`, naming the file in any error.
pub fn write_json<T: Serialize>(path: &Path, value: &T) -> CliResult<()> {
    let text = serde_json::to_string_pretty(value)?;
    std::fs::write(path, text + "\n").map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    Ok(())
}
