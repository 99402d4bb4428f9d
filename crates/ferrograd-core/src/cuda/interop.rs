//! What crates outside core need to run device work beside the compute stream (NCCL collectives in
//! `ferrograd-dist`): the device's context, a stream of their own, and events that order that
//! stream with the compute stream in both directions. Kept apart from `device.rs` so that the
//! stream registry can take these over in one place.

use super::device::{driver_err, CudaDevice};
use super::event::Event;
use crate::Result;
use cudarc::driver::{CudaContext, CudaStream};
use std::sync::Arc;

impl CudaDevice {
    /// The device's (primary) context. Bind it (`bind_to_thread`) before driver or library calls
    /// made from another crate on this device.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// A new stream on this device for work that runs beside the compute stream (gradient
    /// communication). Work on it is ordered with compute only through `record_compute_event` and
    /// `compute_wait`. Should move to the stream registry once it exists.
    pub fn new_side_stream(&self) -> Result<Arc<CudaStream>> {
        self.ctx.new_stream().map_err(|e| driver_err("cuStreamCreate", e))
    }

    /// An event recorded on the compute stream now: another stream that waits on it sees every op
    /// queued so far.
    pub fn record_compute_event(&self) -> Result<Event> {
        self.ctx.bind_to_thread().map_err(|e| driver_err("cuCtxSetCurrent", e))?;
        let e = Event::new()?;
        e.record(self.stream())?;
        Ok(e)
    }

    /// Compute-stream work queued from now on waits (on the device; the host does not block) for
    /// the work before `e`.
    pub fn compute_wait(&self, e: &Event) -> Result<()> {
        self.ctx.bind_to_thread().map_err(|e| driver_err("cuCtxSetCurrent", e))?;
        e.wait_on(self.stream())
    }
}
