//! The allocator's view of the real driver: raw device memory and events on the device's streams
//! (a `StreamId` is a slot of the device's stream table, `cuda/stream.rs`). Allocating, freeing and
//! waiting for an event make the host wait, so they go through the counted `sync::host_wait`.

use super::alloc::{EventId, RawAllocError, RawDeviceMemory, StreamId, StreamSync};
use super::stream::{StreamTable, COPY_SLOT};
use super::sync::host_wait;
use cudarc::driver::{result, sys, CudaContext};
use std::collections::HashMap;
use std::sync::Arc;

/// The copy stream, for blocks that a prefetch writes before compute first uses them.
pub const COPY: StreamId = StreamId(COPY_SLOT as u64);

pub struct DriverMemory {
    pub(crate) ctx: Arc<CudaContext>,
}

fn raw_err(e: result::DriverError) -> RawAllocError {
    if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        RawAllocError::OutOfMemory
    } else {
        RawAllocError::Driver(format!("{e:?}"))
    }
}

impl RawDeviceMemory for DriverMemory {
    fn raw_alloc(&mut self, bytes: usize) -> Result<u64, RawAllocError> {
        self.ctx.bind_to_thread().map_err(raw_err)?;
        super::startup::timed(super::startup::Cost::DeviceMalloc, || {
            // SAFETY: a plain allocation in the bound context.
            host_wait("cuMemAlloc", || unsafe { result::malloc_sync(bytes) }.map_err(raw_err))
        })
    }

    unsafe fn raw_free(&mut self, ptr: u64) -> Result<(), RawAllocError> {
        self.ctx.bind_to_thread().map_err(raw_err)?;
        // cuMemFree waits for work that may still use the memory.
        // SAFETY: the caller vouches that `ptr` came from `raw_alloc` and is freed once.
        host_wait("cuMemFree", || unsafe { result::free_sync(ptr) }.map_err(raw_err))
    }

    fn mem_info(&self) -> (usize, usize) {
        self.ctx.mem_get_info().unwrap_or((0, 0))
    }
}

/// Events recorded for cross-stream frees, on the streams of the device's table.
pub struct DriverEvents {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) streams: Arc<StreamTable>,
    events: HashMap<u64, sys::CUevent>,
    next: u64,
}

// SAFETY: CUstream/CUevent handles are usable from any thread once the context is bound.
unsafe impl Send for DriverEvents {}

impl DriverEvents {
    pub(crate) fn new(ctx: Arc<CudaContext>, streams: Arc<StreamTable>) -> Self {
        DriverEvents { ctx, streams, events: HashMap::new(), next: 0 }
    }
}

impl StreamSync for DriverEvents {
    fn record_event(&mut self, stream: StreamId) -> Result<EventId, RawAllocError> {
        self.ctx.bind_to_thread().map_err(raw_err)?;
        let s = self.streams.cu_stream(stream).ok_or(RawAllocError::Driver(format!("unknown {stream:?}")))?;
        let ev = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).map_err(raw_err)?;
        // SAFETY: both handles are live.
        unsafe { result::event::record(ev, s) }.map_err(raw_err)?;
        self.next += 1;
        self.events.insert(self.next, ev);
        Ok(EventId(self.next))
    }

    fn query_event(&mut self, event: EventId) -> Result<bool, RawAllocError> {
        let ev = *self.events.get(&event.0).ok_or(RawAllocError::Driver(format!("unknown {event:?}")))?;
        // SAFETY: the event is live until release_event.
        match unsafe { result::event::query(ev) } {
            Ok(()) => Ok(true),
            Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            Err(e) => Err(raw_err(e)),
        }
    }

    fn synchronize_event(&mut self, event: EventId) -> Result<(), RawAllocError> {
        let ev = *self.events.get(&event.0).ok_or(RawAllocError::Driver(format!("unknown {event:?}")))?;
        // SAFETY: the event is live until release_event.
        host_wait("cuEventSynchronize", || unsafe { result::event::synchronize(ev) }.map_err(raw_err))
    }

    fn release_event(&mut self, event: EventId) {
        if let Some(ev) = self.events.remove(&event.0) {
            // SAFETY: removed from the map, so never used again.
            let _ = unsafe { result::event::destroy(ev) };
        }
    }
}
