//! What persistent kernels need from the driver: cooperative launch (every block resident, so a
//! kernel may synchronise its whole grid), occupancy queries to size that grid, a non-blocking
//! "is the stream done" poll, and mapped pinned host memory that a running kernel writes and the
//! host reads while it runs (progress without stopping the GPU).

use super::device::{driver_err, CudaDevice};
use super::modules::Module;
use crate::{Error, Result};
use cudarc::driver::{result, sys, CudaFunction};

impl CudaDevice {
    /// Whether kernels on this device may be launched cooperatively (`cuLaunchCooperativeKernel`).
    pub fn supports_cooperative_launch(&self) -> Result<bool> {
        self.ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH)
            .map(|v| v != 0)
            .map_err(|e| driver_err("cuDeviceGetAttribute(COOPERATIVE_LAUNCH)", e))
    }

    /// The SM clock in kHz (the driver's nominal maximum), to turn `clock64()` counts into time.
    pub fn clock_rate_khz(&self) -> Result<u32> {
        self.ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CLOCK_RATE)
            .map(|v| v.max(0) as u32)
            .map_err(|e| driver_err("cuDeviceGetAttribute(CLOCK_RATE)", e))
    }

    /// `name` from `module`, compiled and loaded, allowed `shared_mem_bytes` of dynamic shared memory.
    fn func_with_smem(&self, module: &Module, name: &str, shared_mem_bytes: u32) -> Result<CudaFunction> {
        let f = self.func(module, name)?;
        if shared_mem_bytes > 48 * 1024 {
            f.set_attribute(
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                shared_mem_bytes as i32,
            )
            .map_err(|e| driver_err(&format!("cuFuncSetAttribute({name})"), e))?;
        }
        Ok(f)
    }

    /// How many blocks of `block` threads and `shared_mem_bytes` of dynamic shared memory one SM
    /// holds at once for kernel `name` (0: it does not fit at all). Compiles the module if needed.
    pub fn max_active_blocks_per_sm(
        &self,
        module: &Module,
        name: &str,
        block: u32,
        shared_mem_bytes: u32,
    ) -> Result<u32> {
        let f = self.func_with_smem(module, name, shared_mem_bytes)?;
        self.ctx.bind_to_thread().map_err(|e| driver_err("cuCtxSetCurrent", e))?;
        f.occupancy_max_active_blocks_per_multiprocessor(block, shared_mem_bytes as usize, None)
            .map_err(|e| driver_err(&format!("cuOccupancyMaxActiveBlocksPerMultiprocessor({name})"), e))
    }

    /// Launch `name` cooperatively on the compute stream: the driver guarantees that all `grid`
    /// blocks are resident together (or fails with COOPERATIVE_LAUNCH_TOO_LARGE), so the kernel may
    /// use grid-wide barriers. Same contract as [`CudaDevice::launch_raw`].
    ///
    /// # Safety
    /// `args` must point to values whose types and count match the kernel's parameters, and every
    /// device pointer among them must address live memory of the sizes the kernel touches.
    pub unsafe fn launch_cooperative_raw(
        &self,
        module: &Module,
        name: &str,
        grid: u32,
        block: u32,
        shared_mem_bytes: u32,
        args: &mut [*mut std::ffi::c_void],
    ) -> Result<()> {
        let f = self.func_with_smem(module, name, shared_mem_bytes)?;
        self.ctx.bind_to_thread().map_err(|e| driver_err("cuCtxSetCurrent", e))?;
        // SAFETY: the caller vouches for the arguments (see above).
        unsafe {
            result::launch_cooperative_kernel(
                f.cu_function(),
                (grid, 1, 1),
                (block, 1, 1),
                shared_mem_bytes,
                self.stream().cu_stream(),
                args,
            )
        }
        .map_err(|e| driver_err(&format!("cooperative launch {name} ({grid} blocks of {block})"), e))
    }

    /// Whether everything queued on the compute stream has finished, without waiting. A kernel
    /// that failed makes this an error (so a host polling loop never waits on a dead kernel).
    pub fn compute_stream_done(&self) -> Result<bool> {
        self.ctx.bind_to_thread().map_err(|e| driver_err("cuCtxSetCurrent", e))?;
        // SAFETY: a query on our own live stream.
        match unsafe { sys::cuStreamQuery(self.stream().cu_stream()) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            e => Err(driver_err("cuStreamQuery", e)),
        }
    }
}

/// Page-locked host memory mapped into the device's address space: a kernel stores to
/// `device_ptr()` and the host sees the values through `read` while the kernel is still running.
/// f32 slots only (what progress reporting needs); freed on drop.
pub struct MappedF32 {
    host: *mut f32,
    device: u64,
    len: usize,
}

// SAFETY: plain host memory owned by this handle alone; slot access is volatile.
unsafe impl Send for MappedF32 {}
unsafe impl Sync for MappedF32 {}

impl MappedF32 {
    /// `len` slots, each set to `fill`.
    pub fn new(dev: &CudaDevice, len: usize, fill: f32) -> Result<MappedF32> {
        let bytes = len.max(1) * 4;
        dev.ctx.bind_to_thread().map_err(|e| driver_err("cuCtxSetCurrent", e))?;
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // Page-locking host memory synchronizes: a counted host wait (`cuda/sync.rs`).
        // SAFETY: a fresh page-locked allocation; nothing else sees it yet.
        let host = super::sync::host_wait("cuMemHostAlloc", || {
            unsafe { result::malloc_host(bytes, flags) }
                .map_err(|e| driver_err(&format!("cuMemHostAlloc({bytes} bytes, mapped)"), e))
        })? as *mut f32;
        let mut device: sys::CUdeviceptr = 0;
        // SAFETY: `host` was allocated with DEVICEMAP above.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, host as *mut _, 0) };
        let buf = MappedF32 { host, device, len };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(driver_err("cuMemHostGetDevicePointer", r));
        }
        for i in 0..len {
            // SAFETY: i < len slots of the allocation.
            unsafe { std::ptr::write_volatile(host.add(i), fill) };
        }
        Ok(buf)
    }

    /// Elements held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The address a kernel writes to.
    pub fn device_ptr(&self) -> u64 {
        self.device
    }

    /// Slot `i` as the host sees it now (a kernel may be writing it concurrently; 4-byte stores
    /// are atomic, so the value is either the old or the new one).
    pub fn read(&self, i: usize) -> Result<f32> {
        if i >= self.len {
            return Err(Error::InvalidArgument(format!("mapped slot {i} of {}", self.len)));
        }
        // SAFETY: i < len; volatile because the device writes behind the compiler's back.
        Ok(unsafe { std::ptr::read_volatile(self.host.add(i)) })
    }

    /// Slot `i`'s bits (compare with a NaN sentinel by bits, never by value).
    pub fn read_bits(&self, i: usize) -> Result<u32> {
        if i >= self.len {
            return Err(Error::InvalidArgument(format!("mapped slot {i} of {}", self.len)));
        }
        // SAFETY: as in `read`.
        Ok(unsafe { std::ptr::read_volatile((self.host as *const u32).add(i)) })
    }
}

impl Drop for MappedF32 {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemHostAlloc in `new`; the owner synchronises before dropping.
        super::sync::host_wait_in_drop("cuMemFreeHost", || {
            let _ = unsafe { result::free_host(self.host as *mut _) };
        });
    }
}
