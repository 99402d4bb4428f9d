//! Device-side timing with CUDA events on the compute stream (what benchmarks report): unaffected
//! by host-side jitter, and it measures the GPU work between two points, not the launch calls.

use super::device::CudaDevice;
use super::event::Event;
use crate::Result;

/// Times device work between [`GpuTimer::start`] and the end mark with two CUDA events.
pub struct GpuTimer {
    start: Event,
    end: Event,
}

impl GpuTimer {
    /// Two timing events.
    pub fn new() -> Result<GpuTimer> {
        Ok(GpuTimer { start: Event::timing()?, end: Event::timing()? })
    }

    /// Mark the start: everything queued on `dev`'s compute stream after this is timed.
    pub fn start(&self, dev: &CudaDevice) -> Result<()> {
        self.start.record(dev.stream())
    }

    /// Mark the end, wait for it, and return the elapsed device time in milliseconds.
    pub fn stop(&self, dev: &CudaDevice) -> Result<f64> {
        self.end.record(dev.stream())?;
        self.end.synchronize()?;
        Ok(self.start.elapsed_ms(&self.end)? as f64)
    }
}
