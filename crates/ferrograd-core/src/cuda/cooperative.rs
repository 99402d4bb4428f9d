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

    /// [`CudaDevice::launch_cooperative_raw`] with thread-block clusters of `cluster` blocks
    /// (`cuLaunchKernelEx`, cooperative and cluster-dimension attributes; sm_90 and later): the
    /// blocks of a cluster share their shared memory (DSMEM) and a hardware cluster barrier, ~20x
    /// cheaper than a grid barrier through L2 (bench/kernels/cluster_probe.py on an H100: 0.045
    /// against 1.03 us). Clusters over 8 blocks are allowed (non-portable). How many clusters are
    /// co-resident depends on the chip, not only on its model (its GPCs hold different numbers of
    /// SMs) and, measured, on the process: at 512 threads and 154 KiB a block the probe
    /// (bench/kernels/cluster_probe.py) ran 33 clusters of 4 on an H100 where this launch, same
    /// GPU, fits 30 (tests/core_suite/cuda_clusters.rs; 15 of 8, 7 of 16; the cause is not found yet). A grid
    /// that does not fit is an `Error::Cuda` naming CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE
    /// (nothing runs), and the caller sizes its grid down a cluster at a time (the test does).
    /// `grid` must be a multiple of `cluster`, 1 <= cluster <= 16.
    ///
    /// # Safety
    /// As [`CudaDevice::launch_cooperative_raw`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn launch_cooperative_cluster_raw(
        &self,
        module: &Module,
        name: &str,
        grid: u32,
        cluster: u32,
        block: u32,
        shared_mem_bytes: u32,
        args: &mut [*mut std::ffi::c_void],
    ) -> Result<()> {
        check_cluster(grid, cluster)?;
        let f = self.func_with_smem(module, name, shared_mem_bytes)?;
        if cluster > 8 {
            f.set_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
                .map_err(|e| driver_err(&format!("cuFuncSetAttribute({name}, non-portable clusters)"), e))?;
        }
        self.ctx.bind_to_thread().map_err(|e| driver_err("cuCtxSetCurrent", e))?;
        let mut attrs = [launch_attr(sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION); 2];
        attrs[0].value.clusterDim = sys::CUlaunchAttributeValue_union__bindgen_ty_1 { x: cluster, y: 1, z: 1 };
        attrs[1] = launch_attr(sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_COOPERATIVE);
        attrs[1].value.cooperative = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: grid,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: shared_mem_bytes,
            hStream: self.stream().cu_stream(),
            attrs: attrs.as_mut_ptr(),
            numAttrs: attrs.len() as u32,
        };
        // SAFETY: the caller vouches for the arguments; `config` and `attrs` outlive the call.
        let r = unsafe { sys::cuLaunchKernelEx(&config, f.cu_function(), args.as_mut_ptr(), std::ptr::null_mut()) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(driver_err(
                &format!("cooperative launch {name} ({grid} blocks of {block} in clusters of {cluster})"),
                r,
            ));
        }
        Ok(())
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

/// The shapes a cluster launch accepts: 1 to 16 blocks a cluster (over 8 is non-portable), and a
/// grid of whole clusters. A typed error names the rule broken.
pub fn check_cluster(grid: u32, cluster: u32) -> Result<()> {
    if !(1..=16).contains(&cluster) {
        return Err(Error::InvalidArgument(format!("cluster of {cluster} blocks: expected 1 to 16")));
    }
    if grid == 0 || !grid.is_multiple_of(cluster) {
        return Err(Error::InvalidArgument(format!(
            "grid of {grid} blocks in clusters of {cluster}: the grid must be a positive multiple of the cluster"
        )));
    }
    Ok(())
}

/// A launch attribute `id` with a zeroed value (the caller sets the field `id` uses).
fn launch_attr(id: sys::CUlaunchAttributeID) -> sys::CUlaunchAttribute {
    sys::CUlaunchAttribute { id, pad: [0; 4], value: sys::CUlaunchAttributeValue { pad: [0; 64] } }
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

#[cfg(test)]
mod tests {
    use super::check_cluster;

    #[test]
    fn cluster_shapes_are_checked_before_the_driver() {
        assert!(check_cluster(132, 1).is_ok());
        assert!(check_cluster(132, 2).is_ok());
        assert!(check_cluster(128, 16).is_ok());
        for (grid, cluster, says) in
            [(132, 0, "1 to 16"), (128, 17, "1 to 16"), (132, 8, "multiple"), (0, 2, "multiple")]
        {
            let e = check_cluster(grid, cluster).expect_err("a bad shape");
            assert!(e.to_string().contains(says), "{e}");
        }
    }
}
