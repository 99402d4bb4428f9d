//! A device buffer: a byte range of an allocation from the caching allocator. The allocation goes
//! back to the allocator when its last buffer drops; several buffers share one allocation when many
//! small tensors were moved in one coalesced copy. Frees are stream-ordered: a block freed here is
//! only handed out again to work queued after this point on the stream it was allocated for (the
//! thread's current stream then), so a kernel still reading it finishes first; other streams that
//! used it are waited for through `record_use_on`.

use super::alloc::Allocation;
use super::device::{driver_err, CudaDevice};
use crate::{DType, Result};
use cudarc::driver::result;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

static POISON: AtomicBool = AtomicBool::new(false);

/// Fill every new buffer with 0xFF bytes (NaN for floats) before use, so a kernel that leaves an
/// element unwritten is caught by the tests instead of passing on stale or zeroed memory.
pub fn set_poison_allocations(on: bool) {
    POISON.store(on, Ordering::Relaxed)
}

pub(crate) struct AllocGuard {
    dev: Arc<CudaDevice>,
    alloc: Option<Allocation>,
}

impl Drop for AllocGuard {
    fn drop(&mut self) {
        if let Some(a) = self.alloc.take() {
            self.dev.free(a);
        }
    }
}

impl AllocGuard {
    pub(crate) fn allocation(&self) -> Option<&Allocation> {
        self.alloc.as_ref()
    }
}

/// A buffer's claim on its allocation: its own (every op output: no reference count to allocate)
/// or a share of one that several buffers use (a coalesced transfer), or a managed allocation
/// outside the caching allocator (`cuda/managed.rs`, unified tensors).
enum Claim {
    Own(AllocGuard),
    Shared(Arc<AllocGuard>),
    Managed(Arc<super::managed::ManagedAlloc>),
}

impl Claim {
    fn allocation(&self) -> Option<&Allocation> {
        match self {
            Claim::Own(g) => g.allocation(),
            Claim::Shared(g) => g.allocation(),
            Claim::Managed(_) => None,
        }
    }

    fn base(&self) -> u64 {
        match self {
            Claim::Managed(m) => m.ptr(),
            _ => self.allocation().map_or(0, |a| a.ptr()),
        }
    }
}

pub struct CudaBuffer {
    pub(crate) dev: Arc<CudaDevice>,
    guard: Claim,
    byte_offset: usize,
    pub(crate) len: usize,
    pub(crate) dtype: DType,
}

impl CudaBuffer {
    /// Uninitialised room for `len` elements of `dtype` (poisoned when poisoning is on).
    pub fn uninit(dev: &Arc<CudaDevice>, len: usize, dtype: DType) -> Result<CudaBuffer> {
        let bytes = len.checked_mul(dtype.size_in_bytes()).ok_or_else(|| {
            crate::Error::InvalidArgument(format!("{len} elements of {dtype} overflow the address space"))
        })?;
        let guard = Claim::Own(Self::raw(dev, bytes)?);
        let b = CudaBuffer { dev: dev.clone(), guard, byte_offset: 0, len, dtype };
        if bytes > 0 && POISON.load(Ordering::Relaxed) {
            dev.ctx.bind_to_thread().map_err(|e| driver_err("cuCtxSetCurrent", e))?;
            // SAFETY: the range is the fresh allocation itself.
            unsafe { result::memset_d8_async(b.ptr(), 0xFF, bytes, dev.stream().cu_stream()) }
                .map_err(|e| driver_err("cuMemsetD8Async", e))?;
        }
        Ok(b)
    }

    /// Room for `len` elements from the copy stream's pool (for prefetches).
    pub fn uninit_for_copy(dev: &Arc<CudaDevice>, len: usize, dtype: DType) -> Result<CudaBuffer> {
        let bytes = len.checked_mul(dtype.size_in_bytes()).ok_or_else(|| {
            crate::Error::InvalidArgument(format!("{len} elements of {dtype} overflow the address space"))
        })?;
        let guard = Claim::Own(AllocGuard { dev: dev.clone(), alloc: Some(dev.alloc_bytes_for_copy(bytes)?) });
        Ok(CudaBuffer { dev: dev.clone(), guard, byte_offset: 0, len, dtype })
    }

    /// Room for `len` elements in managed (unified) memory, addressable from the host too.
    pub fn managed(dev: &Arc<CudaDevice>, len: usize, dtype: DType) -> Result<CudaBuffer> {
        let bytes = len.checked_mul(dtype.size_in_bytes()).ok_or_else(|| {
            crate::Error::InvalidArgument(format!("{len} elements of {dtype} overflow the address space"))
        })?;
        let m = Arc::new(super::managed::ManagedAlloc::new(dev, bytes)?);
        Ok(CudaBuffer { dev: dev.clone(), guard: Claim::Managed(m), byte_offset: 0, len, dtype })
    }

    /// The managed allocation under this buffer, if it is one.
    pub fn managed_alloc(&self) -> Option<&Arc<super::managed::ManagedAlloc>> {
        match &self.guard {
            Claim::Managed(m) => Some(m),
            _ => None,
        }
    }

    /// Work on `stream` uses this buffer too: its block is not reused before that work is done
    /// (PyTorch's `record_stream`).
    pub(crate) fn record_use_on(&self, stream: super::alloc::StreamId) -> Result<()> {
        match self.guard.allocation() {
            Some(a) if a.stream() != stream => self.dev.record_use(a, stream),
            _ => Ok(()),
        }
    }

    pub(crate) fn raw(dev: &Arc<CudaDevice>, bytes: usize) -> Result<AllocGuard> {
        Ok(AllocGuard { dev: dev.clone(), alloc: Some(dev.alloc_bytes(bytes)?) })
    }

    /// A buffer over `len` elements at `byte_offset` of a shared allocation.
    pub(crate) fn sub(
        dev: &Arc<CudaDevice>,
        guard: Arc<AllocGuard>,
        byte_offset: usize,
        len: usize,
        dtype: DType,
    ) -> CudaBuffer {
        CudaBuffer { dev: dev.clone(), guard: Claim::Shared(guard), byte_offset, len, dtype }
    }

    /// Device address of element `i`.
    pub fn ptr_at(&self, i: usize) -> u64 {
        let base = self.guard.base();
        base + (self.byte_offset + i * self.dtype.size_in_bytes()) as u64
    }

    pub fn ptr(&self) -> u64 {
        self.ptr_at(0)
    }

    pub fn bytes(&self) -> usize {
        self.len * self.dtype.size_in_bytes()
    }
}
