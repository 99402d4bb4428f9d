//! `ferrograd kernels`: the embedded CUDA kernel modules and the on-disk CUBIN cache.
//!
//! `--precompile` compiles every module, the core's and the models' (in parallel, one thread per module up to the cores) with NVRTC for the GPU's architecture (or `--arch`, which
//! needs no GPU, only libnvrtc and the CUDA headers) into `$FERROGRAD_CACHE_DIR`, prints what each
//! cost, then reads them all back through a fresh cache the way the next process start will, and
//! says how long that takes against the NVRTC time it no longer spends.

use crate::CliResult;
use ferrograd_core::cuda;
use ferrograd_core::cuda::modules::{self, Module};
use ferrograd_core::cuda::nvrtc::{self as k, Arch, DiskCache, KernelCache, KernelSource};
use std::io::Write;
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct Config {
    pub precompile: bool,
    /// Compile for this architecture instead of the GPU's.
    pub arch: Option<Arch>,
    /// The GPU whose architecture to use when `arch` is not given.
    pub ordinal: usize,
}

pub fn run(cfg: &Config, out: &mut dyn Write) -> CliResult<()> {
    let cache = DiskCache::from_env();
    let dir = cache.as_ref().map_or_else(
        || "disabled (FERROGRAD_CACHE_DIR is set but empty, or no home directory)".to_string(),
        |d| d.dir().display().to_string(),
    );
    // The core's modules and the models' own.
    let all: Vec<&Module> = modules::ALL.iter().chain(ferrograd_models::MODULES).copied().collect();
    if !cfg.precompile {
        writeln!(out, "kernel modules ({}), compiled by NVRTC on first use:", all.len())?;
        let w = all.iter().map(|m| m.name.len()).max().unwrap_or(0);
        for m in &all {
            writeln!(
                out,
                "  {:w$} {:>7} bytes of CUDA C ({} shared headers)",
                m.name,
                m.source_len(),
                m.headers.len()
            )?;
        }
        writeln!(out, "cache: {dir}")?;
        match k::nvrtc_info() {
            Ok(i) => writeln!(out, "nvrtc: {} ({})", i.version, library(i))?,
            Err(e) => writeln!(out, "nvrtc: not found ({e})")?,
        }
        writeln!(out, "`ferrograd kernels --precompile [--arch sm_90]` fills the cache")?;
        return Ok(());
    }

    let arch = match cfg.arch {
        Some(a) => a,
        None => detect_arch(cfg.ordinal)?,
    };
    let nvrtc = k::nvrtc_info().map_err(|e| format!("cannot precompile for {arch}: {e}"))?;
    nvrtc.check_arch(arch).map_err(|e| format!("cannot precompile: {e}"))?;
    write!(out, "nvrtc {} ({}); target {arch}", nvrtc.version, library(nvrtc))?;
    if !k::env_options().is_empty() {
        write!(out, "; {}: {}", k::NVRTC_OPTIONS_ENV, k::env_options().join(" "))?;
    }
    writeln!(out)?;
    out.flush()?;

    let report = modules::precompile(arch, ferrograd_models::MODULES)?;
    writeln!(out, "{report}")?;
    if !report.is_ok() {
        return Err(format!(
            "{} of {} kernel modules failed to compile for {arch}",
            report.failures(),
            report.kernels.len()
        )
        .into());
    }

    // What the next start will do: a fresh process finds every module on disk.
    let Some(disk) = cache else {
        writeln!(out, "the disk cache is off: the next start compiles everything again")?;
        return Ok(());
    };
    let sources: Vec<KernelSource> = all.iter().map(|m| m.source()).collect();
    let fresh = KernelCache::new(Some(disk)).precompile(arch, &sources)?;
    let read = fresh.elapsed;
    let nvrtc_time = report.compile_time_saved();
    let missed = fresh.misses() + fresh.failures();
    writeln!(
        out,
        "next start: {} of {} modules from the disk cache in {} instead of {} of NVRTC: saves {}{}",
        fresh.hits(),
        fresh.kernels.len(),
        ms(read),
        ms(nvrtc_time),
        ms(nvrtc_time.saturating_sub(read)),
        if missed > 0 { format!(" ({missed} were not found on disk and were compiled)") } else { String::new() }
    )?;
    Ok(())
}

fn library(i: &k::NvrtcInfo) -> String {
    i.library.as_ref().map_or_else(|| "path unknown".to_string(), |p| p.display().to_string())
}

fn ms(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s >= 1.0 {
        format!("{s:.2} s")
    } else {
        format!("{:.1} ms", s * 1e3)
    }
}

/// The architecture of GPU `ordinal`, or one line saying there is none and what to do instead.
fn detect_arch(ordinal: usize) -> CliResult<Arch> {
    let hint = "pass --arch (e.g. --arch sm_90) to precompile for an explicit architecture without a GPU";
    let devs = cuda::devices().map_err(|e| format!("no GPU to precompile for ({e}); {hint}"))?;
    let d = devs.get(ordinal).ok_or_else(|| {
        format!("no GPU to precompile for (CUDA device {ordinal} not found: {} visible); {hint}", devs.len())
    })?;
    let (ma, mi) = d.compute_capability;
    Ok(Arch::from_compute_capability(ma, mi)?)
}
