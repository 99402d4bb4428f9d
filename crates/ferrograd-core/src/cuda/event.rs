//! A CUDA event with RAII destruction (what orders streams: record on one, wait on another), and
//! the device's list of host objects that must outlive asynchronous copies (pinned buffers, pinned
//! tensors) until the copy's event completes.

use super::device::driver_err;
use crate::Result;
use cudarc::driver::{result, sys, CudaStream};

/// A CUDA event (destroyed on drop): record on one stream, wait on or poll from another.
pub struct Event(sys::CUevent);

// SAFETY: an event handle is usable from any thread.
unsafe impl Send for Event {}
unsafe impl Sync for Event {}

impl Event {
    /// An event without timing (cheaper to record and wait on).
    pub fn new() -> Result<Event> {
        result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map(Event)
            .map_err(|e| driver_err("cuEventCreate", e))
    }

    /// An event that can time work (for benchmarks).
    pub fn timing() -> Result<Event> {
        result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
            .map(Event)
            .map_err(|e| driver_err("cuEventCreate", e))
    }

    /// Record it on `s`: it completes when the work queued on `s` before it has finished.
    pub fn record(&self, s: &CudaStream) -> Result<()> {
        // SAFETY: both handles are live.
        unsafe { result::event::record(self.0, s.cu_stream()) }.map_err(|e| driver_err("cuEventRecord", e))
    }

    /// Make `s` wait (on the device) for the work before this event.
    pub fn wait_on(&self, s: &CudaStream) -> Result<()> {
        // SAFETY: both handles are live.
        unsafe { result::stream::wait_event(s.cu_stream(), self.0, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT) }
            .map_err(|e| driver_err("cuStreamWaitEvent", e))
    }

    /// Blocks the host until the work before this event is done (a counted host wait).
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: the event is live.
        super::sync::host_wait("cuEventSynchronize", || {
            unsafe { result::event::synchronize(self.0) }.map_err(|e| driver_err("cuEventSynchronize", e))
        })
    }

    /// Whether the work before it has finished (a poll; never waits).
    pub fn is_done(&self) -> bool {
        // SAFETY: the event is live.
        unsafe { result::event::query(self.0) }.is_ok()
    }

    /// Milliseconds between two recorded timing events.
    pub fn elapsed_ms(&self, end: &Event) -> Result<f32> {
        // SAFETY: both events are live and recorded.
        unsafe { result::event::elapsed(self.0, end.0) }.map_err(|e| driver_err("cuEventElapsedTime", e))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: owned handle, destroyed once.
        let _ = unsafe { result::event::destroy(self.0) };
    }
}

/// Host objects kept alive until an event completes.
#[derive(Default)]
pub struct Pending(Vec<(Event, Box<dyn Send + Sync>)>);

impl Pending {
    /// Keep `keep` alive until `e` completes.
    pub fn push(&mut self, e: Event, keep: Box<dyn Send + Sync>) {
        self.0.push((e, keep));
    }

    /// Drop what finished copies no longer need.
    pub fn collect(&mut self) {
        self.0.retain(|(e, _)| !e.is_done());
    }

    /// Wait for every event, then drop what they kept.
    pub fn wait_all(&mut self) -> Result<()> {
        for (e, _) in &self.0 {
            e.synchronize()?;
        }
        self.0.clear();
        Ok(())
    }
}
