//! The collective operations every backend provides (`Communicator`): NCCL on GPUs for real runs,
//! and, as test scaffolding, an in-process group of threads (`testing::ThreadComm`) and a world of
//! one (`Solo`). All operations work in place on one contiguous tensor, so that data parallel
//! training can hand its flat gradient buckets over without copies:
//!
//! - `all_reduce(buf, op)`: every rank ends with the reduction of all ranks' `buf`;
//! - `reduce_scatter(buf, op)`: `buf` holds `world` equal chunks; chunk `rank` ends with the
//!   reduction of all ranks' chunk `rank` (the other chunks are left as they were);
//! - `all_gather(buf)`: chunk `rank` is this rank's contribution; every chunk ends filled;
//! - `broadcast(buf, root)`, `send(buf, peer)`, `recv(buf, peer)`.
//!
//! On a GPU an operation is queued on the communication stream after the compute work queued so
//! far (an event) and returns a `Work` at once; `Work::wait` orders later compute work after it
//! without blocking the host, `Work::synchronize` blocks the host (bounded by a timeout).

use crate::error::{DistError, DistResult};
use ferrograd_core::cuda::event::Event;
use ferrograd_core::cuda::CudaDevice;
use ferrograd_core::{DType, Device, Tensor};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    /// Sum divided by the world size.
    Avg,
    Min,
    Max,
}

/// Counters of what a communicator moved, and (where timing is on) how long its operations took
/// on the communication stream.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CommStats {
    pub calls: u64,
    pub bytes: u64,
    /// Summed device time of the timed operations, milliseconds.
    pub device_ms: f64,
    pub timed_calls: u64,
}

pub trait Communicator: Send + Sync {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// Where this rank's buffers must live.
    fn device(&self) -> Device;
    /// "nccl", "threads" or "solo".
    fn backend(&self) -> &'static str;

    fn all_reduce(&self, buf: &Tensor, op: ReduceOp) -> DistResult<Work>;
    fn reduce_scatter(&self, buf: &Tensor, op: ReduceOp) -> DistResult<Work>;
    fn all_gather(&self, buf: &Tensor) -> DistResult<Work>;
    fn broadcast(&self, buf: &Tensor, root: usize) -> DistResult<Work>;
    fn send(&self, buf: &Tensor, peer: usize) -> DistResult<Work>;
    fn recv(&self, buf: &Tensor, peer: usize) -> DistResult<Work>;

    /// Send `send` to rank `to` and receive `recv` from rank `from` as one step (NCCL groups the
    /// pair, so two ranks exchanging with each other cannot wait on one another).
    fn send_recv(&self, send: &Tensor, to: usize, recv: &Tensor, from: usize) -> DistResult<Work> {
        self.send(send, to)?.wait()?;
        self.recv(recv, from)
    }

    /// Block until every rank has reached this point.
    fn barrier(&self) -> DistResult<()>;

    /// `Ok` where this communicator's operations can be recorded into a CUDA graph by stream
    /// capture (and replayed with it), else why not. A training step whose gradient all-reduces
    /// are captured with it is one graph launch per step; otherwise the step runs eagerly.
    fn graph_capturable(&self) -> Result<(), String> {
        Err(format!("{} collectives cannot be recorded in a CUDA graph", self.backend()))
    }

    /// This rank has failed with `reason` and will post no more operations: wake every rank
    /// waiting on it with an error naming the reason (the thread communicator does). NCCL has no
    /// way to tell its peers, so the default does nothing: under `ferrograd launch` the launcher
    /// stops the other ranks when this one exits, and host waits time out.
    fn abort(&self, _reason: &str) {}

    /// Time every operation on the device from now on (`stats().device_ms`); costs two events
    /// per operation. Backends without a device clock ignore it.
    fn set_timing(&self, _on: bool) {}

    /// What was moved so far; reading timings waits for the timed operations to finish.
    fn stats(&self) -> DistResult<CommStats> {
        Ok(CommStats::default())
    }
}

/// The element types collectives accept: NCCL has a type for each of ferrograd's dtypes.
pub fn check_dtype(op: &'static str, t: &Tensor) -> DistResult<()> {
    let ok = matches!(
        t.dtype(),
        DType::F32 | DType::F64 | DType::F16 | DType::BF16 | DType::I32 | DType::U32 | DType::U8 | DType::I8
    );
    if !ok {
        return Err(DistError::Collective { op, msg: format!("dtype {} is not supported", t.dtype()) });
    }
    Ok(())
}

/// A buffer must be contiguous and on the communicator's device; for the chunked operations its
/// length must split into `world` equal chunks.
pub fn check_buffer(op: &'static str, comm: &dyn Communicator, buf: &Tensor, chunked: bool) -> DistResult<()> {
    check_dtype(op, buf)?;
    if buf.device() != comm.device() {
        return Err(DistError::Collective {
            op,
            msg: format!("buffer is on {}, this rank communicates on {}", buf.device(), comm.device()),
        });
    }
    if !buf.is_contiguous() {
        return Err(DistError::Collective { op, msg: format!("buffer of shape {:?} is not contiguous", buf.dims()) });
    }
    if chunked && !buf.elem_count().is_multiple_of(comm.world_size()) {
        return Err(DistError::Collective {
            op,
            msg: format!("{} elements do not split into {} equal chunks", buf.elem_count(), comm.world_size()),
        });
    }
    Ok(())
}

pub fn check_peer(op: &'static str, comm: &dyn Communicator, peer: usize) -> DistResult<()> {
    if peer >= comm.world_size() || peer == comm.rank() {
        return Err(DistError::Collective {
            op,
            msg: format!(
                "peer {peer} is not another rank of a world of {} (this is rank {})",
                comm.world_size(),
                comm.rank()
            ),
        });
    }
    Ok(())
}

/// Checks whether the communicator has failed (NCCL's asynchronous error), for host waits.
pub type HealthCheck = Arc<dyn Fn() -> DistResult<()> + Send + Sync>;

/// An operation in flight. Dropping it without `wait` still orders later compute work after it
/// (so no buffer it uses can be reused too early).
pub struct Work {
    pending: Option<Pending>,
}

struct Pending {
    op: &'static str,
    dev: Arc<CudaDevice>,
    done: Event,
    /// Buffers the operation reads or writes: alive until compute is ordered after it.
    _keep: Vec<Tensor>,
    health: Option<HealthCheck>,
}

impl std::fmt::Debug for Work {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.pending {
            None => write!(f, "Work(done)"),
            Some(p) => write!(f, "Work({} on cuda:{})", p.op, p.dev.ordinal),
        }
    }
}

impl Work {
    /// An operation that completed before returning (host backends).
    pub fn done() -> Work {
        Work { pending: None }
    }

    /// An operation queued on a device stream; `done` is recorded after it.
    pub fn queued(
        op: &'static str,
        dev: Arc<CudaDevice>,
        done: Event,
        keep: Vec<Tensor>,
        health: Option<HealthCheck>,
    ) -> Work {
        Work { pending: Some(Pending { op, dev, done, _keep: keep, health }) }
    }

    pub fn is_done(&self) -> bool {
        self.pending.as_ref().is_none_or(|p| p.done.is_done())
    }

    /// Compute work queued from now on runs after this operation; the host does not wait.
    pub fn wait(mut self) -> DistResult<()> {
        match self.pending.take() {
            None => Ok(()),
            Some(p) => Ok(p.dev.compute_wait(&p.done)?),
        }
    }

    /// Block the host until the operation has finished, polling the communicator's health; fails
    /// after `timeout` (a peer that died leaves a collective waiting for ever).
    pub fn synchronize(mut self, timeout: Duration) -> DistResult<()> {
        let Some(p) = self.pending.take() else { return Ok(()) };
        let start = Instant::now();
        let mut nap = Duration::from_micros(20);
        while !p.done.is_done() {
            if let Some(h) = &p.health {
                h()?;
            }
            if start.elapsed() > timeout {
                // Leave the buffers alive: the operation may still write them.
                std::mem::forget(p._keep);
                return Err(DistError::Timeout { op: p.op.to_string(), waited: start.elapsed() });
            }
            std::thread::sleep(nap);
            nap = (nap * 2).min(Duration::from_millis(2));
        }
        Ok(p.dev.compute_wait(&p.done)?)
    }
}

impl Drop for Work {
    fn drop(&mut self) {
        if let Some(p) = self.pending.take() {
            // Best effort: failing here means the driver is gone, and the process with it.
            let _ = p.dev.compute_wait(&p.done);
        }
    }
}

/// The world of one process: every operation is the identity (and a rank's only peer is itself,
/// so send and receive are refused).
pub struct Solo {
    device: Device,
}

impl Solo {
    pub fn new(device: Device) -> Solo {
        Solo { device }
    }
}

impl Communicator for Solo {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn device(&self) -> Device {
        self.device
    }
    fn backend(&self) -> &'static str {
        "solo"
    }
    fn all_reduce(&self, buf: &Tensor, _op: ReduceOp) -> DistResult<Work> {
        check_buffer("all_reduce", self, buf, false)?;
        Ok(Work::done())
    }
    fn reduce_scatter(&self, buf: &Tensor, _op: ReduceOp) -> DistResult<Work> {
        check_buffer("reduce_scatter", self, buf, true)?;
        Ok(Work::done())
    }
    fn all_gather(&self, buf: &Tensor) -> DistResult<Work> {
        check_buffer("all_gather", self, buf, true)?;
        Ok(Work::done())
    }
    fn broadcast(&self, buf: &Tensor, root: usize) -> DistResult<Work> {
        check_buffer("broadcast", self, buf, false)?;
        if root != 0 {
            return Err(DistError::Collective { op: "broadcast", msg: format!("root {root} in a world of 1") });
        }
        Ok(Work::done())
    }
    fn send(&self, _buf: &Tensor, peer: usize) -> DistResult<Work> {
        check_peer("send", self, peer)?;
        Ok(Work::done())
    }
    fn recv(&self, _buf: &Tensor, peer: usize) -> DistResult<Work> {
        check_peer("recv", self, peer)?;
        Ok(Work::done())
    }
    fn barrier(&self) -> DistResult<()> {
        Ok(())
    }
    fn graph_capturable(&self) -> Result<(), String> {
        // Every operation is the identity: nothing to record.
        Ok(())
    }
}
