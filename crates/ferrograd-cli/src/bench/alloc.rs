//! `ferrograd bench alloc`: allocate and free one block of device memory (64 MiB by default).
//! Twin: `bench/torch_alloc.py`.
//!
//! - **cached**: `CudaDevice::cached_alloc_free`: through ferrograd's caching allocator, which
//!   after the first call hands the same cached block back without a driver call. PyTorch:
//!   `torch.empty(n, dtype=torch.uint8, device="cuda")` and `del` (its caching allocator).
//! - **raw driver**: `CudaDevice::raw_alloc_free`: `cuMemAlloc` + `cuMemFree`, what an allocator
//!   saves. PyTorch's twin makes the same two driver calls through ctypes.
//!
//! Host clock (these are host-side calls that enqueue no device work), batches of calls so that
//! a sub-microsecond call is not lost in the clock's resolution, median per call over batches.

use super::{check_bytes, cuda_device, finish_json, finish_plot, print_rows, Environment, Report, Row};
use crate::timing::{measure_device, Clock, DevicePlan};
use crate::CliResult;
use ferrograd_core::Device;
use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

const CACHED_PLAN: DevicePlan = DevicePlan {
    warmup: 100,
    min_reps: 50,
    max_reps: 2000,
    budget: Duration::from_millis(300),
    target_batch: Duration::from_micros(100),
    max_inner: 100,
};
const RAW_PLAN: DevicePlan = DevicePlan {
    warmup: 5,
    min_reps: 30,
    max_reps: 1000,
    budget: Duration::from_millis(500),
    target_batch: Duration::from_micros(100),
    max_inner: 100,
};

#[derive(Debug, Clone)]
pub struct Config {
    pub device: Device,
    pub mib: usize,
    pub json: Option<PathBuf>,
    /// Also draw the rows as a bar chart (PNG) here.
    pub plot: Option<PathBuf>,
}

pub fn check(cfg: &Config) -> CliResult<()> {
    if cfg.mib == 0 {
        return Err("--mib must be at least 1".into());
    }
    check_bytes(cfg.device, || format!("bench alloc --mib {}", cfg.mib), cfg.mib.checked_mul(1 << 20))
}

pub fn run(cfg: &Config, out: &mut dyn Write) -> CliResult<()> {
    check(cfg)?;
    let dev = cuda_device("alloc", cfg.device)?;
    let env = Environment::for_device(cfg.device);
    let bytes = cfg.mib << 20;
    writeln!(out, "allocate + free {} MiB on {} ({})", cfg.mib, cfg.device, env.gpu.as_deref().unwrap_or("?"))?;
    writeln!(out, "host clock, batches of calls, median per call after warm-up")?;
    writeln!(out)?;
    out.flush()?;

    let host = Clock::Cpu;
    let before = dev.memory_stats();
    let cached = measure_device(&host, CACHED_PLAN, || dev.cached_alloc_free(bytes))?;
    let after = dev.memory_stats();
    // Warm-up made the one driver allocation; the timed calls must have made none.
    let driver_calls = (after.device_allocs - before.device_allocs).saturating_sub(1);
    let raw = measure_device(&host, RAW_PLAN, || dev.raw_alloc_free(bytes))?;

    let row = |name: String, t: &crate::timing::DeviceTiming| {
        Row::new(name, t.median_s() * 1e6, "µs", false)
            .with("median_s", t.median_s())
            .with("min_s", t.min_s())
            .with("reps", t.reps())
            .with("inner", t.inner)
    };
    let rows = vec![
        row(format!("cached allocate+free {} MiB", cfg.mib), &cached).with("driver_allocs_while_timed", driver_calls),
        row(format!("raw driver allocate+free {} MiB", cfg.mib), &raw),
    ];
    print_rows(out, &rows, None)?;
    writeln!(
        out,
        "\ncached path: {driver_calls} driver allocations during the timed calls; raw/cached = {:.0}x",
        raw.median_s() / cached.median_s()
    )?;

    let mut report =
        Report::new("alloc", cfg.device, env, "host clock; batches of calls; median per call after warm-up");
    report.rows = rows;
    report.notes.push("raw driver = cuMemAlloc_v2 + cuMemFree_v2 (synchronous), bypassing every cache".into());
    finish_plot(&cfg.plot, &report, None, out)?;
    finish_json(&cfg.json, &report, out)
}
