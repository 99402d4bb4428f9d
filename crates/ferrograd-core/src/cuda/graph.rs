//! CUDA graphs: record a step once, replay it with one launch (PyTorch's `torch.cuda.graph`).
//!
//! A [`Capture`] owns a side stream and a private memory pool. [`Capture::warmup`] runs a closure
//! eagerly on the side stream with every allocation served from the pool (kernels get loaded,
//! cuBLAS gets its workspace for the stream, the pool grows to what the step needs);
//! [`Capture::capture`] then records the same closure into a [`Graph`]. During capture nothing may
//! make the host wait or reach the driver's allocator: the allocator serves the pool's cached
//! blocks only, and every host-waiting call is refused (`cuda/sync.rs`), so a step that reads a
//! value back or needs new memory fails with [`Error::GraphCapture`] naming the call; the capture
//! is then ended cleanly and the device works on as before.
//!
//! The graph replays its kernels on the addresses they had during capture, so
//!
//! - inputs live in fixed buffers that the caller refills before each replay
//!   (`Tensor::set`), outputs are the tensors the capture returned, overwritten by each
//!   replay;
//! - the pool outlives the graph: blocks the step freed during capture are still written by every
//!   replay, so they return to the pool, never to the shared cache; the pool is released when the
//!   last graph using it and its `Capture` are gone.
//!
//! [`Graph::replay`] launches on the thread's current stream, ordered after the work queued there
//! (the input copies) and before what follows (reading the outputs).

use super::alloc::PoolId;
use super::device::{driver_err, CudaDevice};
use super::stream::Stream;
use super::sync;
use crate::{Error, Result};
use cudarc::driver::{result, sys, CudaGraph, CudaStream};
use std::sync::Arc;

/// A private pool of a device's allocator, released when dropped.
struct Pool {
    dev: Arc<CudaDevice>,
    id: PoolId,
}

impl Drop for Pool {
    fn drop(&mut self) {
        if let Err(e) = self.dev.allocator().release_pool(self.id) {
            // Only a broken driver fails here; the pool's memory then stays reserved.
            eprintln!("ferrograd: releasing graph pool {}: {e}", self.id.0);
        }
    }
}

/// Records work into CUDA graphs on a side stream, with memory from a private pool.
pub struct Capture {
    stream: Stream,
    pool: Arc<Pool>,
}

/// A captured CUDA graph. Replays run the recorded kernels on the recorded addresses.
pub struct Graph {
    // Dropped first: the executable graph goes before its memory.
    exec: CudaGraph,
    pool: Arc<Pool>,
}

/// Ends a begun capture if the closure panics, so the thread and the stream are not left capturing.
struct Recording<'a> {
    stream: &'a Arc<CudaStream>,
    open: bool,
}

impl Recording<'_> {
    fn finish(mut self) -> (Option<&'static str>, std::result::Result<Option<CudaGraph>, result::DriverError>) {
        self.open = false;
        let violation = sync::end_capture();
        (violation, self.stream.end_capture(sys::CUgraphInstantiate_flags(0)))
    }
}

impl Drop for Recording<'_> {
    fn drop(&mut self) {
        if self.open {
            sync::end_capture();
            let _ = self.stream.end_capture(sys::CUgraphInstantiate_flags(0));
        }
    }
}

impl Capture {
    /// A side stream of `dev` and a fresh private pool.
    pub fn new(dev: &Arc<CudaDevice>) -> Result<Capture> {
        let stream = dev.new_stream()?;
        let id = dev.allocator().create_pool();
        Ok(Capture { stream, pool: Arc::new(Pool { dev: dev.clone(), id }) })
    }

    /// The side stream work is recorded on.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// The private pool's id (`SegmentInfo::owner` of its memory).
    pub fn pool_id(&self) -> PoolId {
        self.pool.id
    }

    /// Runs `f` now, on the side stream with memory from the pool: what a capture of the same `f`
    /// needs (loaded kernels, a cuBLAS workspace for the stream, the pool's blocks) is ready
    /// afterwards. Work `f` queues counts (a training step trains).
    pub fn warmup<T>(&mut self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        self.on_side_stream(false, |_| f())
    }

    /// Records `f` into a graph without running it. Fails with [`Error::GraphCapture`] if `f`
    /// makes a forbidden call (a host read, an allocation the pool cannot serve, a synchronize),
    /// even if `f` itself swallowed that error; the device is usable afterwards either way.
    pub fn capture<T>(&mut self, f: impl FnOnce() -> Result<T>) -> Result<(Graph, T)> {
        let dev = self.pool.dev.clone();
        let (out, graph) = self.on_side_stream(true, |stream| {
            dev.ctx.bind_to_thread().map_err(|e| driver_err("cuCtxSetCurrent", e))?;
            stream
                .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .map_err(|e| driver_err("cuStreamBeginCapture", e))?;
            sync::begin_capture();
            let rec = Recording { stream, open: true };
            let out = f();
            let (violation, ended) = rec.finish();
            let out = match (out, violation) {
                (Err(e), _) => Err(e),
                (Ok(_), Some(call)) => Err(Error::GraphCapture { call }),
                (Ok(v), None) => Ok(v),
            };
            Ok((out, ended))
        })?;
        let out = out?;
        let exec = match graph {
            Ok(Some(g)) => g,
            Ok(None) => return Err(Error::Cuda("cuStreamEndCapture: the capture recorded no work".into())),
            Err(e) => return Err(driver_err("cuStreamEndCapture (the driver invalidated the capture)", e)),
        };
        // Uploads the graph's resources now, so that the first replay costs what the others do.
        exec.upload().map_err(|e| driver_err("cuGraphUpload", e))?;
        Ok((Graph { exec, pool: self.pool.clone() }, out))
    }

    /// Runs `f` with the side stream current and routed to the pool, ordered after the caller's
    /// queued work and before the caller's later work.
    fn on_side_stream<T>(&mut self, capturing: bool, f: impl FnOnce(&Arc<CudaStream>) -> Result<T>) -> Result<T> {
        let dev = self.pool.dev.clone();
        let caller = dev.current_stream();
        self.stream.wait_stream(&caller)?;
        dev.allocator().route(self.stream.id(), self.pool.id, capturing)?;
        let out = {
            let _current = self.stream.make_current();
            f(self.stream.cuda())
        };
        let unrouted = dev.allocator().unroute(self.stream.id());
        let joined = caller.wait_stream(&self.stream);
        let out = out?;
        unrouted?;
        joined?;
        Ok(out)
    }
}

impl Graph {
    /// Warms `f` up `warmups` times (at least once is needed unless `f` allocates nothing new)
    /// and captures it, on a fresh side stream and private pool of `dev`.
    pub fn capture<T>(dev: &Arc<CudaDevice>, warmups: usize, mut f: impl FnMut() -> Result<T>) -> Result<(Graph, T)> {
        let mut c = Capture::new(dev)?;
        for _ in 0..warmups {
            drop(c.warmup(&mut f)?);
        }
        c.capture(f)
    }

    /// Runs the recorded work once more, on this thread's current stream of the device.
    pub fn replay(&self) -> Result<()> {
        sync::not_capturable("cuGraphLaunch")?;
        let dev = &self.pool.dev;
        dev.ctx.bind_to_thread().map_err(|e| driver_err("cuCtxSetCurrent", e))?;
        // SAFETY: the executable graph is live, and so is every buffer it touches (the pool, and
        // the caller's tensors that the captured closure used).
        unsafe { result::graph::launch(self.exec.cu_graph_exec(), dev.stream().cu_stream()) }
            .map_err(|e| driver_err("cuGraphLaunch", e))
    }

    /// The private pool the graph's memory comes from.
    pub fn pool_id(&self) -> PoolId {
        self.pool.id
    }

    /// The device the graph runs on.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.pool.dev
    }
}
