//! Timing for benchmarks: warm up, repeat within a time budget, report the median.
//!
//! The number of repetitions adapts to the cost of one run: cheap runs repeat until the budget is
//! spent (up to `max_reps`), costly ones stop at `min_reps`, so a slow baseline at a large size
//! still finishes in seconds.

use crate::CliResult;
use ferrograd_core::cuda::{CudaDevice, GpuTimer};
use ferrograd_core::Device;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy)]
pub struct Plan {
    /// Untimed runs first: page faults, thread-pool start-up, caches.
    pub warmup: usize,
    pub min_reps: usize,
    pub max_reps: usize,
    /// Timed runs stop once this much time was spent and `min_reps` are done.
    pub budget: Duration,
}

#[derive(Debug, Clone)]
pub struct Timing {
    /// Every timed run, in the order they ran.
    pub runs: Vec<Duration>,
}

impl Timing {
    pub fn median(&self) -> Duration {
        median(&self.runs)
    }
    pub fn min(&self) -> Duration {
        self.runs.iter().copied().min().unwrap_or_default()
    }
    pub fn reps(&self) -> usize {
        self.runs.len()
    }
}

/// Run `f` per `plan` and time each timed run. `f`'s result goes through `black_box` so the work
/// cannot be optimised away.
pub fn measure<T>(plan: Plan, mut f: impl FnMut() -> T) -> Timing {
    for _ in 0..plan.warmup {
        std::hint::black_box(f());
    }
    let max_reps = plan.max_reps.max(plan.min_reps).max(1);
    let mut runs = Vec::with_capacity(max_reps.min(1024));
    let start = Instant::now();
    while runs.len() < max_reps && (runs.len() < plan.min_reps.max(1) || start.elapsed() < plan.budget) {
        let t = Instant::now();
        std::hint::black_box(f());
        runs.push(t.elapsed());
    }
    Timing { runs }
}

/// Like [`measure`] for runs that time themselves (a host clock around a transfer and the
/// synchronize after it, say) and can fail: `f` returns the duration of its timed part.
pub fn measure_self_timed(plan: Plan, mut f: impl FnMut() -> CliResult<Duration>) -> CliResult<Timing> {
    for _ in 0..plan.warmup {
        f()?;
    }
    let max_reps = plan.max_reps.max(plan.min_reps).max(1);
    let mut runs = Vec::with_capacity(max_reps.min(1024));
    let start = Instant::now();
    while runs.len() < max_reps && (runs.len() < plan.min_reps.max(1) || start.elapsed() < plan.budget) {
        runs.push(f()?);
    }
    Ok(Timing { runs })
}

/// The median; the mean of the middle two for an even count; zero for none.
pub fn median(runs: &[Duration]) -> Duration {
    if runs.is_empty() {
        return Duration::ZERO;
    }
    let mut v = runs.to_vec();
    v.sort_unstable();
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2
    }
}

// ---------------------------------------------------------------------------------------------
// Timing work on a device: CUDA events for a GPU, the host clock for the CPU.
// ---------------------------------------------------------------------------------------------

/// How device work is timed. The same procedure is written out in `bench/benchlib.py`
/// (`time_device`), so the PyTorch twins are measured the way ours are:
///
/// 1. `warmup` untimed calls, then wait for the device (module loads, cuBLAS heuristics, the
///    allocator's first segments all happen here).
/// 2. One timed call estimates the cost `t` of a call; `inner = ceil(target_batch / t)` calls
///    (at most `max_inner`) then make one timed batch, so that a call of a few microseconds is
///    not drowned by the cost of recording the events and the GPU is not left idle between calls.
/// 3. Batches repeat until `min_reps` are done and `budget` of measured time is spent (or
///    `max_reps`). The figure is the median over batches of (batch time / inner).
#[derive(Debug, Clone, Copy)]
pub struct DevicePlan {
    pub warmup: usize,
    pub min_reps: usize,
    pub max_reps: usize,
    pub budget: Duration,
    pub target_batch: Duration,
    pub max_inner: usize,
}

impl DevicePlan {
    pub const GPU: DevicePlan = DevicePlan {
        warmup: 3,
        min_reps: 10,
        max_reps: 200,
        budget: Duration::from_millis(300),
        target_batch: Duration::from_millis(1),
        max_inner: 1000,
    };
}

/// Per-call times (seconds), one per timed batch, and the batch length.
#[derive(Debug, Clone)]
pub struct DeviceTiming {
    pub per_call_s: Vec<f64>,
    pub inner: usize,
}

impl DeviceTiming {
    pub fn median_s(&self) -> f64 {
        median_f64(&self.per_call_s)
    }
    pub fn min_s(&self) -> f64 {
        self.per_call_s.iter().copied().fold(f64::INFINITY, f64::min)
    }
    pub fn reps(&self) -> usize {
        self.per_call_s.len()
    }
}

/// A stopwatch for work queued on `device`: CUDA events on the compute stream for a GPU, the host
/// clock for the CPU (where ops run synchronously).
pub enum Clock {
    Cpu,
    Gpu { dev: Arc<CudaDevice>, timer: GpuTimer },
}

impl Clock {
    pub fn new(device: Device) -> CliResult<Clock> {
        Ok(match device {
            Device::Cpu => Clock::Cpu,
            Device::Cuda(n) => Clock::Gpu { dev: CudaDevice::get(n)?, timer: GpuTimer::new()? },
        })
    }

    pub fn synchronize(&self) -> CliResult<()> {
        if let Clock::Gpu { dev, .. } = self {
            dev.synchronize()?;
        }
        Ok(())
    }

    /// Seconds that `calls` runs of `f` take on the device.
    pub fn time<T>(&self, calls: usize, f: &mut dyn FnMut() -> ferrograd_core::Result<T>) -> CliResult<f64> {
        match self {
            Clock::Cpu => {
                let t = Instant::now();
                for _ in 0..calls {
                    std::hint::black_box(f()?);
                }
                Ok(t.elapsed().as_secs_f64())
            }
            Clock::Gpu { dev, timer } => {
                timer.start(dev)?;
                for _ in 0..calls {
                    std::hint::black_box(f()?);
                }
                Ok(timer.stop(dev)? / 1e3)
            }
        }
    }
}

/// Time `f` on `clock` per `plan` (see [`DevicePlan`]).
pub fn measure_device<T>(
    clock: &Clock,
    plan: DevicePlan,
    mut f: impl FnMut() -> ferrograd_core::Result<T>,
) -> CliResult<DeviceTiming> {
    for _ in 0..plan.warmup {
        std::hint::black_box(f()?);
    }
    clock.synchronize()?;
    let one = clock.time(1, &mut f)?;
    let target = plan.target_batch.as_secs_f64();
    let inner =
        if one <= 0.0 { plan.max_inner } else { (target / one).ceil() as usize }.clamp(1, plan.max_inner.max(1));
    let max_reps = plan.max_reps.max(plan.min_reps).max(1);
    let mut per_call_s = Vec::with_capacity(max_reps);
    let mut spent = 0.0;
    while per_call_s.len() < max_reps && (per_call_s.len() < plan.min_reps.max(1) || spent < plan.budget.as_secs_f64())
    {
        let t = clock.time(inner, &mut f)?;
        spent += t;
        per_call_s.push(t / inner as f64);
    }
    Ok(DeviceTiming { per_call_s, inner })
}

/// The median of finite values; NaN for none.
pub fn median_f64(v: &[f64]) -> f64 {
    let mut v: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: &[u64]) -> Vec<Duration> {
        v.iter().map(|&x| Duration::from_millis(x)).collect()
    }

    #[test]
    fn median_odd_even_empty() {
        assert_eq!(median(&ms(&[5, 1, 3])), Duration::from_millis(3));
        assert_eq!(median(&ms(&[4, 1, 3, 2])), Duration::from_micros(2500));
        assert_eq!(median(&[]), Duration::ZERO);
    }

    #[test]
    fn reps_respect_min_and_max() {
        let mut calls = 0;
        let plan = Plan { warmup: 2, min_reps: 3, max_reps: 5, budget: Duration::from_secs(60) };
        let t = measure(plan, || calls += 1);
        assert_eq!(t.reps(), 5);
        assert_eq!(calls, 7);

        let plan = Plan { warmup: 0, min_reps: 3, max_reps: 100, budget: Duration::ZERO };
        assert_eq!(measure(plan, || ()).reps(), 3);
    }

    #[test]
    fn self_timed_runs_use_the_returned_durations() {
        let plan = Plan { warmup: 1, min_reps: 3, max_reps: 3, budget: Duration::ZERO };
        let mut k = 0u64;
        let t = measure_self_timed(plan, || {
            k += 1;
            Ok(Duration::from_millis(k))
        })
        .unwrap();
        assert_eq!(t.runs, ms(&[2, 3, 4]));
        assert!(measure_self_timed(plan, || Err("no".into())).is_err());
    }

    #[test]
    fn median_f64_skips_nan() {
        assert_eq!(median_f64(&[3.0, f64::NAN, 1.0, 2.0]), 2.0);
        assert_eq!(median_f64(&[4.0, 1.0]), 2.5);
        assert!(median_f64(&[]).is_nan());
    }

    #[test]
    fn device_timing_on_the_cpu_batches_cheap_calls() {
        let clock = Clock::new(Device::Cpu).unwrap();
        let plan = DevicePlan {
            warmup: 1,
            min_reps: 4,
            max_reps: 4,
            budget: Duration::ZERO,
            target_batch: Duration::from_micros(200),
            max_inner: 50,
        };
        let mut calls = 0usize;
        let t = measure_device(&clock, plan, || {
            calls += 1;
            Ok(std::hint::black_box(calls))
        })
        .unwrap();
        assert_eq!(t.reps(), 4);
        assert!(t.inner >= 1 && t.inner <= 50);
        assert_eq!(calls, 1 + 1 + 4 * t.inner);
        assert!(t.median_s() >= 0.0 && t.min_s() <= t.median_s());
    }

    #[test]
    fn device_timing_passes_errors_on() {
        let clock = Clock::new(Device::Cpu).unwrap();
        let r = measure_device(&clock, DevicePlan::GPU, || -> ferrograd_core::Result<()> {
            Err(ferrograd_core::Error::InvalidArgument("boom".into()))
        });
        assert!(r.unwrap_err().to_string().contains("boom"));
    }
}
