//! NCCL behind the `Communicator` trait. Each communicator owns a communication stream on its
//! GPU; every operation waits (on the device) for the compute work queued before it, runs on that
//! stream, and records an event that later compute waits on (`Work::wait`), so gradient
//! communication overlaps the rest of backward. Calls into one communicator are serialised (NCCL
//! requires it); failures are typed errors naming the operation and NCCL's reason.

pub mod lib;

pub use lib::{available, candidates, nccl, NcclLib};

use crate::comm::{check_buffer, check_peer, CommStats, Communicator, HealthCheck, ReduceOp, Work};
use crate::error::{DistError, DistResult};
use crate::rendezvous::ID_BYTES;
use cudarc::driver::CudaStream;
use cudarc::nccl::sys::{cudaStream_t, ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclUniqueId};
use ferrograd_core::cuda::event::Event;
use ferrograd_core::cuda::CudaDevice;
use ferrograd_core::{DType, Device, Tensor};
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

fn dtype(d: DType) -> ncclDataType_t {
    match d {
        DType::F32 => ncclDataType_t::ncclFloat32,
        DType::F64 => ncclDataType_t::ncclFloat64,
        DType::F16 => ncclDataType_t::ncclFloat16,
        DType::BF16 => ncclDataType_t::ncclBfloat16,
        DType::I32 => ncclDataType_t::ncclInt32,
        DType::U32 => ncclDataType_t::ncclUint32,
        DType::U8 => ncclDataType_t::ncclUint8,
        DType::I8 => ncclDataType_t::ncclInt8,
    }
}

/// The first NCCL whose collectives stream capture records into a CUDA graph.
const CAPTURE_VERSION: i32 = 20900;

fn red_op(op: ReduceOp) -> ncclRedOp_t {
    match op {
        ReduceOp::Sum => ncclRedOp_t::ncclSum,
        ReduceOp::Avg => ncclRedOp_t::ncclAvg,
        ReduceOp::Min => ncclRedOp_t::ncclMin,
        ReduceOp::Max => ncclRedOp_t::ncclMax,
    }
}

/// The communication stream of a device. Created here, through the device's context, until the
/// stream registry (`runtime`'s work on core's cuda/) hands out user streams: then this is the one
/// place to change.
pub fn communication_stream(dev: &CudaDevice) -> DistResult<Arc<CudaStream>> {
    Ok(dev.new_side_stream()?)
}

#[derive(Default)]
struct Accounting {
    calls: u64,
    bytes: u64,
    pending: Vec<(Event, Event)>,
    device_ms: f64,
    timed: u64,
}

struct Inner {
    lib: &'static NcclLib,
    comm: ncclComm_t,
    rank: usize,
    world: usize,
    dev: Arc<CudaDevice>,
    stream: Arc<CudaStream>,
    /// Serialises calls into the communicator.
    lock: Mutex<()>,
    failed: AtomicBool,
    timing: AtomicBool,
    acct: Mutex<Accounting>,
    timeout: Duration,
}

// SAFETY: the communicator handle is used only under `lock` (or, in `health`, through
// ncclCommGetAsyncError, which NCCL allows from any thread at any time).
unsafe impl Send for Inner {}
unsafe impl Sync for Inner {}

pub struct NcclComm {
    inner: Arc<Inner>,
}

/// A raw communicator handle crossing from the init thread.
struct Handle(ncclComm_t);
// SAFETY: the handle is only moved, not used, on the way.
unsafe impl Send for Handle {}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl NcclComm {
    /// A fresh NCCL unique id (rank 0 makes it and hands it to the others).
    pub fn unique_id() -> DistResult<[u8; ID_BYTES]> {
        let lib = nccl()?;
        let mut id = ncclUniqueId { internal: [0; 128] };
        // SAFETY: `id` is a valid out pointer.
        lib.check("ncclGetUniqueId", unsafe { (lib.get_unique_id)(&mut id) })?;
        let mut out = [0u8; ID_BYTES];
        for (o, &c) in out.iter_mut().zip(id.internal.iter()) {
            *o = c as u8;
        }
        Ok(out)
    }

    /// Join the communicator of `world` ranks as `rank` on `dev`. `ncclCommInitRank` blocks until
    /// every rank has joined; it runs on a helper thread so that a rank that never comes is a
    /// timeout error instead of a hang.
    pub fn init(
        dev: Arc<CudaDevice>,
        rank: usize,
        world: usize,
        id: [u8; ID_BYTES],
        timeout: Duration,
    ) -> DistResult<NcclComm> {
        let lib = nccl()?;
        let stream = communication_stream(&dev)?;
        let mut internal = [0 as std::ffi::c_char; 128];
        for (o, &b) in internal.iter_mut().zip(id.iter()) {
            *o = b as std::ffi::c_char;
        }
        let nid = ncclUniqueId { internal };
        let (tx, rx) = std::sync::mpsc::channel();
        let ctx = dev.context().clone();
        let (r, w) = (rank as i32, world as i32);
        std::thread::Builder::new()
            .name(format!("ferrograd-nccl-init-{rank}"))
            .spawn(move || {
                let res = ctx.bind_to_thread().map_err(|e| format!("cuCtxSetCurrent: {e:?}")).and_then(|()| {
                    let mut comm: ncclComm_t = std::ptr::null_mut();
                    // SAFETY: `comm` is a valid out pointer; the id came from ncclGetUniqueId.
                    let code = unsafe { (lib.comm_init_rank)(&mut comm, w, nid, r) };
                    if code == 0 {
                        Ok(Handle(comm))
                    } else {
                        Err(format!("{} (NCCL error {code})", lib.error_text(code)))
                    }
                });
                let _ = tx.send(res);
            })
            .map_err(|e| DistError::Core(ferrograd_core::Error::Io(e)))?;
        let comm = match rx.recv_timeout(timeout) {
            Ok(Ok(h)) => h.0,
            Ok(Err(msg)) => return Err(DistError::Nccl { op: "ncclCommInitRank", code: -1, msg }),
            Err(_) => {
                return Err(DistError::Timeout {
                    op: format!("NCCL initialisation of rank {rank} of {world}"),
                    waited: timeout,
                })
            }
        };
        Ok(NcclComm {
            inner: Arc::new(Inner {
                lib,
                comm,
                rank,
                world,
                dev,
                stream,
                lock: Mutex::new(()),
                failed: AtomicBool::new(false),
                timing: AtomicBool::new(false),
                acct: Mutex::new(Accounting::default()),
                timeout,
            }),
        })
    }

    pub fn library(&self) -> &'static NcclLib {
        self.inner.lib
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.inner.stream
    }

    fn health(&self) -> HealthCheck {
        let inner = self.inner.clone();
        Arc::new(move || inner.async_error())
    }

    /// Queue `call` on the communication stream after the compute work queued so far.
    fn enqueue(
        &self,
        op: &'static str,
        keep: Vec<Tensor>,
        bytes: usize,
        call: impl FnOnce(&'static NcclLib, cudaStream_t) -> i32,
    ) -> DistResult<Work> {
        let inner = &*self.inner;
        let _g = lock(&inner.lock);
        if inner.failed.load(Ordering::Relaxed) {
            return Err(DistError::Collective { op, msg: "the communicator failed earlier and was aborted".into() });
        }
        let ready = inner.dev.record_compute_event()?;
        ready.wait_on(&inner.stream)?;
        // Timing events recorded into a graph capture are never recorded on the host's timeline
        // (`stats` could not read them): captured operations go untimed.
        let timing = inner.timing.load(Ordering::Relaxed) && !ferrograd_core::cuda::sync::is_capturing();
        let start = if timing {
            let e = Event::timing()?;
            e.record(&inner.stream)?;
            Some(e)
        } else {
            None
        };
        let code = call(inner.lib, inner.stream.cu_stream() as cudaStream_t);
        if let Err(e) = inner.lib.check(op, code) {
            inner.failed.store(true, Ordering::Relaxed);
            return Err(e);
        }
        let done = Event::new()?;
        done.record(&inner.stream)?;
        let mut acct = lock(&inner.acct);
        acct.calls += 1;
        acct.bytes += bytes as u64;
        if let Some(s) = start {
            let end = Event::timing()?;
            end.record(&inner.stream)?;
            acct.pending.push((s, end));
        }
        drop(acct);
        Ok(Work::queued(op, inner.dev.clone(), done, keep, Some(self.health())))
    }

    fn ptr(t: &Tensor) -> DistResult<*mut c_void> {
        Ok(t.cuda_ptr()? as *mut c_void)
    }

    fn bytes(t: &Tensor) -> usize {
        t.elem_count() * t.dtype().size_in_bytes()
    }
}

impl Inner {
    fn async_error(&self) -> DistResult<()> {
        let mut code = 0;
        // SAFETY: the handle is live until drop; ncclCommGetAsyncError is thread-safe.
        let r = unsafe { (self.lib.comm_get_async_error)(self.comm, &mut code) };
        self.lib.check("ncclCommGetAsyncError", r)?;
        if code != 0 && code != 7 {
            self.failed.store(true, Ordering::Relaxed);
            return Err(DistError::Nccl {
                op: "a collective (asynchronous error)",
                code,
                msg: self.lib.error_text(code),
            });
        }
        Ok(())
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let _ = self.dev.context().bind_to_thread();
        // Let this rank's queued operations finish (bounded), then abort rather than destroy:
        // ncclCommDestroy finalizes, which can wait for peers that have already exited and hang
        // the process at its very end; abort only frees this rank's resources.
        let start = Instant::now();
        if let Ok(e) = Event::new().and_then(|e| e.record(&self.stream).map(|()| e)) {
            while !e.is_done() && start.elapsed() < self.timeout.min(Duration::from_secs(30)) {
                if self.async_error().is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        // SAFETY: the handle is live and no other call is in flight (we own the last reference).
        unsafe { (self.lib.comm_abort)(self.comm) };
    }
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.inner.rank
    }
    fn world_size(&self) -> usize {
        self.inner.world
    }
    fn device(&self) -> Device {
        Device::Cuda(self.inner.dev.ordinal)
    }
    fn backend(&self) -> &'static str {
        "nccl"
    }

    fn all_reduce(&self, buf: &Tensor, op: ReduceOp) -> DistResult<Work> {
        check_buffer("all_reduce", self, buf, false)?;
        let (p, n, dt) = (Self::ptr(buf)?, buf.elem_count(), dtype(buf.dtype()));
        let c = self.inner.comm;
        // SAFETY: `p` addresses `n` live elements of `dt` on this communicator's device (checked
        // above); in place is allowed; `buf` is kept alive by the Work.
        self.enqueue("all_reduce", vec![buf.clone()], Self::bytes(buf), |l, s| unsafe {
            (l.all_reduce)(p, p, n, dt, red_op(op), c, s)
        })
    }

    fn reduce_scatter(&self, buf: &Tensor, op: ReduceOp) -> DistResult<Work> {
        check_buffer("reduce_scatter", self, buf, true)?;
        let (p, dt) = (Self::ptr(buf)?, dtype(buf.dtype()));
        let chunk = buf.elem_count() / self.inner.world;
        let out = (p as usize + self.inner.rank * chunk * buf.dtype().size_in_bytes()) as *mut c_void;
        let c = self.inner.comm;
        // SAFETY: NCCL's in-place reduce-scatter: the output is chunk `rank` of the input.
        self.enqueue("reduce_scatter", vec![buf.clone()], Self::bytes(buf), |l, s| unsafe {
            (l.reduce_scatter)(p, out, chunk, dt, red_op(op), c, s)
        })
    }

    fn all_gather(&self, buf: &Tensor) -> DistResult<Work> {
        check_buffer("all_gather", self, buf, true)?;
        let (p, dt) = (Self::ptr(buf)?, dtype(buf.dtype()));
        let chunk = buf.elem_count() / self.inner.world;
        let mine = (p as usize + self.inner.rank * chunk * buf.dtype().size_in_bytes()) as *const c_void;
        let c = self.inner.comm;
        // SAFETY: NCCL's in-place all-gather: the input is chunk `rank` of the output.
        self.enqueue("all_gather", vec![buf.clone()], Self::bytes(buf), |l, s| unsafe {
            (l.all_gather)(mine, p, chunk, dt, c, s)
        })
    }

    fn broadcast(&self, buf: &Tensor, root: usize) -> DistResult<Work> {
        check_buffer("broadcast", self, buf, false)?;
        if root >= self.inner.world {
            return Err(DistError::Collective {
                op: "broadcast",
                msg: format!("root {root} in a world of {}", self.inner.world),
            });
        }
        let (p, n, dt) = (Self::ptr(buf)?, buf.elem_count(), dtype(buf.dtype()));
        let c = self.inner.comm;
        // SAFETY: in-place broadcast over `n` live elements.
        self.enqueue("broadcast", vec![buf.clone()], Self::bytes(buf), |l, s| unsafe {
            (l.broadcast)(p, p, n, dt, root as i32, c, s)
        })
    }

    fn send(&self, buf: &Tensor, peer: usize) -> DistResult<Work> {
        check_buffer("send", self, buf, false)?;
        check_peer("send", self, peer)?;
        let (p, n, dt) = (Self::ptr(buf)?, buf.elem_count(), dtype(buf.dtype()));
        let c = self.inner.comm;
        // SAFETY: `n` live elements read by NCCL.
        self.enqueue("send", vec![buf.clone()], Self::bytes(buf), |l, s| unsafe {
            (l.send)(p, n, dt, peer as i32, c, s)
        })
    }

    fn recv(&self, buf: &Tensor, peer: usize) -> DistResult<Work> {
        check_buffer("recv", self, buf, false)?;
        check_peer("recv", self, peer)?;
        let (p, n, dt) = (Self::ptr(buf)?, buf.elem_count(), dtype(buf.dtype()));
        let c = self.inner.comm;
        // SAFETY: `n` live elements written by NCCL.
        self.enqueue("recv", vec![buf.clone()], Self::bytes(buf), |l, s| unsafe {
            (l.recv)(p, n, dt, peer as i32, c, s)
        })
    }

    fn send_recv(&self, send: &Tensor, to: usize, recv: &Tensor, from: usize) -> DistResult<Work> {
        for (b, peer, op) in [(send, to, "send"), (recv, from, "recv")] {
            check_buffer(op, self, b, false)?;
            check_peer(op, self, peer)?;
        }
        let (sp, sn, sd) = (Self::ptr(send)?, send.elem_count(), dtype(send.dtype()));
        let (rp, rn, rd) = (Self::ptr(recv)?, recv.elem_count(), dtype(recv.dtype()));
        let c = self.inner.comm;
        let bytes = Self::bytes(send) + Self::bytes(recv);
        // SAFETY: both ranges are live; grouping lets the pair progress together (two ranks that
        // send to each other first would otherwise wait for ever).
        self.enqueue("send_recv", vec![send.clone(), recv.clone()], bytes, |l, s| unsafe {
            let g = (l.group_start)();
            if g != 0 {
                return g;
            }
            let a = (l.send)(sp, sn, sd, to as i32, c, s);
            let b = (l.recv)(rp, rn, rd, from as i32, c, s);
            let e = (l.group_end)();
            [a, b, e].into_iter().find(|&x| x != 0).unwrap_or(0)
        })
    }

    fn barrier(&self) -> DistResult<()> {
        let t = Tensor::zeros(1, DType::F32, self.device())?;
        self.all_reduce(&t, ReduceOp::Sum)?.synchronize(self.inner.timeout)
    }

    fn graph_capturable(&self) -> Result<(), String> {
        // NCCL records its kernels into a capturing stream from 2.9 on (and lets captured and
        // eager operations share a communicator).
        let lib = self.inner.lib;
        if lib.version < CAPTURE_VERSION {
            return Err(format!("NCCL {} cannot be recorded in a CUDA graph (2.9 or newer can)", lib.version_string()));
        }
        Ok(())
    }

    fn set_timing(&self, on: bool) {
        self.inner.timing.store(on, Ordering::Relaxed);
    }

    fn stats(&self) -> DistResult<CommStats> {
        let mut acct = lock(&self.inner.acct);
        for (s, e) in std::mem::take(&mut acct.pending) {
            e.synchronize()?;
            acct.device_ms += s.elapsed_ms(&e)? as f64;
            acct.timed += 1;
        }
        Ok(CommStats { calls: acct.calls, bytes: acct.bytes, device_ms: acct.device_ms, timed_calls: acct.timed })
    }
}
