//! `ferrograd memory`: per CUDA device, what the driver says (used, total, the fraction used, for
//! all processes) and what ferrograd's caching allocator in this process holds (allocated and
//! reserved bytes now and at their peak, active blocks, segments, driver calls, retries, OOMs).
//! `--watch` refreshes every second until interrupted (Ctrl-C).
//!
//! The same figures follow an out-of-memory error: [`oom_report`] is what `main` prints under the
//! error line of any command, with the next thing to try. The data comes from
//! `ferrograd_core::memory_status()`, which a program can call itself.
//!
//! Without CUDA, `memory` prints one line and succeeds: a machine without a GPU is not an error,
//! ferrograd runs on the CPU there.

use crate::CliResult;
use ferrograd_core::cuda::alloc::{MemoryStats, MEMORY_LIMIT_ENV};
use ferrograd_core::cuda::DeviceMemoryStatus;
use std::error::Error as StdError;
use std::io::Write;
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct Config {
    /// Refresh until interrupted (or `iterations` refreshes).
    pub watch: bool,
    /// Stop after this many refreshes (tests; None: until Ctrl-C).
    pub iterations: Option<usize>,
    pub interval: Duration,
    /// Clear the screen before each refresh (stdout is a terminal).
    pub clear: bool,
}

pub fn run(cfg: &Config, out: &mut dyn Write) -> CliResult<()> {
    let start = Instant::now();
    let mut i = 0usize;
    loop {
        let status = match ferrograd_core::memory_status() {
            Ok(v) if v.is_empty() => return no_gpu(out, "the CUDA driver loaded but sees no device"),
            Ok(v) => v,
            Err(e) if is_no_gpu(&e) => return no_gpu(out, &e.to_string()),
            Err(e) => return Err(e.into()),
        };
        if cfg.watch {
            if cfg.clear {
                // Home the cursor and clear the screen: the figures redraw in place.
                write!(out, "\x1b[H\x1b[2J")?;
            } else if i > 0 {
                writeln!(out)?;
            }
            writeln!(
                out,
                "ferrograd memory --watch: refresh {} at t = {:.1} s (every {:.1} s; Ctrl-C to stop)",
                i + 1,
                start.elapsed().as_secs_f64(),
                cfg.interval.as_secs_f64()
            )?;
        }
        for s in &status {
            for line in describe(s) {
                writeln!(out, "{line}")?;
            }
        }
        out.flush()?;
        i += 1;
        if !cfg.watch || cfg.iterations.is_some_and(|n| i >= n) {
            return Ok(());
        }
        std::thread::sleep(cfg.interval);
    }
}

/// CUDA is missing or shows no device: ferrograd runs on the CPU, which is not an error.
fn is_no_gpu(e: &ferrograd_core::Error) -> bool {
    matches!(e, ferrograd_core::Error::CudaUnavailable { .. } | ferrograd_core::Error::CudaDeviceNotFound { .. })
}

fn no_gpu(out: &mut dyn Write, why: &str) -> CliResult<()> {
    writeln!(
        out,
        "memory: no usable CUDA device ({why}); nothing to report, and not an error: ferrograd runs on the CPU"
    )?;
    Ok(())
}

/// Bytes in binary units with two decimals: `1.50 GiB`, `512 B`.
pub fn bytes(b: usize) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if b < 1024 {
        return format!("{b} B");
    }
    let mut v = b as f64 / 1024.0;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    format!("{v:.2} {}", UNITS[u])
}

/// The lines `ferrograd memory` prints for one device.
pub fn describe(s: &DeviceMemoryStatus) -> Vec<String> {
    let mut v = vec![
        format!("cuda:{}  {}", s.ordinal, s.name),
        format!(
            "  driver     {} used of {} ({:.1}% utilization), {} free  [all processes]",
            bytes(s.used),
            bytes(s.total),
            100.0 * s.utilization,
            bytes(s.free)
        ),
    ];
    if let Some(l) = s.limit {
        v.push(format!("  cap        {} for ferrograd ({MEMORY_LIMIT_ENV} or set_memory_limit)", bytes(l)));
    }
    v.extend(allocator_lines(&s.allocator));
    v
}

fn allocator_lines(a: &MemoryStats) -> Vec<String> {
    vec![
        format!(
            "  allocator  allocated {} (peak {}), reserved {} (peak {})  [this process]",
            bytes(a.allocated_bytes.current),
            bytes(a.allocated_bytes.peak),
            bytes(a.reserved_bytes.current),
            bytes(a.reserved_bytes.peak)
        ),
        format!(
            "             active blocks {} (peak {}), segments {} (peak {})",
            a.active_blocks.current, a.active_blocks.peak, a.segments.current, a.segments.peak
        ),
        format!(
            "             device allocs {}, device frees {}, retries after freeing the cache {}, OOMs {}",
            a.device_allocs, a.device_frees, a.alloc_retries, a.ooms
        ),
    ]
}

/// The figures to show after an error: the devices this process opened (opening the others would
/// only add contexts to them), or every device if none was opened.
pub fn status_after_error() -> ferrograd_core::Result<Vec<DeviceMemoryStatus>> {
    let opened = ferrograd_core::cuda::device::opened_devices();
    if opened.is_empty() {
        return ferrograd_core::memory_status();
    }
    let mut v = opened.iter().map(|d| DeviceMemoryStatus::of(d)).collect::<ferrograd_core::Result<Vec<_>>>()?;
    v.sort_by_key(|s| s.ordinal);
    Ok(v)
}

/// The out-of-memory error in `e` or in its chain of sources, if there is one.
pub fn find_oom<'a>(e: &'a (dyn StdError + 'static)) -> Option<&'a ferrograd_core::Error> {
    let mut cur = Some(e);
    while let Some(x) = cur {
        if let Some(f @ ferrograd_core::Error::OutOfMemory { .. }) = x.downcast_ref::<ferrograd_core::Error>() {
            return Some(f);
        }
        cur = x.source();
    }
    None
}

/// What `main` prints under an error line when the error is an out-of-memory: the figures of every
/// device now, and the next thing to try (`command_hint` names the flags of the command that
/// failed). None for any other error. An OOM that reached main only as text (a message that
/// quoted it) is recognised by `Error::OutOfMemory`'s own wording, "CUDA out of memory".
pub fn oom_report(
    e: &(dyn StdError + 'static),
    status: impl FnOnce() -> ferrograd_core::Result<Vec<DeviceMemoryStatus>>,
    command_hint: &str,
) -> Option<String> {
    if find_oom(e).is_none() && !e.to_string().contains("CUDA out of memory") {
        return None;
    }
    let mut s = String::new();
    match status() {
        Ok(devs) if !devs.is_empty() => {
            s +=
                "memory now (the failed command's tensors are freed; the error line has the figures at the failure):\n";
            for d in &devs {
                for line in describe(d) {
                    s += &format!("  {line}\n");
                }
                let others = d.used.saturating_sub(d.allocator.reserved_bytes.current);
                s += &format!(
                    "    other processes and the CUDA context hold about {} (nvidia-smi lists the processes)\n",
                    bytes(others)
                );
            }
        }
        Ok(_) => s += "memory now: no CUDA device visible\n",
        Err(e) => s += &format!("memory now: cannot read the device's figures ({e})\n"),
    }
    s += &format!(
        "next: {command_hint}; or cap ferrograd with {MEMORY_LIMIT_ENV}=<size> (e.g. 8GiB) to share the GPU or to \
         rehearse a smaller card; `ferrograd memory --watch` shows the figures live; docs/troubleshooting.md, \
         \"Out of memory\"\n"
    );
    Some(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrograd_core::cuda::alloc::Stat;

    fn status() -> DeviceMemoryStatus {
        let st = |current, peak| Stat { current, peak, allocated: 0, freed: 0 };
        let a = MemoryStats {
            allocated_bytes: st(3 << 20, 5 << 30),
            reserved_bytes: st(6 << 30, 6 << 30),
            active_blocks: st(2, 40),
            segments: st(3, 4),
            device_allocs: 4,
            device_frees: 1,
            alloc_retries: 1,
            ooms: 1,
            ..MemoryStats::default()
        };
        DeviceMemoryStatus {
            ordinal: 0,
            name: "NVIDIA H200".into(),
            free: 10 << 30,
            total: 140 << 30,
            used: 130 << 30,
            utilization: 130.0 / 140.0,
            limit: Some(8 << 30),
            allocator: a,
        }
    }

    fn oom() -> ferrograd_core::Error {
        ferrograd_core::Error::OutOfMemory {
            requested: 1 << 30,
            free: 1 << 20,
            total: 8 << 30,
            allocated: 5 << 30,
            reserved: 6 << 30,
            hint: "try a smaller batch".into(),
        }
    }

    #[test]
    fn bytes_in_binary_units() {
        assert_eq!(bytes(0), "0 B");
        assert_eq!(bytes(1023), "1023 B");
        assert_eq!(bytes(1536), "1.50 KiB");
        assert_eq!(bytes(150_011_707_392), "139.71 GiB");
    }

    #[test]
    fn a_device_is_described_with_driver_and_allocator_figures() {
        let lines = describe(&status());
        let text = lines.join("\n");
        assert_eq!(lines[0], "cuda:0  NVIDIA H200");
        assert!(lines[1].contains("130.00 GiB used of 140.00 GiB (92.9% utilization), 10.00 GiB free"), "{text}");
        assert!(text.contains("8.00 GiB for ferrograd (FERROGRAD_CUDA_MEMORY_LIMIT"), "{text}");
        assert!(text.contains("allocated 3.00 MiB (peak 5.00 GiB), reserved 6.00 GiB (peak 6.00 GiB)"), "{text}");
        assert!(text.contains("active blocks 2 (peak 40), segments 3 (peak 4)"), "{text}");
        assert!(text.contains("device allocs 4, device frees 1, retries after freeing the cache 1, OOMs 1"), "{text}");
    }

    #[test]
    fn an_oom_anywhere_in_the_chain_gets_the_figures_and_a_next_step() {
        #[derive(Debug)]
        struct Wrapper(ferrograd_core::Error);
        impl std::fmt::Display for Wrapper {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("training failed")
            }
        }
        impl StdError for Wrapper {
            fn source(&self) -> Option<&(dyn StdError + 'static)> {
                Some(&self.0)
            }
        }
        let direct: crate::CliError = oom().into();
        let wrapped: crate::CliError = Box::new(Wrapper(oom()));
        let as_text: crate::CliError = format!("step 3: {}", oom()).into();
        for e in [&direct, &wrapped, &as_text] {
            let r = oom_report(&**e, || Ok(vec![status()]), "try a smaller --batch").expect("an OOM");
            assert!(r.contains("memory now"), "{r}");
            assert!(r.contains("cuda:0  NVIDIA H200") && r.contains("OOMs 1"), "{r}");
            // 130 GiB used by the driver, 6 GiB reserved by us: the rest belongs to others.
            assert!(r.contains("hold about 124.00 GiB"), "{r}");
            assert!(r.contains("next: try a smaller --batch") && r.contains("FERROGRAD_CUDA_MEMORY_LIMIT="), "{r}");
        }
        assert!(find_oom(&*direct).is_some() && find_oom(&*wrapped).is_some() && find_oom(&*as_text).is_none());
    }

    #[test]
    fn other_errors_get_no_report_and_unreadable_figures_are_said() {
        let e: crate::CliError = ferrograd_core::Error::Cuda("launch failed".into()).into();
        assert!(oom_report(&*e, || Ok(vec![status()]), "x").is_none());
        let e: crate::CliError = oom().into();
        let r = oom_report(&*e, || Err(ferrograd_core::Error::Cuda("context lost".into())), "x").unwrap();
        assert!(r.contains("cannot read the device's figures (CUDA error: context lost)"), "{r}");
    }
}
