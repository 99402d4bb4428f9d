//! The per-device error flag: how an op reports a bad input that only the device sees (a class id
//! or an index out of range) without making the host wait.
//!
//! A kernel that meets a bad index records the first one (op, value, size) and goes on (the index
//! kernels skip such an id; see `kernels/include/error_flag.cuh`); the next host read of the
//! device (`to_vec`, `item`, `to_device(Cpu)`, `synchronize`) finds the record and returns
//! `Error::IndexOutOfRange` naming the op and the value, then re-arms the flag, so the device
//! keeps working. Checking on the host instead would copy every index tensor back before its op:
//! a synchronizing call in each training step, which CUDA graph capture forbids.
//!
//! Where the record lives: a word in device memory elects the one thread that reports (atomics on
//! device memory work everywhere; atomics on mapped host memory need platform support), and the
//! record itself is page-locked host memory mapped into the device, so that the host reads it
//! after a synchronization it makes anyway, with no copy and no driver call unless it is set.

use super::device::{driver_err, CudaDevice};
use crate::{Error, Result};
use cudarc::driver::{result, sys, CudaContext};
use std::cell::Cell;
use std::sync::Arc;

/// The op a bad index is reported for (`FgIndexOp` in kernels/include/error_flag.cuh).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub enum IndexOp {
    IndexSelect = 0,
    Gather = 1,
    IndexAdd = 2,
    ScatterAdd = 3,
    Embedding = 4,
    CrossEntropyTarget = 5,
    IndexCopy = 6,
}

impl IndexOp {
    pub const ALL: [IndexOp; 7] = [
        IndexOp::IndexSelect,
        IndexOp::Gather,
        IndexOp::IndexAdd,
        IndexOp::ScatterAdd,
        IndexOp::Embedding,
        IndexOp::CrossEntropyTarget,
        IndexOp::IndexCopy,
    ];

    /// As errors name it (the CPU's immediate errors use the same names).
    pub fn name(self) -> &'static str {
        match self {
            IndexOp::IndexSelect => "index_select",
            IndexOp::Gather => "gather",
            IndexOp::IndexAdd => "index_add",
            IndexOp::ScatterAdd => "scatter_add",
            IndexOp::Embedding => "embedding",
            IndexOp::CrossEntropyTarget => "cross_entropy target",
            IndexOp::IndexCopy => "index_copy_",
        }
    }

    fn from_code(code: i32) -> Option<IndexOp> {
        IndexOp::ALL.into_iter().find(|op| *op as i32 == code)
    }
}

thread_local! {
    static RENAMED: Cell<Option<IndexOp>> = const { Cell::new(None) };
}

/// Run `f` with the index checks it launches reported as `op` (`embedding` is an index_select
/// whose bad ids should say `embedding`, as its CPU error does).
pub(crate) fn reported_as<R>(op: IndexOp, f: impl FnOnce() -> R) -> R {
    let prev = RENAMED.with(|r| r.replace(Some(op)));
    let out = f();
    RENAMED.with(|r| r.set(prev));
    out
}

/// `op`, or the name an enclosing [`reported_as`] gives it.
pub(crate) fn reported_op(op: IndexOp) -> IndexOp {
    RENAMED.with(|r| r.get()).unwrap_or(op)
}

/// The record the kernels write (`FgErrorRecord`): 24 bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Record {
    set: u32,
    op: i32,
    value: i64,
    size: u64,
}

impl Record {
    /// The error a set record stands for.
    fn error(&self) -> Error {
        let op = IndexOp::from_code(self.op).map_or("an index op", IndexOp::name);
        Error::IndexOutOfRange { op, index: self.value, size: usize::try_from(self.size).unwrap_or(usize::MAX) }
    }
}

/// One device's flag: the election word (device memory) and the record (mapped host memory).
pub(crate) struct ErrorFlag {
    ctx: Arc<CudaContext>,
    claim: sys::CUdeviceptr,
    host: *mut Record,
    record: sys::CUdeviceptr,
}

// SAFETY: the pointers are owned by this value for its life and only read or written through the
// methods below (the record with volatile accesses, after the device finished writing it).
unsafe impl Send for ErrorFlag {}
unsafe impl Sync for ErrorFlag {}

impl ErrorFlag {
    /// Armed: the claim word 0, the record clear.
    pub(crate) fn new(ctx: &Arc<CudaContext>) -> Result<ErrorFlag> {
        ctx.bind_to_thread().map_err(|e| driver_err("cuCtxSetCurrent", e))?;
        let bytes = std::mem::size_of::<Record>();
        // cuMemAlloc and page-locking synchronize: a counted host wait (`cuda/sync.rs`), made once
        // when the device opens.
        // SAFETY: fresh allocations, freed in Drop (or below on failure); the memset covers the
        // word just allocated; the host record is written before any kernel can see it.
        super::sync::host_wait("cuMemAlloc(error flag)", || unsafe {
            let claim = result::malloc_sync(4).map_err(|e| driver_err("cuMemAlloc(error flag)", e))?;
            let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
            let host = match result::malloc_host(bytes, flags) {
                Ok(p) => p as *mut Record,
                Err(e) => {
                    let _ = result::free_sync(claim);
                    return Err(driver_err("cuMemHostAlloc(error flag)", e));
                }
            };
            // Owned from here on: an error below frees both in Drop.
            let mut flag = ErrorFlag { ctx: ctx.clone(), claim, host, record: 0 };
            std::ptr::write_volatile(host, Record::default());
            result::memset_d8_sync(claim, 0, 4).map_err(|e| driver_err("cuMemsetD8(error flag)", e))?;
            sys::cuMemHostGetDevicePointer_v2(&mut flag.record, host as *mut _, 0)
                .result()
                .map_err(|e| driver_err("cuMemHostGetDevicePointer", e))?;
            Ok(flag)
        })
    }

    /// The two kernel arguments: (claim word, record), both device addresses.
    pub(crate) fn args(&self) -> (u64, u64) {
        (self.claim, self.record)
    }

    /// The first bad index since the last call, once the device has finished the work that could
    /// have recorded it (the caller has just synchronized with it). Re-arms the flag: the claim
    /// word is reset on `dev`'s stream, ordered before any later kernel.
    pub(crate) fn take(&self, dev: &CudaDevice) -> Result<()> {
        // SAFETY: `host` is live; the device wrote it before the synchronization the caller made.
        let rec = unsafe { std::ptr::read_volatile(self.host) };
        if rec.set == 0 {
            return Ok(());
        }
        // SAFETY: as above; the claim word is ours and 4 bytes long.
        unsafe {
            std::ptr::write_volatile(self.host, Record::default());
            dev.ctx.bind_to_thread().map_err(|e| driver_err("cuCtxSetCurrent", e))?;
            result::memset_d8_async(self.claim, 0, 4, dev.stream().cu_stream())
                .map_err(|e| driver_err("cuMemsetD8Async(error flag)", e))?;
        }
        Err(rec.error())
    }
}

impl Drop for ErrorFlag {
    fn drop(&mut self) {
        // SAFETY: both were allocated in `new` and nothing uses them after the device is gone.
        // Failures would only leak; there is nothing better to do in a destructor.
        super::sync::host_wait_in_drop("cuMemFree(error flag)", || unsafe {
            let _ = self.ctx.bind_to_thread();
            let _ = result::free_sync(self.claim);
            let _ = result::free_host(self.host as *mut _);
        });
    }
}

impl CudaDevice {
    /// `Err(IndexOutOfRange)` when a kernel met a bad index since the last check. Call only right
    /// after synchronizing with the device (a host read, `synchronize`).
    pub(crate) fn take_device_error(&self) -> Result<()> {
        self.error_flag.take(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_names_the_op_and_the_value() {
        let r = Record { set: 1, op: IndexOp::CrossEntropyTarget as i32, value: -3, size: 10 };
        assert!(matches!(r.error(), Error::IndexOutOfRange { op: "cross_entropy target", index: -3, size: 10 }));
        assert_eq!(std::mem::size_of::<Record>(), 24, "FgErrorRecord is 24 bytes");
        let unknown = Record { set: 1, op: 99, value: 7, size: 2 };
        assert!(unknown.error().to_string().contains('7'));
    }

    #[test]
    fn reported_as_renames_inside_its_scope_only() {
        assert_eq!(reported_op(IndexOp::IndexSelect), IndexOp::IndexSelect);
        reported_as(IndexOp::Embedding, || {
            assert_eq!(reported_op(IndexOp::IndexSelect), IndexOp::Embedding);
        });
        assert_eq!(reported_op(IndexOp::Gather), IndexOp::Gather);
    }
}
