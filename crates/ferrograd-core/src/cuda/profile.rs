//! Opt-in device time per kernel name: with `FERROGRAD_PROFILE=1` every kernel launch and every
//! GEMM is bracketed by two timing events on the stream it runs on, and [`report`] sums the
//! elapsed times by name. A poor man's `nsys` for machines without one (the lent GPUs have no
//! Nsight Systems), used to find where a training step's time goes.
//!
//! Off (the default) it costs one relaxed atomic load per launch and makes no host wait. On, it
//! records events (no host wait either); only [`report`] waits for them. Nothing is recorded while a
//! CUDA graph is being captured (an event recorded into a capture is a graph node, not a timer).

use super::device::CudaDevice;
use super::event::Event;
use crate::Result;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Mutex;

/// 0: not read yet, 1: off, 2: on.
static STATE: AtomicU8 = AtomicU8::new(0);

struct Pending {
    name: String,
    start: Event,
    end: Event,
}

static PENDING: Mutex<Vec<Pending>> = Mutex::new(Vec::new());

/// Whether `FERROGRAD_PROFILE` asks for per-kernel timing (read once).
pub fn enabled() -> bool {
    match STATE.load(Ordering::Relaxed) {
        1 => false,
        2 => true,
        _ => {
            let on = std::env::var("FERROGRAD_PROFILE").is_ok_and(|v| !v.is_empty() && v != "0");
            STATE.store(if on { 2 } else { 1 }, Ordering::Relaxed);
            on
        }
    }
}

/// An open span: its end event is recorded by [`Span::end`].
pub(crate) struct Span {
    name: String,
    start: Event,
}

/// Starts timing `name` on `dev`'s current stream; `None` when profiling is off or capturing.
pub(crate) fn begin(dev: &CudaDevice, name: impl FnOnce() -> String) -> Option<Span> {
    if !enabled() || super::sync::is_capturing() {
        return None;
    }
    let start = Event::timing().ok()?;
    start.record(dev.stream()).ok()?;
    Some(Span { name: name(), start })
}

impl Span {
    pub(crate) fn end(self, dev: &CudaDevice) {
        let Ok(end) = Event::timing() else { return };
        if end.record(dev.stream()).is_ok() {
            let mut p = PENDING.lock().unwrap_or_else(|e| e.into_inner());
            p.push(Pending { name: self.name, start: self.start, end });
        }
    }
}

/// Forgets what was recorded so far (call after warm-up steps).
pub fn reset() {
    PENDING.lock().unwrap_or_else(|e| e.into_inner()).clear();
}

/// One row of [`report`]: a kernel (or GEMM) name, its launches and their summed device time.
#[derive(Debug, Clone)]
pub struct ProfileRow {
    /// Kernel or GEMM name.
    pub name: String,
    /// Launches.
    pub calls: usize,
    /// Summed device time in milliseconds.
    pub ms: f64,
}

/// Waits for the recorded events and returns the time per name, largest first; clears the record.
pub fn report() -> Result<Vec<ProfileRow>> {
    let pending = std::mem::take(&mut *PENDING.lock().unwrap_or_else(|e| e.into_inner()));
    let mut by: HashMap<String, (usize, f64)> = HashMap::new();
    for p in pending {
        p.end.synchronize()?;
        let ms = p.start.elapsed_ms(&p.end)? as f64;
        let e = by.entry(p.name).or_default();
        e.0 += 1;
        e.1 += ms;
    }
    let mut rows: Vec<ProfileRow> = by.into_iter().map(|(name, (calls, ms))| ProfileRow { name, calls, ms }).collect();
    rows.sort_by(|a, b| b.ms.total_cmp(&a.ms));
    Ok(rows)
}

/// [`report`] as a table for stderr: per name the calls, ms per step and share of the total, over
/// `steps` steps.
pub fn report_table(steps: u64) -> Result<String> {
    let rows = report()?;
    let total: f64 = rows.iter().map(|r| r.ms).sum();
    let steps = steps.max(1) as f64;
    let mut s = format!("ferrograd profile: {:.2} ms of kernels per step over {steps} steps\n", total / steps);
    s += &format!("{:>9} {:>7} {:>6}  kernel\n", "ms/step", "calls", "%");
    for r in rows.iter().take(60) {
        s += &format!(
            "{:>9.3} {:>7.1} {:>6.2}  {}\n",
            r.ms / steps,
            r.calls as f64 / steps,
            100.0 * r.ms / total.max(1e-12),
            r.name
        );
    }
    Ok(s)
}
