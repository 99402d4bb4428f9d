//! Managed (unified) memory: one allocation (`cuMemAllocManaged`) with a single address valid on
//! the host and on the device; the driver migrates pages to whichever side touches them. Opt-in
//! (`Tensor::to_unified`): it trades explicit copies for page faults, which pays for data read
//! sparsely or by the host and the device in turn, and loses to a pinned copy for data read whole
//! (the guide's "managed vs explicit copies" row measures which).
//!
//! The library issues the hints itself: a new managed tensor is advised to prefer its GPU and
//! prefetched there on the current stream, so the first kernel does not fault page by page; host
//! reads prefetch back to the CPU first.
//!
//! Oversubscribing managed memory (more than the device's free memory) can thrash or hang a GPU,
//! so [`check_fits`] refuses such an allocation with a typed `OutOfMemory` error before the driver
//! sees it. These allocations bypass the caching allocator: each one is its own `cuMemAllocManaged`
//! and is freed (`cuMemFree`, which waits for work still using it) when its last tensor drops.

use super::device::{driver_err, CudaDevice};
use super::sync::{host_wait, host_wait_in_drop, not_capturable};
use crate::{Device, Error, Result};
use cudarc::driver::{result, sys};
use std::sync::Arc;

/// Free device memory a managed allocation must leave untouched (the context, cuBLAS workspaces
/// and the allocator's next block need room); oversubscription starts before `free` reaches 0.
pub const MANAGED_HEADROOM: usize = 256 << 20;

/// The oversubscription guard: `requested` managed bytes against the device's `free` bytes
/// (`cuMemGetInfo`). Pure, so the rule is tested without a GPU.
pub fn check_fits(requested: usize, free: usize, total: usize) -> Result<()> {
    if requested.saturating_add(MANAGED_HEADROOM) <= free {
        return Ok(());
    }
    Err(Error::OutOfMemory {
        requested,
        free,
        total,
        allocated: 0,
        reserved: 0,
        hint: format!(
            "managed memory larger than the device's free memory less {} MiB is refused: \
             oversubscribing unified memory can thrash or hang the GPU; free cached blocks \
             (CudaDevice::empty_cache) or use an explicit copy",
            MANAGED_HEADROOM >> 20
        ),
    })
}

/// A hint to the driver about how a managed range is used (`cuMemAdvise`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Advice {
    /// Read from several places, rarely written: the driver keeps read-only copies.
    ReadMostly,
    /// Keep the pages on this device (or the host) unless something else needs them.
    PreferredLocation(Device),
    /// This device maps the pages and reads them without migrating them.
    AccessedBy(Device),
}

fn location(d: Device) -> sys::CUmemLocation {
    match d {
        Device::Cpu => sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST, id: 0 },
        Device::Cuda(i) => {
            sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: i as i32 }
        }
    }
}

/// One managed allocation; freed when dropped.
pub struct ManagedAlloc {
    dev: Arc<CudaDevice>,
    ptr: u64,
    bytes: usize,
    /// Whether the GPU may access managed memory while the host does (prefetch and advice work
    /// only then; without it every host access must follow a device synchronisation, which is
    /// what the host views do anyway).
    concurrent: bool,
}

// SAFETY: a device address and a handle to the device; the memory itself is guarded by the API
// (host views synchronise first).
unsafe impl Send for ManagedAlloc {}
unsafe impl Sync for ManagedAlloc {}

impl ManagedAlloc {
    /// `bytes` of managed memory attached globally (every stream may use it), after the
    /// oversubscription guard.
    pub fn new(dev: &Arc<CudaDevice>, bytes: usize) -> Result<ManagedAlloc> {
        not_capturable("cuMemAllocManaged")?;
        dev.ctx.bind_to_thread().map_err(|e| driver_err("cuCtxSetCurrent", e))?;
        let supported = dev.ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY).unwrap_or(0);
        if supported == 0 {
            return Err(Error::Cuda(format!("cuda:{}: the device does not support managed memory", dev.ordinal)));
        }
        let concurrent =
            dev.ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS).unwrap_or(0) != 0;
        let (free, total) = dev.mem_info()?;
        check_fits(bytes, free, total)?;
        let ptr = host_wait("cuMemAllocManaged", || {
            // SAFETY: a plain allocation in the bound context; at least one byte.
            unsafe { result::malloc_managed(bytes.max(1), sys::CUmemAttach_flags::CU_MEM_ATTACH_GLOBAL) }
                .map_err(|e| driver_err(&format!("cuMemAllocManaged({bytes} bytes)"), e))
        })?;
        Ok(ManagedAlloc { dev: dev.clone(), ptr, bytes, concurrent })
    }

    /// The address, valid on the host and on the device.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Bytes allocated.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Whether prefetch and advice take effect on this device.
    pub fn concurrent(&self) -> bool {
        self.concurrent
    }

    /// Migrates the pages to `to` on the thread's current stream (`cuMemPrefetchAsync`); the host
    /// does not wait. A no-op where the device lacks concurrent managed access.
    pub fn prefetch(&self, to: Device) -> Result<()> {
        if !self.concurrent || self.bytes == 0 {
            return Ok(());
        }
        not_capturable("cuMemPrefetchAsync")?;
        self.dev.ctx.bind_to_thread().map_err(|e| driver_err("cuCtxSetCurrent", e))?;
        // SAFETY: the range is this live managed allocation; the stream is the device's.
        unsafe { sys::cuMemPrefetchAsync_v2(self.ptr, self.bytes, location(to), 0, self.dev.stream().cu_stream()) }
            .result()
            .map_err(|e| driver_err("cuMemPrefetchAsync", e))
    }

    /// Tells the driver how the range is used (`cuMemAdvise`). A no-op where the device lacks
    /// concurrent managed access.
    pub fn advise(&self, advice: Advice) -> Result<()> {
        if !self.concurrent || self.bytes == 0 {
            return Ok(());
        }
        use sys::CUmem_advise::*;
        let (a, loc) = match advice {
            Advice::ReadMostly => (CU_MEM_ADVISE_SET_READ_MOSTLY, location(Device::Cuda(self.dev.ordinal))),
            Advice::PreferredLocation(d) => (CU_MEM_ADVISE_SET_PREFERRED_LOCATION, location(d)),
            Advice::AccessedBy(d) => (CU_MEM_ADVISE_SET_ACCESSED_BY, location(d)),
        };
        self.dev.ctx.bind_to_thread().map_err(|e| driver_err("cuCtxSetCurrent", e))?;
        // SAFETY: the range is this live managed allocation.
        unsafe { sys::cuMemAdvise_v2(self.ptr, self.bytes, a, loc) }.result().map_err(|e| driver_err("cuMemAdvise", e))
    }

    /// Waits for the device (the host may touch managed pages only when no kernel uses them) and
    /// moves the pages to the host ahead of the reads.
    pub fn host_ready(&self) -> Result<()> {
        self.prefetch(Device::Cpu)?;
        self.dev.synchronize()
    }

    /// The bytes, on the host. The caller has called [`ManagedAlloc::host_ready`] and queues no
    /// device work on the range while the slice lives.
    ///
    /// # Safety
    /// No device work may write the range while the slice is alive.
    pub unsafe fn host_slice(&self) -> &[u8] {
        // SAFETY (caller): the device is idle on this range; the address is valid on the host.
        unsafe { std::slice::from_raw_parts(self.ptr as usize as *const u8, self.bytes) }
    }

    /// The bytes, writable on the host.
    ///
    /// # Safety
    /// As [`ManagedAlloc::host_slice`], and nothing else reads or writes the range meanwhile.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn host_slice_mut(&self) -> &mut [u8] {
        // SAFETY (caller): exclusive host access to an idle managed range.
        unsafe { std::slice::from_raw_parts_mut(self.ptr as usize as *mut u8, self.bytes) }
    }
}

impl Drop for ManagedAlloc {
    fn drop(&mut self) {
        let _ = self.dev.ctx.bind_to_thread();
        host_wait_in_drop("cuMemFree(managed)", || {
            // SAFETY: allocated by `new`, freed once; cuMemFree waits for work still using it.
            let _ = unsafe { result::free_sync(self.ptr) };
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guard_refuses_oversubscription_with_a_typed_error() {
        let gib = 1usize << 30;
        assert!(check_fits(gib, 4 * gib, 8 * gib).is_ok());
        match check_fits(4 * gib, 4 * gib, 8 * gib) {
            Err(Error::OutOfMemory { requested, free, total, hint, .. }) => {
                assert_eq!((requested, free, total), (4 * gib, 4 * gib, 8 * gib));
                assert!(hint.contains("oversubscribing"), "{hint}");
            }
            other => panic!("expected OutOfMemory, got {other:?}"),
        }
        // The headroom counts: exactly free less the headroom fits, one byte more does not.
        assert!(check_fits(gib - MANAGED_HEADROOM, gib, gib).is_ok());
        assert!(check_fits(gib - MANAGED_HEADROOM + 1, gib, gib).is_err());
        // No overflow at the top of the range.
        assert!(check_fits(usize::MAX, gib, gib).is_err());
    }
}
