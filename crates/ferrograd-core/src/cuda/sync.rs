//! Driver calls that make the host wait, counted in one place.
//!
//! A training step should queue work and return; every call that blocks the host until the device
//! catches up (`cuStreamSynchronize`, `cuEventSynchronize`, a device->host copy, `cuMemAlloc` and
//! `cuMemFree`, which synchronize implicitly, page-locking host memory, ...) costs the overlap that
//! asynchronous execution buys, and cannot be captured into a CUDA graph. So each of them goes
//! through `host_wait`, which
//!
//! - counts it, process-wide ([`sync_call_count`]) and per thread ([`SyncCounter`], what tests read
//!   around a training step), and
//! - refuses it with [`Error::GraphCapture`] while this thread captures a graph
//!   (`cuda::graph`), instead of letting the driver invalidate the capture or wait forever.
//!
//! Calls that do not wait but cannot be captured either (a copy from pageable host memory, a module
//! load) go through `not_capturable`, which only refuses.

use crate::Error;
use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicU64, Ordering};

static TOTAL: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// This thread's calls by name, in first-call order.
    static CALLS: RefCell<Vec<(&'static str, u64)>> = const { RefCell::new(Vec::new()) };
    /// Nesting depth of graph captures on this thread.
    static CAPTURING: Cell<u32> = const { Cell::new(0) };
    /// The first forbidden call attempted during the current capture.
    static VIOLATION: Cell<Option<&'static str>> = const { Cell::new(None) };
}

/// A call refused because this thread is capturing a CUDA graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Refused(pub &'static str);

impl From<Refused> for Error {
    fn from(r: Refused) -> Error {
        Error::GraphCapture { call: r.0 }
    }
}

impl From<Refused> for super::alloc::RawAllocError {
    fn from(r: Refused) -> Self {
        super::alloc::RawAllocError::Capture(r.0)
    }
}

/// Runs `f`, a driver call that makes the host wait, after counting it; refused while this thread
/// captures a CUDA graph.
pub(crate) fn host_wait<T, E: From<Refused>>(call: &'static str, f: impl FnOnce() -> Result<T, E>) -> Result<T, E> {
    not_capturable(call)?;
    count(call);
    f()
}

/// For destructors, which cannot fail: `f` runs and is counted even during a capture, which is then
/// marked failed (its `Graph::capture` returns the error naming `call`).
pub(crate) fn host_wait_in_drop(call: &'static str, f: impl FnOnce()) {
    let _ = not_capturable(call);
    count(call);
    f()
}

fn count(call: &'static str) {
    TOTAL.fetch_add(1, Ordering::Relaxed);
    CALLS.with_borrow_mut(|calls| match calls.iter_mut().find(|(c, _)| *c == call) {
        Some((_, n)) => *n += 1,
        None => calls.push((call, 1)),
    });
}

/// `Err` while this thread captures a graph (and the capture is marked failed).
pub(crate) fn not_capturable(call: &'static str) -> Result<(), Refused> {
    if CAPTURING.get() == 0 {
        return Ok(());
    }
    if VIOLATION.get().is_none() {
        VIOLATION.set(Some(call));
    }
    Err(Refused(call))
}

/// Whether this thread is capturing a CUDA graph.
pub fn is_capturing() -> bool {
    CAPTURING.get() > 0
}

/// Marks this thread as capturing until `end_capture`; clears the violation record of an outermost
/// capture.
pub(crate) fn begin_capture() {
    if CAPTURING.get() == 0 {
        VIOLATION.set(None);
    }
    CAPTURING.set(CAPTURING.get() + 1);
}

/// Ends a capture begun by `begin_capture`; returns the first forbidden call attempted in it.
pub(crate) fn end_capture() -> Option<&'static str> {
    CAPTURING.set(CAPTURING.get().saturating_sub(1));
    if CAPTURING.get() == 0 {
        VIOLATION.take()
    } else {
        VIOLATION.get()
    }
}

/// Host-waiting driver calls made by the whole process so far.
pub fn sync_call_count() -> u64 {
    TOTAL.load(Ordering::Relaxed)
}

/// Counts the host-waiting driver calls this thread makes from its creation on (other threads'
/// calls, such as a parallel test's, are not seen).
///
/// ```
/// let c = ferrograd_core::cuda::SyncCounter::start();
/// // ... a training step ...
/// assert_eq!(c.total(), 0, "{:?}", c.calls());
/// ```
#[derive(Debug, Clone)]
pub struct SyncCounter {
    start: Vec<(&'static str, u64)>,
}

impl SyncCounter {
    /// Start counting this thread's host-waiting driver calls.
    pub fn start() -> SyncCounter {
        SyncCounter { start: CALLS.with_borrow(|c| c.clone()) }
    }

    /// Calls made since `start`, by driver call name (those made at least once).
    pub fn calls(&self) -> Vec<(&'static str, u64)> {
        CALLS.with_borrow(|now| {
            now.iter()
                .map(|&(call, n)| (call, n - self.start.iter().find(|(c, _)| *c == call).map_or(0, |s| s.1)))
                .filter(|&(_, n)| n > 0)
                .collect()
        })
    }

    /// How many calls were made since `start`.
    pub fn total(&self) -> u64 {
        self.calls().iter().map(|(_, n)| n).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_per_thread_and_refuses_during_capture() -> crate::Result<()> {
        let c = SyncCounter::start();
        host_wait("cuStreamSynchronize", || Ok::<_, Error>(()))?;
        host_wait("cuStreamSynchronize", || Ok::<_, Error>(()))?;
        host_wait("cuMemFree", || Ok::<_, Error>(()))?;
        std::thread::spawn(|| host_wait("cuEventSynchronize", || Ok::<_, Error>(()))).join().ok();
        assert_eq!(c.calls(), vec![("cuStreamSynchronize", 2), ("cuMemFree", 1)]);
        assert_eq!(c.total(), 3);
        assert!(sync_call_count() >= 4);
        begin_capture();
        assert!(is_capturing());
        let mut ran = false;
        let e = host_wait("cuStreamSynchronize", || {
            ran = true;
            Ok::<_, Error>(())
        });
        assert!(matches!(e, Err(Error::GraphCapture { call: "cuStreamSynchronize" })), "{e:?}");
        assert!(!ran, "a refused call is not made");
        assert!(not_capturable("cuMemcpyHtoDAsync").is_err());
        assert_eq!(end_capture(), Some("cuStreamSynchronize"), "the first violation is reported");
        assert!(!is_capturing());
        assert_eq!(c.total(), 3, "refused calls are not counted");
        begin_capture();
        assert_eq!(end_capture(), None, "a new capture starts clean");
        Ok(())
    }
}
