//! `ferrograd kernels`: the embedded CUDA kernel modules and the on-disk CUBIN cache.
//!
//! `--precompile` compiles every module a GPU of the architecture runs, the core's and the models'
//! (in parallel, one thread per module up to the cores; `modules::for_arch` says which: on sm_90 not
//! the mma.sync attention modules the Hopper kernels replace, named in a `left out:` line), with
//! NVRTC for the GPU's architecture (or `--arch`, which needs no GPU, only libnvrtc and the CUDA
//! headers) into `$FERROGRAD_CACHE_DIR`, prints what each cost, then reads them all back through a
//! fresh cache the way the next process start will, and says how long that takes against the NVRTC
//! time it no longer spends.
//!
//! The binary ships every module prebuilt for sm_80 and sm_90 (`ferrograd-kernels`): on those
//! GPUs a precompile finds them there ("prebuilt") and compiles only what is not current
//! (`FERROGRAD_PREBUILT=0` times NVRTC itself). `--write-prebuilt DIR` is how they are made.
//!
//! It also compares the NVRTC time with the CPU time the process spent: NVRTC from a CUDA toolkit
//! (13.0 on the lent GPU machines) keeps its output in the CUDA driver's compute cache
//! (`CUDA_CACHE_PATH`, default `~/.nv/ComputeCache`), so a precompile into an empty
//! `$FERROGRAD_CACHE_DIR` can still be served from there: 47 modules in 3.7 s on 16 threads for 3.8 s
//! of CPU, against 8.4-8.9 s and ~100 s of CPU truly cold on the same machine. Figures taken that
//! way were reported as cold once; the line below says when it happened.

use crate::CliResult;
use ferrograd_core::cuda;
use ferrograd_core::cuda::modules::{self, Module};
use ferrograd_core::cuda::nvrtc::{self as k, Arch, DiskCache, KernelCache, KernelSource};
use std::io::Write;
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct Config {
    pub precompile: bool,
    /// Compile with NVRTC and write the prebuilt kernels' files here.
    pub write_prebuilt: Option<std::path::PathBuf>,
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
    let models = ferrograd_models::modules()?;
    let all: Vec<&Module> = modules::ALL.iter().chain(&models).copied().collect();
    if !cfg.precompile && cfg.write_prebuilt.is_none() {
        writeln!(out, "kernel modules ({}), prebuilt (below) or compiled by NVRTC on first use:", all.len())?;
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
        prebuilt_lines(&all, out)?;
        writeln!(out, "`ferrograd kernels --precompile [--arch sm_90]` fills the cache")?;
        return Ok(());
    }

    let arch = match cfg.arch {
        Some(a) => a,
        None => detect_arch(cfg.ordinal)?,
    };
    if let Some(dir) = &cfg.write_prebuilt {
        return write_prebuilt(dir, arch, &all, out);
    }
    let prebuilt = k::installed_prebuilt();
    match (k::nvrtc_info(), prebuilt) {
        (Ok(nvrtc), _) => {
            nvrtc.check_arch(arch).map_err(|e| format!("cannot precompile: {e}"))?;
            write!(out, "nvrtc {} ({}); target {arch}", nvrtc.version, library(nvrtc))?;
        }
        // Without NVRTC only the prebuilt modules can load: say so and report which.
        (Err(e), Some(_)) => write!(out, "nvrtc: not found ({e}); prebuilt modules only; target {arch}")?,
        (Err(e), None) => return Err(format!("cannot precompile for {arch}: {e}").into()),
    }
    if let Some(p) = prebuilt {
        write!(out, "; {}", p.describe())?;
    }
    if !k::env_options().is_empty() {
        write!(out, "; {}: {}", k::NVRTC_OPTIONS_ENV, k::env_options().join(" "))?;
    }
    writeln!(out)?;
    out.flush()?;

    let cpu0 = process_cpu_seconds();
    let report = modules::precompile(arch, &models)?;
    writeln!(out, "{report}")?;
    let wanted = modules::for_arch(arch, &models);
    let left: Vec<&str> = all
        .iter()
        .filter(|m| m.source().needed_for(arch) && !wanted.iter().any(|w| w.name == m.name))
        .map(|m| m.name)
        .collect();
    if !left.is_empty() {
        writeln!(
            out,
            "left out: {} (the Hopper attention kernels replace them on {arch}; FERROGRAD_ATTENTION_WGMMA=0 \
             brings them back; a call that needs one compiles it then)",
            left.join(", ")
        )?;
    }
    if let (Some(a), Some(b)) = (cpu0, process_cpu_seconds()) {
        let spent = report.compile_time_spent().as_secs_f64();
        if spent > 0.0 {
            writeln!(out, "{}", cpu_note(b - a, spent))?;
        }
    }
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
    let sources: Vec<KernelSource> = wanted.iter().map(|m| m.source()).collect();
    let fresh = KernelCache::new(Some(disk)).precompile(arch, &sources)?;
    let read = fresh.elapsed;
    let nvrtc_time = report.compile_time_saved();
    let missed = fresh.misses() + fresh.failures();
    let from = match fresh.prebuilt() {
        0 => "from the disk cache".to_string(),
        p if p == fresh.hits() => "prebuilt in the binary".to_string(),
        p => format!("prebuilt in the binary ({p}) or from the disk cache ({})", fresh.hits() - p),
    };
    writeln!(
        out,
        "next start: {} of {} modules {from} in {} instead of {} of NVRTC: saves {}{}",
        fresh.hits(),
        fresh.kernels.len(),
        ms(read),
        ms(nvrtc_time),
        ms(nvrtc_time.saturating_sub(read)),
        if missed > 0 { format!(" ({missed} were not found on disk and were compiled)") } else { String::new() }
    )?;
    Ok(())
}

/// `ferrograd kernels` without flags: what is shipped prebuilt and whether it is current.
fn prebuilt_lines(all: &[&'static Module], out: &mut dyn Write) -> CliResult<()> {
    let set = match ferrograd_kernels::prebuilt() {
        Ok(s) => s,
        Err(e) => {
            writeln!(out, "prebuilt: unusable ({e})")?;
            return Ok(());
        }
    };
    let off = if k::installed_prebuilt().is_none() { " (off: FERROGRAD_PREBUILT=0)" } else { "" };
    writeln!(out, "prebuilt: {}{off}", k::PrebuiltKernels::describe(set))?;
    for arch in ferrograd_kernels::archs() {
        let f = ferrograd_kernels::freshness(set, arch, all);
        write!(out, "  {arch}: {} of {} modules current", f.current.len(), f.current.len() + f.stale.len())?;
        if !f.stale.is_empty() {
            write!(
                out,
                "; compiled by NVRTC instead (changed since scripts/prebuild-kernels.sh): {}",
                f.stale.join(", ")
            )?;
        }
        writeln!(out)?;
    }
    Ok(())
}

/// `--write-prebuilt DIR`: every module a GPU of `arch` may run (the attention modules the Hopper
/// kernels supersede included, for `FERROGRAD_ATTENTION_WGMMA=0`), compiled by NVRTC without the
/// shipped ones, written as `DIR/<arch>.bin` and `.manifest`.
fn write_prebuilt(dir: &std::path::Path, arch: Arch, all: &[&'static Module], out: &mut dyn Write) -> CliResult<()> {
    // Files made from edited sources or extra flags would ship CUBINs no normal run asks for.
    if !k::env_options().is_empty() {
        return Err(format!("--write-prebuilt with {} set: unset it first", k::NVRTC_OPTIONS_ENV).into());
    }
    if std::env::var_os(k::KERNEL_DIR_ENV).is_some_and(|v| !v.is_empty()) {
        return Err(format!("--write-prebuilt with {} set: unset it first", k::KERNEL_DIR_ENV).into());
    }
    let nvrtc = k::nvrtc_info().map_err(|e| format!("cannot write prebuilt kernels for {arch}: {e}"))?;
    nvrtc.check_arch(arch).map_err(|e| format!("cannot write prebuilt kernels: {e}"))?;
    writeln!(out, "nvrtc {} ({}); target {arch}", nvrtc.version, library(nvrtc))?;
    out.flush()?;
    let sources: Vec<KernelSource> = all.iter().map(|m| m.source()).filter(|s| s.needed_for(arch)).collect();
    let report = KernelCache::from_env().with_prebuilt(None).precompile(arch, &sources)?;
    writeln!(out, "{report}")?;
    if !report.is_ok() {
        return Err(format!("{} of {} modules failed to compile for {arch}", report.failures(), sources.len()).into());
    }
    let kernels: Vec<k::CompiledKernel> = report.kernels.into_iter().filter_map(|e| e.result.ok()).collect();
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let [bin, manifest] = ferrograd_kernels::write(dir, arch, nvrtc.version, &kernels)?;
    let bytes = std::fs::metadata(&bin).map_or(0, |m| m.len());
    let raw: usize = kernels.iter().map(|k| k.cubin.len()).sum();
    writeln!(
        out,
        "wrote {} modules for {arch}: {} ({bytes} bytes, {raw} bytes of CUBIN deflated) and {}",
        kernels.len(),
        bin.display(),
        manifest.display()
    )?;
    Ok(())
}

/// User plus system CPU time of this process so far (Linux: `/proc/self/stat`), else `None`.
fn process_cpu_seconds() -> Option<f64> {
    parse_cpu_seconds(&std::fs::read_to_string("/proc/self/stat").ok()?)
}

/// utime and stime are fields 14 and 15 of `/proc/<pid>/stat`, in USER_HZ ticks (100 a second on
/// Linux whatever the kernel's own tick); field 2, the command name, may hold spaces and ')'.
fn parse_cpu_seconds(stat: &str) -> Option<f64> {
    let after = &stat[stat.rfind(')')? + 1..];
    let mut fields = after.split_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some((utime + stime) as f64 / 100.0)
}

/// The CPU time against the summed NVRTC time, and what a large gap means: compiling is CPU work,
/// so NVRTC calls that took far longer than the CPU they used were waiting on a cache, not compiling.
fn cpu_note(cpu_s: f64, nvrtc_s: f64) -> String {
    let line = format!("process CPU time {cpu_s:.1} s for {nvrtc_s:.2} s of NVRTC calls");
    if nvrtc_s > 1.0 && cpu_s < 0.5 * nvrtc_s {
        format!(
            "{line}: most modules came from the CUDA driver's compute cache (CUDA_CACHE_PATH, default \
             ~/.nv/ComputeCache), not from a compilation; CUDA_CACHE_DISABLE=1 times a cold one"
        )
    } else {
        line
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_seconds_from_proc_stat_even_with_parens_in_the_name() {
        let stat = "4242 (a) b (c) R 1 4242 4242 0 -1 4194560 100 0 0 0 1234 56 0 0 20 0 17 0 9 0";
        assert_eq!(parse_cpu_seconds(stat), Some(12.9));
        assert_eq!(parse_cpu_seconds("4242 (x) R 1"), None);
        assert_eq!(parse_cpu_seconds("no parenthesis"), None);
        #[cfg(target_os = "linux")]
        assert!(process_cpu_seconds().is_some_and(|s| s >= 0.0));
    }

    #[test]
    fn cpu_note_names_the_compute_cache_only_when_the_cpu_did_not_compile() {
        assert!(cpu_note(3.8, 49.5).contains("CUDA_CACHE_DISABLE=1"));
        assert!(!cpu_note(100.8, 119.3).contains("cache"));
        assert!(!cpu_note(0.01, 0.2).contains("cache"), "a sub-second total says nothing");
    }
}
