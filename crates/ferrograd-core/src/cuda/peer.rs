//! Copies between two GPUs of one process. The first copy between a pair asks the driver whether
//! the devices can address each other's memory (`cuDeviceCanAccessPeer`: NVLink, or PCIe under one
//! root complex) and, where they can, enables peer access in both directions once; copies then go
//! GPU to GPU (`cuMemcpyPeerAsync`). Where they cannot, `Tensor::to_device` stages through the
//! host instead.
//!
//! Ordering: the copy runs on the destination's compute stream after an event of the source's
//! compute stream, and the source's compute stream then waits for the copy, so neither device
//! blocks the host and the source block cannot be reused before the copy has read it.

use super::device::{driver_err, CudaDevice};
use super::event::Event;
use crate::Result;
use cudarc::driver::sys;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// Per unordered pair (lower ordinal first): whether peer access is on.
static PAIRS: OnceLock<Mutex<HashMap<(usize, usize), bool>>> = OnceLock::new();

fn can_access(a: &CudaDevice, b: &CudaDevice) -> Result<bool> {
    let mut can = 0i32;
    // SAFETY: both device handles come from live contexts; `can` is a valid out pointer.
    unsafe { sys::cuDeviceCanAccessPeer(&mut can, a.context().cu_device(), b.context().cu_device()) }
        .result()
        .map_err(|e| driver_err("cuDeviceCanAccessPeer", e))?;
    Ok(can != 0)
}

/// Let `from`'s context address `to`'s memory (idempotent).
fn enable(from: &CudaDevice, to: &CudaDevice) -> Result<()> {
    from.context().bind_to_thread().map_err(|e| driver_err("cuCtxSetCurrent", e))?;
    // SAFETY: `to`'s context is live; flags must be 0.
    match unsafe { sys::cuCtxEnablePeerAccess(to.context().cu_ctx(), 0) } {
        sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(()),
        e => Err(driver_err("cuCtxEnablePeerAccess", e)),
    }
}

/// Whether `a` and `b` copy to each other directly; peer access is enabled in both directions the
/// first time a pair is asked about and the answer is kept for the process.
pub fn peer_access(a: &CudaDevice, b: &CudaDevice) -> Result<bool> {
    if a.ordinal == b.ordinal {
        return Ok(true);
    }
    let key = (a.ordinal.min(b.ordinal), a.ordinal.max(b.ordinal));
    let pairs = PAIRS.get_or_init(Default::default);
    let mut pairs = pairs.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(&on) = pairs.get(&key) {
        return Ok(on);
    }
    let on = can_access(a, b)? && can_access(b, a)?;
    if on {
        enable(a, b)?;
        enable(b, a)?;
    }
    pairs.insert(key, on);
    Ok(on)
}

/// Copy `bytes` from `src_ptr` on `src` to `dst_ptr` on `dst` GPU to GPU (see the module comment
/// for how it is ordered). Call only where `peer_access` said yes.
pub(crate) fn copy(
    src: &Arc<CudaDevice>,
    src_ptr: u64,
    dst: &Arc<CudaDevice>,
    dst_ptr: u64,
    bytes: usize,
) -> Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    let ready = src.record_compute_event()?;
    dst.compute_wait(&ready)?;
    // SAFETY: both ranges are live device memory of at least `bytes` bytes (the caller's buffers),
    // the contexts are live, and the stream belongs to `dst`'s context, which is bound.
    unsafe {
        sys::cuMemcpyPeerAsync(
            dst_ptr,
            dst.context().cu_ctx(),
            src_ptr,
            src.context().cu_ctx(),
            bytes,
            dst.stream().cu_stream(),
        )
    }
    .result()
    .map_err(|e| driver_err("cuMemcpyPeerAsync", e))?;
    let done: Event = dst.record_compute_event()?;
    src.compute_wait(&done)
}
