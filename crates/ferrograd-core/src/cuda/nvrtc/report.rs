//! What `ferrograd kernels --precompile` reports: one line per module and the totals.

use super::arch::Arch;
use super::cache::{CompiledKernel, Origin};
use super::error::KernelError;
use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

/// One module of a precompile run.
#[derive(Debug, Clone)]
pub struct PrecompileEntry {
    /// The module.
    pub name: String,
    /// Its CUBIN or why it failed.
    pub result: Result<CompiledKernel, KernelError>,
}

/// What `ferrograd kernels --precompile` did.
#[derive(Debug, Clone)]
pub struct PrecompileReport {
    /// The architecture compiled for.
    pub arch: Arch,
    /// The disk cache, if any.
    pub cache_dir: Option<PathBuf>,
    /// Every module.
    pub kernels: Vec<PrecompileEntry>,
    /// Wall time of the run.
    pub elapsed: Duration,
    /// Threads that compiled in parallel.
    pub threads: usize,
}

impl PrecompileReport {
    fn ok(&self) -> impl Iterator<Item = &CompiledKernel> {
        self.kernels.iter().filter_map(|e| e.result.as_ref().ok())
    }

    /// Kernels that needed no NVRTC run.
    pub fn hits(&self) -> usize {
        self.ok().filter(|k| k.from_cache).count()
    }

    /// Kernels found among the prebuilt CUBINs (counted in [`PrecompileReport::hits`] too).
    pub fn prebuilt(&self) -> usize {
        self.ok().filter(|k| k.origin == Origin::Prebuilt).count()
    }

    /// Kernels compiled by this run.
    pub fn misses(&self) -> usize {
        self.ok().filter(|k| !k.from_cache).count()
    }

    /// Modules that failed.
    pub fn failures(&self) -> usize {
        self.kernels.iter().filter(|e| e.result.is_err()).count()
    }

    /// Whether none failed.
    pub fn is_ok(&self) -> bool {
        self.failures() == 0
    }

    /// The module whose NVRTC compile took longest, and how long: the floor of a cold precompile.
    pub fn longest(&self) -> Option<(&str, Duration)> {
        self.ok().filter(|k| !k.from_cache).max_by_key(|k| k.compile_time).map(|k| (k.name.as_str(), k.compile_time))
    }

    /// NVRTC time the next start no longer spends on these kernels.
    pub fn compile_time_saved(&self) -> Duration {
        self.ok().map(|k| k.compile_time).sum()
    }

    /// NVRTC time spent in this call: the modules compiled now, not those found in a cache
    /// (whose [`CompiledKernel::compile_time`] is the time recorded when they were compiled).
    pub fn compile_time_spent(&self) -> Duration {
        self.ok().filter(|k| !k.from_cache).map(|k| k.compile_time).sum()
    }
}

impl fmt::Display for PrecompileReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let dir = self.cache_dir.as_ref().map_or_else(|| "disabled".to_string(), |d| d.display().to_string());
        writeln!(f, "kernels for {} (cache: {dir})", self.arch)?;
        let width = self.kernels.iter().map(|e| e.name.len()).max().unwrap_or(0);
        for e in &self.kernels {
            match &e.result {
                Ok(k) => {
                    let what = match k.origin {
                        Origin::Compiled => "compiled",
                        Origin::Disk => "hit (disk)",
                        Origin::Memory => "hit (memory)",
                        Origin::Prebuilt => "prebuilt",
                    };
                    write!(
                        f,
                        "  {:width$}  {what:12}  {:>9}  nvrtc {:>9}  {:>7} B",
                        e.name,
                        fmt_duration(k.elapsed),
                        fmt_duration(k.compile_time),
                        k.cubin.len(),
                    )?;
                    if let Some(w) = &k.cache_warning {
                        write!(f, "  ({w})")?;
                    }
                    writeln!(f)?;
                }
                Err(err) => writeln!(f, "  {:width$}  FAILED        {err}", e.name)?,
            }
        }
        write!(
            f,
            "{}{} hit, {} compiled, {} failed in {} on {} threads; a start now skips {} of NVRTC",
            match self.prebuilt() {
                0 => String::new(),
                n => format!("{n} prebuilt, "),
            },
            self.hits() - self.prebuilt(),
            self.misses(),
            self.failures(),
            fmt_duration(self.elapsed),
            self.threads,
            fmt_duration(self.compile_time_saved())
        )?;
        if let Some((name, t)) = self.longest() {
            write!(f, "; longest {name} {}", fmt_duration(t))?;
        }
        Ok(())
    }
}

fn fmt_duration(d: Duration) -> String {
    let ms = d.as_secs_f64() * 1e3;
    if ms >= 1000.0 {
        format!("{:.2} s", ms / 1e3)
    } else {
        format!("{ms:.1} ms")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::nvrtc::testutil::key;
    use std::sync::Arc;

    #[test]
    fn precompile_report_counts_and_prints() {
        let ok = |name: &str, origin: Origin, ms: u64| PrecompileEntry {
            name: name.to_string(),
            result: Ok(CompiledKernel {
                name: name.to_string(),
                arch: Arch::SM90,
                key: key(name),
                cubin: Arc::from(vec![0u8; 10]),
                from_cache: origin != Origin::Compiled,
                origin,
                compile_time: Duration::from_millis(ms),
                elapsed: Duration::from_millis(1),
                cache_warning: None,
            }),
        };
        let report = PrecompileReport {
            arch: Arch::SM90,
            cache_dir: None,
            kernels: vec![
                ok("unary", Origin::Compiled, 300),
                ok("binary", Origin::Disk, 200),
                ok("cast", Origin::Prebuilt, 700),
                PrecompileEntry {
                    name: "bad".to_string(),
                    result: Err(KernelError::InvalidInput { name: "bad".to_string(), what: "the source".to_string() }),
                },
            ],
            elapsed: Duration::from_millis(305),
            threads: 2,
        };
        assert_eq!((report.hits(), report.prebuilt(), report.misses(), report.failures()), (2, 1, 1, 1));
        assert!(!report.is_ok());
        assert_eq!(report.compile_time_saved(), Duration::from_millis(1200));
        assert_eq!(report.compile_time_spent(), Duration::from_millis(300), "the disk hit compiled nothing now");
        let text = report.to_string();
        assert!(text.contains("hit (disk)") && text.contains("FAILED") && text.contains("1.20 s"), "{text}");
        assert!(
            text.contains("1 prebuilt, 1 hit, 1 compiled, 1 failed")
                && text.lines().any(|l| l.trim_start().starts_with("cast ") && l.contains(" prebuilt ")),
            "{text}"
        );
        assert!(text.contains("on 2 threads") && text.contains("longest unary 300.0 ms"), "{text}");
    }
}
