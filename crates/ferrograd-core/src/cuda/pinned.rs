//! Page-locked host memory. The DMA engines reach full speed only from pinned memory, and a copy
//! from pinned memory can run asynchronously while the host goes on. `cuMemHostAlloc` is slow
//! (milliseconds for large sizes), so freed buffers are cached by power-of-two size class, the way
//! PyTorch's CachingHostAllocator does.

use super::device::{driver_err, CudaDevice};
use crate::Result;
use cudarc::driver::sys;
use std::collections::BTreeMap;
use std::sync::Mutex;

/// Smallest pinned buffer handed out; smaller requests share this class.
const MIN_CLASS: usize = 64 << 10;

static POOL: Mutex<BTreeMap<usize, Vec<usize>>> = Mutex::new(BTreeMap::new());

/// A pinned host buffer from the pool; returns to the pool on drop.
pub struct PinnedBuf {
    ptr: *mut u8,
    cap: usize,
}

// SAFETY: the buffer is plain host memory owned by this handle alone.
unsafe impl Send for PinnedBuf {}
unsafe impl Sync for PinnedBuf {}

impl PinnedBuf {
    /// At least `bytes` of pinned memory.
    pub fn new(dev: &CudaDevice, bytes: usize) -> Result<PinnedBuf> {
        let cap = bytes.max(1).next_power_of_two().max(MIN_CLASS);
        if let Some(p) = POOL.lock().unwrap_or_else(|e| e.into_inner()).get_mut(&cap).and_then(|v| v.pop()) {
            return Ok(PinnedBuf { ptr: p as *mut u8, cap });
        }
        dev.ctx.bind_to_thread().map_err(|e| driver_err("cuCtxSetCurrent", e))?;
        // SAFETY: a plain page-locked allocation, usable from every context (PORTABLE).
        let p = super::sync::host_wait("cuMemHostAlloc", || {
            unsafe { cudarc::driver::result::malloc_host(cap, sys::CU_MEMHOSTALLOC_PORTABLE) }
                .map_err(|e| driver_err(&format!("cuMemHostAlloc({cap} bytes)"), e))
        })?;
        Ok(PinnedBuf { ptr: p as *mut u8, cap })
    }

    /// Bytes allocated.
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// The host address.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }

    /// The first `len` bytes (at most the capacity), writable.
    pub fn as_mut_slice(&mut self, len: usize) -> &mut [u8] {
        // SAFETY: `len <= cap` is checked; the memory is ours for the handle's lifetime.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, len.min(self.cap)) }
    }

    /// The first `len` bytes (at most the capacity).
    pub fn as_slice(&self, len: usize) -> &[u8] {
        // SAFETY: as above.
        unsafe { std::slice::from_raw_parts(self.ptr, len.min(self.cap)) }
    }
}

impl Drop for PinnedBuf {
    fn drop(&mut self) {
        POOL.lock().unwrap_or_else(|e| e.into_inner()).entry(self.cap).or_default().push(self.ptr as usize);
    }
}

/// Bytes currently cached in the pool (not handed out).
pub fn cached_pinned_bytes() -> usize {
    POOL.lock().unwrap_or_else(|e| e.into_inner()).iter().map(|(c, v)| c * v.len()).sum()
}

/// A host range page-locked in place with `cuMemHostRegister` (what `Tensor::pin_memory` uses);
/// unregistered on drop, which must happen before the memory is freed.
pub struct HostPin {
    ptr: usize,
    bytes: usize,
}

impl HostPin {
    /// Page-lock `bytes` at `ptr` (`cuMemHostRegister`) until the returned pin drops; the caller keeps
    /// the range alive and unmoved that long.
    pub fn register(dev: &CudaDevice, ptr: *const u8, bytes: usize) -> Result<HostPin> {
        dev.ctx.bind_to_thread().map_err(|e| driver_err("cuCtxSetCurrent", e))?;
        super::sync::host_wait("cuMemHostRegister", || {
            // SAFETY: the caller keeps the range alive and unmoved until this pin drops.
            let r = unsafe { sys::cuMemHostRegister_v2(ptr as *mut _, bytes, sys::CU_MEMHOSTREGISTER_PORTABLE) };
            if r != sys::CUresult::CUDA_SUCCESS {
                return Err(driver_err("cuMemHostRegister", r));
            }
            Ok(HostPin { ptr: ptr as usize, bytes })
        })
    }

    /// Whether `bytes` at `ptr` lie inside the pinned range.
    pub fn contains(&self, ptr: *const u8, bytes: usize) -> bool {
        let p = ptr as usize;
        p >= self.ptr && p + bytes <= self.ptr + self.bytes
    }
}

impl Drop for HostPin {
    fn drop(&mut self) {
        super::sync::host_wait_in_drop("cuMemHostUnregister", || {
            // SAFETY: registered by `register` and not yet unregistered.
            let _ = unsafe { sys::cuMemHostUnregister(self.ptr as *mut _) };
        })
    }
}
