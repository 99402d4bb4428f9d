//! Where a training run's start goes: the wall time of each phase from process start to the first
//! replayed step (device open, model init, optimizer state, data, each of the first steps: eager
//! warm-ups, the capture), beside the backend's one-time costs that those phases paid lazily
//! (`ferrograd_core::cuda::startup`: context, cuBLAS, kernel modules, cuBLASLt and cuDNN plans,
//! `cuMemAlloc`). The summary's `startup_s` is the sum up to the end of the first step.
//!
//! On with `FERROGRAD_PROFILE=1` (which also times every kernel, adding events to the first
//! steps) or `FERROGRAD_PROFILE_STARTUP=1` (the breakdown alone). When on, each phase ends with a
//! device synchronize, so that queued work is charged to the phase that queued it; off, nothing
//! is recorded and nothing waits.

use ferrograd_core::cuda::startup;
use ferrograd_core::Device;
use std::fmt::Write;
use std::time::{Duration, Instant};

/// Whether the breakdown was asked for (read once).
pub fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let set = |k: &str| std::env::var(k).is_ok_and(|v| !v.is_empty() && v != "0");
    *ON.get_or_init(|| set("FERROGRAD_PROFILE") || set("FERROGRAD_PROFILE_STARTUP"))
}

/// The phases of one run's start, in order.
pub struct StartupLog {
    started: Instant,
    last: Instant,
    device: Device,
    on: bool,
    phases: Vec<(String, Duration)>,
    printed: bool,
}

impl StartupLog {
    /// A log whose first phase starts at `started` (the process start); records only when
    /// [`enabled`].
    pub fn new(started: Instant, device: Device) -> StartupLog {
        StartupLog { started, last: started, device, on: enabled(), phases: vec![], printed: false }
    }

    /// A log that records nothing (library callers that time nothing).
    pub fn off() -> StartupLog {
        let now = Instant::now();
        StartupLog { started: now, last: now, device: Device::Cpu, on: false, phases: vec![], printed: false }
    }

    /// Seconds since the process start.
    pub fn elapsed_s(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    /// Whether phases are being recorded.
    pub fn is_on(&self) -> bool {
        self.on
    }

    /// End the current phase, naming it `what` (after waiting for the device's queued work).
    pub fn mark(&mut self, what: impl Into<String>) {
        if !self.on {
            return;
        }
        if self.device.is_cuda() {
            // A failed wait shows up at the run's next host read; the breakdown only loses accuracy.
            let _ = self.device.synchronize();
        }
        let now = Instant::now();
        self.phases.push((what.into(), now - self.last));
        self.last = now;
    }

    /// The breakdown as a table, the backend's one-time costs after it.
    pub fn report(&self) -> String {
        let mut s = String::from("startup breakdown (wall time, each phase ended by a device synchronize):\n");
        let width = self.phases.iter().map(|p| p.0.len()).max().unwrap_or(0).max(36);
        for (what, d) in &self.phases {
            let _ = writeln!(s, "  {what:<width$} {:>9.3} s", d.as_secs_f64());
        }
        let _ = writeln!(s, "  {:<width$} {:>9.3} s", "total", (self.last - self.started).as_secs_f64());
        let costs = startup::costs();
        if !costs.is_empty() {
            let _ = writeln!(s, "one-time costs paid inside those phases:");
            for (c, n, d) in costs {
                let _ = writeln!(s, "  {:<width$} {:>9.3} s  ({n} calls)", c.name(), d.as_secs_f64());
            }
        }
        s
    }

    /// Print the breakdown to stderr once (when on).
    pub fn print_once(&mut self) {
        if self.on && !self.printed {
            self.printed = true;
            eprint!("{}", self.report());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_are_listed_in_order_with_a_total() {
        let mut log = StartupLog::off();
        log.on = true;
        log.mark("first");
        log.mark("second");
        let r = log.report();
        let (a, b) = (r.find("first").expect("listed"), r.find("second").expect("listed"));
        assert!(a < b && r.contains("total"));
        let mut quiet = StartupLog::off();
        quiet.mark("nothing");
        assert!(!quiet.report().contains("nothing"));
    }
}
