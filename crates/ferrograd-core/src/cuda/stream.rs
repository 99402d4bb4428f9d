//! The streams of a device and the thread's current stream, as PyTorch has them.
//!
//! - Each device keeps a fixed table of [`MAX_STREAMS`] slots: slot 0 is the default compute
//!   stream, slot 1 the copy stream that transfers and prefetches use, and the rest a pool that
//!   [`CudaDevice::new_stream`] hands out (round-robin once all exist, like PyTorch's stream pool).
//!   Streams are never destroyed while the device lives, so `CudaDevice::stream()` can return a
//!   reference without counting, and the slot index is the allocator's `StreamId`.
//! - Each thread has a *current stream* per device (the default one until changed).
//!   [`Stream::make_current`] returns a guard that makes it current until dropped
//!   (`with torch.cuda.stream(s):`). Every launch, copy and allocation of an op asks
//!   `CudaDevice::stream()`, so they all follow; a tensor's memory belongs to the stream that was
//!   current when it was made (use `Tensor::record_stream` when another stream uses it too).
//! - [`Event`]s order streams: record on one, wait on another ([`Stream::wait_stream`] does both).

use super::alloc::StreamId;
use super::device::{driver_err, CudaDevice};
use super::event::Event;
use crate::Result;
use cudarc::driver::{CudaContext, CudaStream};
use std::cell::Cell;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

/// Stream slots per device: compute, copy, and 62 for [`CudaDevice::new_stream`].
pub const MAX_STREAMS: usize = 64;
pub(crate) const COMPUTE_SLOT: usize = 0;
pub(crate) const COPY_SLOT: usize = 1;
const FIRST_POOL_SLOT: usize = 2;
/// Devices whose current stream a thread can change; higher ordinals always use their default.
const MAX_DEVICES: usize = 64;

thread_local! {
    /// This thread's current stream slot per device ordinal.
    static CURRENT: [Cell<u8>; MAX_DEVICES] = const { [const { Cell::new(0) }; MAX_DEVICES] };
}

pub(crate) fn current_slot(ordinal: usize) -> usize {
    if ordinal < MAX_DEVICES {
        CURRENT.with(|c| c[ordinal].get() as usize)
    } else {
        COMPUTE_SLOT
    }
}

fn set_current_slot(ordinal: usize, slot: usize) -> usize {
    if ordinal < MAX_DEVICES {
        CURRENT.with(|c| c[ordinal].replace(slot as u8) as usize)
    } else {
        COMPUTE_SLOT
    }
}

/// The device's streams by slot. Slots only ever go from empty to set.
pub(crate) struct StreamTable {
    /// Also in slot 0; kept here so that a lookup never fails.
    compute: Arc<CudaStream>,
    slots: [OnceLock<Arc<CudaStream>>; MAX_STREAMS],
    next: AtomicUsize,
}

impl StreamTable {
    pub(crate) fn new(ctx: &Arc<CudaContext>) -> Result<StreamTable> {
        let compute = ctx.new_stream().map_err(|e| driver_err("cuStreamCreate", e))?;
        let copy = ctx.new_stream().map_err(|e| driver_err("cuStreamCreate", e))?;
        let t = StreamTable {
            compute: compute.clone(),
            slots: [const { OnceLock::new() }; MAX_STREAMS],
            next: AtomicUsize::new(0),
        };
        let _ = t.slots[COMPUTE_SLOT].set(compute);
        let _ = t.slots[COPY_SLOT].set(copy);
        Ok(t)
    }

    /// The stream in `slot`, if it exists.
    pub(crate) fn get(&self, slot: usize) -> Option<&Arc<CudaStream>> {
        self.slots.get(slot)?.get()
    }

    /// The driver handle of the stream the allocator calls `id`.
    pub(crate) fn cu_stream(&self, id: StreamId) -> Option<cudarc::driver::sys::CUstream> {
        self.get(id.0 as usize).map(|s| s.cu_stream())
    }

    /// A pool slot, its stream created on first use.
    fn take_pool_slot(&self, ctx: &Arc<CudaContext>) -> Result<usize> {
        let pool = MAX_STREAMS - FIRST_POOL_SLOT;
        let slot = FIRST_POOL_SLOT + self.next.fetch_add(1, Ordering::Relaxed) % pool;
        if self.slots[slot].get().is_none() {
            let s = ctx.new_stream().map_err(|e| driver_err("cuStreamCreate", e))?;
            // Another thread may have filled the slot meanwhile: then its stream is used and ours
            // is destroyed here.
            let _ = self.slots[slot].set(s);
        }
        Ok(slot)
    }
}

/// A stream of one device. Cheap to clone; the stream itself lives as long as the device.
#[derive(Clone)]
pub struct Stream {
    dev: Arc<CudaDevice>,
    slot: usize,
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Stream(cuda:{}, {})", self.dev.ordinal, self.slot)
    }
}

impl PartialEq for Stream {
    fn eq(&self, other: &Stream) -> bool {
        self.dev.ordinal == other.dev.ordinal && self.slot == other.slot
    }
}

impl Stream {
    /// The allocator's name for this stream (its slot in the device's table).
    pub fn id(&self) -> StreamId {
        StreamId(self.slot as u64)
    }

    /// The device the stream belongs to.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.dev
    }

    /// Whether this is the device's default compute stream.
    pub fn is_default(&self) -> bool {
        self.slot == COMPUTE_SLOT
    }

    pub(crate) fn cuda(&self) -> &Arc<CudaStream> {
        self.dev.stream_in(self.slot)
    }

    /// Makes this the calling thread's current stream on its device until the guard drops (then
    /// the previous one is current again), like `with torch.cuda.stream(s):`.
    pub fn make_current(&self) -> StreamGuard {
        StreamGuard {
            ordinal: self.dev.ordinal,
            prev: set_current_slot(self.dev.ordinal, self.slot),
            _thread_bound: PhantomData,
        }
    }

    /// An event after the work queued on this stream so far.
    pub fn record_event(&self) -> Result<Event> {
        self.dev.ctx.bind_to_thread().map_err(|e| driver_err("cuCtxSetCurrent", e))?;
        let e = Event::new()?;
        e.record(self.cuda())?;
        Ok(e)
    }

    /// Work queued on this stream from now on waits (on the device) for `e`.
    pub fn wait_event(&self, e: &Event) -> Result<()> {
        self.dev.ctx.bind_to_thread().map_err(|e| driver_err("cuCtxSetCurrent", e))?;
        e.wait_on(self.cuda())
    }

    /// Work queued on this stream from now on waits for the work queued on `other` so far.
    pub fn wait_stream(&self, other: &Stream) -> Result<()> {
        if self == other {
            return Ok(());
        }
        self.wait_event(&other.record_event()?)
    }

    /// Blocks the host until everything queued on this stream is done (a counted host wait).
    pub fn synchronize(&self) -> Result<()> {
        super::sync::host_wait("cuStreamSynchronize", || {
            self.cuda().synchronize().map_err(|e| driver_err("cuStreamSynchronize", e))
        })
    }

    /// Whether everything queued on this stream has finished; never blocks.
    pub fn is_done(&self) -> Result<bool> {
        self.dev.ctx.bind_to_thread().map_err(|e| driver_err("cuCtxSetCurrent", e))?;
        // SAFETY: the stream is live as long as the device.
        use cudarc::driver::sys::{cuStreamQuery, CUresult};
        match unsafe { cuStreamQuery(self.cuda().cu_stream()) } {
            CUresult::CUDA_SUCCESS => Ok(true),
            CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            e => Err(driver_err("cuStreamQuery", e)),
        }
    }
}

/// Keeps a stream current on this thread (see [`Stream::make_current`]); not `Send`, because the
/// current stream is per thread.
#[must_use = "the stream is current only while the guard lives"]
pub struct StreamGuard {
    ordinal: usize,
    prev: usize,
    _thread_bound: PhantomData<*const ()>,
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        set_current_slot(self.ordinal, self.prev);
    }
}

impl CudaDevice {
    /// The stream ops are enqueued on: this thread's current stream. Every launch and async copy
    /// of an op goes through this accessor, never a stored stream, so that the stream guard and
    /// graph capture redirect work in one place.
    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        self.stream_in(current_slot(self.ordinal))
    }

    /// The cudarc stream ops are enqueued on now (this thread's current stream), for code that
    /// launches its own kernels or calls other CUDA libraries in order with ours.
    pub fn current_cuda_stream(&self) -> &Arc<CudaStream> {
        self.stream()
    }

    /// The allocator's id of this thread's current stream.
    pub(crate) fn current_stream_id(&self) -> StreamId {
        StreamId(current_slot(self.ordinal) as u64)
    }

    /// The stream host<->device transfers and prefetches run on.
    pub(crate) fn copy_stream(&self) -> &Arc<CudaStream> {
        self.stream_in(COPY_SLOT)
    }

    /// The stream in `slot` (a guard only ever names a filled slot; the default one otherwise).
    pub(crate) fn stream_in(&self, slot: usize) -> &Arc<CudaStream> {
        self.streams.get(slot).unwrap_or(&self.streams.compute)
    }

    /// A stream of its own for concurrent work (from a pool of 62 per device, reused round-robin
    /// once all exist, as PyTorch's `torch.cuda.Stream()` draws from its pool).
    pub fn new_stream(self: &Arc<Self>) -> Result<Stream> {
        let slot = self.streams.take_pool_slot(&self.ctx)?;
        Ok(Stream { dev: self.clone(), slot })
    }

    /// The default compute stream.
    pub fn default_stream(self: &Arc<Self>) -> Stream {
        Stream { dev: self.clone(), slot: COMPUTE_SLOT }
    }

    /// This thread's current stream on this device.
    pub fn current_stream(self: &Arc<Self>) -> Stream {
        Stream { dev: self.clone(), slot: current_slot(self.ordinal) }
    }
}
