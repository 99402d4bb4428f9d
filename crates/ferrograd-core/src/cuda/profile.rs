//! Opt-in device time per kernel name: with `FERROGRAD_PROFILE=1` every kernel launch and every
//! GEMM is bracketed by two timing events on the stream it runs on, and [`report`] sums the
//! elapsed times by name. A poor man's `nsys` for machines without one (the lent GPUs have no
//! Nsight Systems), used to find where a training step's time goes.
//!
//! Off (the default) it costs one relaxed atomic load per launch and makes no host wait. On, it
//! records events (no host wait either); only [`report`] waits for them. Nothing is recorded while a
//! CUDA graph is being captured (an event recorded into a capture is a graph node, not a timer).
//!
//! Every DMA on the copy stream (`cuda/transfer.rs`) is timed the same way, with its bytes, and
//! the callers note the bytes the user asked to move; [`transfer_metrics`] turns that into the memory
//! guide's figures: transfer bandwidth against the measured peak, transfer overhead (copy time not
//! hidden behind kernels, as a share of the profiled timeline), useful bytes per byte moved, and
//! overlap efficiency (the share of copy time during which a kernel ran). Times are placed on one
//! timeline through a base event, the first one recorded.

use super::device::CudaDevice;
use super::event::Event;
use crate::Result;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Mutex;

/// 0: not read yet, 1: off, 2: on.
static STATE: AtomicU8 = AtomicU8::new(0);

/// The direction of a timed copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyKind {
    /// Host to device.
    HtoD,
    /// Device to host.
    DtoH,
}

struct Pending {
    name: String,
    /// `Some((direction, bytes))` for a copy.
    copy: Option<(CopyKind, usize)>,
    start: Event,
    end: Event,
}

static PENDING: Mutex<Vec<Pending>> = Mutex::new(Vec::new());
/// The first event recorded: time zero of the timeline on which kernels and copies are compared.
static BASE: Mutex<Option<Event>> = Mutex::new(None);
/// Bytes the callers asked to move (tensor bytes), against the bytes the DMAs moved.
static USEFUL: AtomicU64 = AtomicU64::new(0);

/// Counts `bytes` of data a transfer delivers to its user (when profiling).
pub(crate) fn note_useful(bytes: usize) {
    if enabled() && !super::sync::is_capturing() {
        USEFUL.fetch_add(bytes as u64, Ordering::Relaxed);
    }
}

fn start_on(s: &cudarc::driver::CudaStream) -> Option<Event> {
    let start = Event::timing().ok()?;
    let mut base = BASE.lock().unwrap_or_else(|e| e.into_inner());
    if base.is_none() {
        let b = Event::timing().ok()?;
        b.record(s).ok()?;
        *base = Some(b);
    }
    start.record(s).ok()?;
    Some(start)
}

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

/// Turns profiling on or off from code (benches and tests), overriding `FERROGRAD_PROFILE`.
pub fn set_enabled(on: bool) {
    STATE.store(if on { 2 } else { 1 }, Ordering::Relaxed);
}

/// The memory metrics of everything recorded so far (`None` when no copy was recorded); clears
/// the record, as [`report`] does.
pub fn transfer_metrics() -> Result<Option<TransferMetrics>> {
    Ok(collect()?.1)
}

/// An open span: its end event is recorded by [`Span::end`].
pub(crate) struct Span {
    name: String,
    copy: Option<(CopyKind, usize)>,
    start: Event,
}

/// Starts timing `name` on `dev`'s current stream; `None` when profiling is off or capturing.
pub(crate) fn begin(dev: &CudaDevice, name: impl FnOnce() -> String) -> Option<Span> {
    if !enabled() || super::sync::is_capturing() {
        return None;
    }
    let start = start_on(dev.stream())?;
    Some(Span { name: name(), copy: None, start })
}

/// Starts timing a DMA of `bytes` on `dev`'s copy stream; `None` when profiling is off or capturing.
pub(crate) fn begin_copy(dev: &CudaDevice, kind: CopyKind, bytes: usize) -> Option<Span> {
    if !enabled() || super::sync::is_capturing() {
        return None;
    }
    let start = start_on(dev.copy_stream())?;
    let name = match kind {
        CopyKind::HtoD => "memcpy HtoD (copy stream)",
        CopyKind::DtoH => "memcpy DtoH (copy stream)",
    };
    Some(Span { name: name.to_string(), copy: Some((kind, bytes)), start })
}

impl Span {
    pub(crate) fn end(self, dev: &CudaDevice) {
        self.end_on(dev.stream())
    }

    pub(crate) fn end_copy(self, dev: &CudaDevice) {
        self.end_on(dev.copy_stream())
    }

    fn end_on(self, s: &cudarc::driver::CudaStream) {
        let Ok(end) = Event::timing() else { return };
        if end.record(s).is_ok() {
            let mut p = PENDING.lock().unwrap_or_else(|e| e.into_inner());
            p.push(Pending { name: self.name, copy: self.copy, start: self.start, end });
        }
    }
}

/// Forgets what was recorded so far (call after warm-up steps).
pub fn reset() {
    PENDING.lock().unwrap_or_else(|e| e.into_inner()).clear();
    USEFUL.store(0, Ordering::Relaxed);
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
    Ok(collect()?.0)
}

/// The rows and the memory metrics of everything recorded; clears the record.
fn collect() -> Result<(Vec<ProfileRow>, Option<TransferMetrics>)> {
    let pending = std::mem::take(&mut *PENDING.lock().unwrap_or_else(|e| e.into_inner()));
    let useful = USEFUL.swap(0, Ordering::Relaxed);
    let base = BASE.lock().unwrap_or_else(|e| e.into_inner());
    let mut by: HashMap<String, (usize, f64)> = HashMap::new();
    let (mut kernels, mut copies, mut moved) = (Vec::new(), Vec::new(), 0u64);
    for p in pending {
        p.end.synchronize()?;
        let ms = p.start.elapsed_ms(&p.end)? as f64;
        let e = by.entry(p.name).or_default();
        e.0 += 1;
        e.1 += ms;
        if let Some(b) = base.as_ref() {
            let t0 = b.elapsed_ms(&p.start)? as f64;
            match p.copy {
                Some((_, bytes)) => {
                    moved += bytes as u64;
                    copies.push((t0, t0 + ms));
                }
                None => kernels.push((t0, t0 + ms)),
            }
        }
    }
    let mut rows: Vec<ProfileRow> = by.into_iter().map(|(name, (calls, ms))| ProfileRow { name, calls, ms }).collect();
    rows.sort_by(|a, b| b.ms.total_cmp(&a.ms));
    let metrics = (!copies.is_empty()).then(|| TransferMetrics::from_intervals(&kernels, &copies, moved, useful));
    Ok((rows, metrics))
}

/// The memory guide's transfer metrics over a profiled run (see the module comment).
#[derive(Debug, Clone, PartialEq)]
pub struct TransferMetrics {
    /// Bytes the DMAs moved.
    pub bytes_moved: u64,
    /// Bytes the callers asked for (a compressed copy delivers twice what it moves; a coalesced
    /// one moves padding too).
    pub useful_bytes: u64,
    /// Milliseconds during which at least one copy ran.
    pub copy_ms: f64,
    /// Of those, milliseconds during which no kernel ran (exposed copy time).
    pub exposed_ms: f64,
    /// Milliseconds from the first recorded event to the last.
    pub span_ms: f64,
}

/// Total length of the union of `(start, end)` intervals.
fn union(iv: &[(f64, f64)]) -> Vec<(f64, f64)> {
    let mut v: Vec<(f64, f64)> = iv.iter().copied().filter(|(a, b)| b > a).collect();
    v.sort_by(|x, y| x.0.total_cmp(&y.0));
    let mut out: Vec<(f64, f64)> = Vec::with_capacity(v.len());
    for (a, b) in v {
        match out.last_mut() {
            Some(l) if a <= l.1 => l.1 = l.1.max(b),
            _ => out.push((a, b)),
        }
    }
    out
}

fn length(iv: &[(f64, f64)]) -> f64 {
    iv.iter().map(|(a, b)| b - a).sum()
}

impl TransferMetrics {
    /// From kernel and copy intervals (ms on one timeline) and the byte counts.
    pub fn from_intervals(kernels: &[(f64, f64)], copies: &[(f64, f64)], moved: u64, useful: u64) -> Self {
        let (k, c) = (union(kernels), union(copies));
        let copy_ms = length(&c);
        // Overlap of two sorted disjoint unions: walk both.
        let (mut i, mut j, mut both) = (0, 0, 0.0);
        while i < k.len() && j < c.len() {
            let lo = k[i].0.max(c[j].0);
            let hi = k[i].1.min(c[j].1);
            if hi > lo {
                both += hi - lo;
            }
            if k[i].1 < c[j].1 {
                i += 1;
            } else {
                j += 1;
            }
        }
        let all: Vec<(f64, f64)> = kernels.iter().chain(copies).copied().collect();
        let lo = all.iter().map(|x| x.0).fold(f64::INFINITY, f64::min);
        let hi = all.iter().map(|x| x.1).fold(f64::NEG_INFINITY, f64::max);
        TransferMetrics {
            bytes_moved: moved,
            useful_bytes: useful,
            copy_ms,
            exposed_ms: copy_ms - both,
            span_ms: if hi > lo { hi - lo } else { 0.0 },
        }
    }

    /// Achieved copy bandwidth while copying, GB/s (1e9 B/s).
    pub fn gbps(&self) -> f64 {
        self.bytes_moved as f64 / (self.copy_ms * 1e-3).max(1e-12) / 1e9
    }

    /// Exposed copy time as a share of the profiled timeline, percent.
    pub fn overhead_pct(&self) -> f64 {
        100.0 * self.exposed_ms / self.span_ms.max(1e-12)
    }

    /// Share of copy time hidden behind kernels, percent.
    pub fn overlap_pct(&self) -> f64 {
        100.0 * (self.copy_ms - self.exposed_ms) / self.copy_ms.max(1e-12)
    }

    /// Useful bytes per byte moved.
    pub fn useful_ratio(&self) -> f64 {
        self.useful_bytes as f64 / (self.bytes_moved as f64).max(1.0)
    }

    /// The metrics as lines for stderr; `peak_gbps` is the measured pinned copy peak, if known.
    pub fn lines(&self, peak_gbps: Option<f64>) -> String {
        let peak = match peak_gbps {
            Some(p) if p > 0.0 => format!(" = {:.0}% of the measured peak {p:.1} GB/s", 100.0 * self.gbps() / p),
            _ => String::new(),
        };
        format!(
            "transfers: {:.1} MB moved in {:.3} ms of copy time: {:.2} GB/s{peak}\n\
             transfer overhead: {:.3} ms exposed of a {:.3} ms timeline = {:.2}%\n\
             useful bytes / bytes moved: {:.1} MB / {:.1} MB = {:.3}\n\
             overlap efficiency: {:.1}% of copy time ran beside kernels\n",
            self.bytes_moved as f64 / 1e6,
            self.copy_ms,
            self.gbps(),
            self.exposed_ms,
            self.span_ms,
            self.overhead_pct(),
            self.useful_bytes as f64 / 1e6,
            self.bytes_moved as f64 / 1e6,
            self.useful_ratio(),
            self.overlap_pct(),
        )
    }
}

/// The pinned host-to-device copy bandwidth of `dev`, GB/s: the best of a few 64 MiB copies
/// timed with events on the copy stream (the peak the profile's bandwidth is compared with).
pub fn measure_peak_gbps(dev: &std::sync::Arc<CudaDevice>) -> Result<f64> {
    const BYTES: usize = 64 << 20;
    let host = super::pinned::PinnedBuf::new(dev, BYTES)?;
    let buf = super::buffer::CudaBuffer::uninit(dev, BYTES, crate::DType::U8)?;
    dev.synchronize()?;
    let s = dev.copy_stream();
    let mut best = 0f64;
    for _ in 0..3 {
        let (a, b) = (Event::timing()?, Event::timing()?);
        a.record(s)?;
        // SAFETY: pinned source and device destination both hold BYTES bytes; waited on below.
        unsafe {
            cudarc::driver::sys::cuMemcpyHtoDAsync_v2(buf.ptr(), host.as_ptr() as *const _, BYTES, s.cu_stream())
        }
        .result()
        .map_err(|e| super::device::driver_err("cuMemcpyHtoDAsync", e))?;
        b.record(s)?;
        b.synchronize()?;
        let ms = a.elapsed_ms(&b)? as f64;
        best = best.max(BYTES as f64 / (ms * 1e-3).max(1e-12) / 1e9);
    }
    Ok(best)
}

/// [`report`] as a table for stderr: per name the calls, ms per step and share of the total, over
/// `steps` steps.
pub fn report_table(steps: u64) -> Result<String> {
    let (rows, metrics) = collect()?;
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
    if let Some(m) = metrics {
        let peak = super::device::opened_devices().first().and_then(|d| measure_peak_gbps(d).ok());
        s += &m.lines(peak);
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_from_intervals() {
        // Kernels 0-10 and 20-30; copies 5-15 (half hidden) and 40-50 (exposed).
        let m = TransferMetrics::from_intervals(&[(0., 10.), (20., 30.)], &[(5., 15.), (40., 50.)], 2000, 3000);
        assert_eq!(m.copy_ms, 20.0);
        assert_eq!(m.exposed_ms, 15.0);
        assert_eq!(m.span_ms, 50.0);
        assert!((m.overlap_pct() - 25.0).abs() < 1e-9);
        assert!((m.overhead_pct() - 30.0).abs() < 1e-9);
        assert!((m.useful_ratio() - 1.5).abs() < 1e-12);
        // 2000 bytes in 20 ms.
        assert!((m.gbps() - 2000.0 / 0.02 / 1e9).abs() < 1e-12);
        // Overlapping copies count once.
        let m = TransferMetrics::from_intervals(&[], &[(0., 10.), (5., 12.)], 1, 1);
        assert_eq!((m.copy_ms, m.exposed_ms), (12.0, 12.0));
        let text = m.lines(Some(10.0));
        for key in
            ["transfers:", "transfer overhead:", "useful bytes / bytes moved:", "overlap efficiency:", "measured peak"]
        {
            assert!(text.contains(key), "{key} missing from {text}");
        }
    }
}
