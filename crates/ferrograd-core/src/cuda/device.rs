//! One `CudaDevice` per ordinal, created on first use and kept for the process, with everything
//! that belongs to one GPU: the context, its streams (`cuda/stream.rs`: compute, copy and a pool of
//! user streams), the cuBLAS handle and its TF32 policy (`cuda/matmul.rs`), the caching allocator
//! and the loaded kernels. Nothing here is a process global, so several devices do not overwrite
//! each other's state.

use super::alloc::{AllocError, Allocation, CachingAllocator, MemoryStats, StreamId};
use super::driver::{DriverEvents, DriverMemory, COPY};
use super::launch::DeviceFuncs;
use super::matmul::Blas;
use super::modules::Module;
use super::nvrtc::{self, Arch, KernelError};
use super::probe::{self, CudaDeviceInfo};
use super::startup::Cost;
use super::stream::StreamTable;
use super::sync;
use crate::{Error, Result};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

/// One GPU's context, streams, caching allocator, cuBLAS handles and loaded kernels; shared by every
/// tensor on it. Get it with [`CudaDevice::get`] (opened once per process and ordinal).
pub struct CudaDevice {
    /// The device ordinal (`cuda:N`).
    pub ordinal: usize,
    /// Name, memory, compute capability and SM count.
    pub info: CudaDeviceInfo,
    /// The architecture kernels are compiled for (`sm_XY`).
    pub arch: Arch,
    /// Multiprocessors of this GPU: launch shapes fill this chip (`cuda/launch.rs`).
    sms: usize,
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) streams: Arc<StreamTable>,
    pub(crate) blas: Mutex<Blas>,
    /// f32 matmuls may use TF32 (`MatmulPrecision::High`); starts from the process default.
    pub(crate) tf32: AtomicBool,
    alloc: Mutex<CachingAllocator<DriverMemory, DriverEvents>>,
    /// Loaded modules and their kernels, by (module name, kernel name).
    funcs: DeviceFuncs,
    pending: Mutex<super::event::Pending>,
    /// Where kernels report a bad index for the next host read (`cuda/error_flag.rs`).
    pub(crate) error_flag: super::error_flag::ErrorFlag,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaDevice({}, {})", self.ordinal, self.info.name)
    }
}

pub(crate) fn driver_err(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Cuda(format!("{what}: {e:?}"))
}

/// Most parameters a kernel launched through `launch!` may take.
pub(crate) const MAX_KERNEL_ARGS: usize = 24;

/// A kernel's arguments as the driver takes them: pointers to the values, here on the stack. The
/// values are borrowed for `'a`, so they outlive the launch.
pub(crate) struct KernelArgs<'a> {
    ptrs: [*mut std::ffi::c_void; MAX_KERNEL_ARGS],
    len: usize,
    _values: std::marker::PhantomData<&'a ()>,
}

impl<'a> KernelArgs<'a> {
    #[inline]
    pub(crate) fn new() -> Self {
        KernelArgs { ptrs: [std::ptr::null_mut(); MAX_KERNEL_ARGS], len: 0, _values: std::marker::PhantomData }
    }

    /// Adds `v` as the next parameter (beyond `MAX_KERNEL_ARGS` the launch fails).
    #[inline]
    pub(crate) fn push<T: cudarc::driver::DeviceRepr>(&mut self, v: &'a T) {
        if let Some(p) = self.ptrs.get_mut(self.len) {
            *p = v as *const T as *mut std::ffi::c_void;
        }
        self.len += 1;
    }

    fn as_mut_slice(&mut self) -> Option<&mut [*mut std::ffi::c_void]> {
        self.ptrs.get_mut(..self.len)
    }
}

impl From<AllocError> for Error {
    fn from(e: AllocError) -> Self {
        match e {
            AllocError::OutOfMemory { requested, free, total, allocated, reserved, hint } => {
                Error::OutOfMemory { requested, free, total, allocated, reserved, hint }
            }
            AllocError::GraphCapture { call } => Error::GraphCapture { call },
            other => Error::Cuda(other.to_string()),
        }
    }
}

impl From<KernelError> for Error {
    fn from(e: KernelError) -> Self {
        match e {
            KernelError::NvrtcMissing { .. } | KernelError::NvrtcTooOld { .. } => {
                Error::CudaUnavailable { reason: e.to_string() }
            }
            other => Error::Kernel { name: other.kernel_name().unwrap_or("?").to_string(), msg: other.to_string() },
        }
    }
}

static DEVICES: OnceLock<Mutex<HashMap<usize, Arc<CudaDevice>>>> = OnceLock::new();

/// Whether this process has already opened a CUDA device (so stats can be read without creating one).
pub fn opened_devices() -> Vec<Arc<CudaDevice>> {
    DEVICES.get().map(|m| lock(m).values().cloned().collect()).unwrap_or_default()
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl CudaDevice {
    /// The device for `ordinal`, opened on first use.
    pub fn get(ordinal: usize) -> Result<Arc<CudaDevice>> {
        let map = DEVICES.get_or_init(Default::default);
        let mut map = lock(map);
        if let Some(d) = map.get(&ordinal) {
            return Ok(d.clone());
        }
        let d = Arc::new(Self::open(ordinal)?);
        map.insert(ordinal, d.clone());
        Ok(d)
    }

    fn open(ordinal: usize) -> Result<CudaDevice> {
        let info = probe::device_info(ordinal)?;
        let (maj, min) = info.compute_capability;
        let arch = Arch::from_compute_capability(maj, min)?;
        // NVRTC must be loadable before we promise a working device.
        nvrtc::nvrtc_info()?;
        let t = std::time::Instant::now();
        let ctx = CudaContext::new(ordinal).map_err(|e| driver_err("cuCtx", e))?;
        let streams = Arc::new(StreamTable::new(&ctx)?);
        super::startup::add(Cost::Context, t.elapsed());
        let blas = super::startup::timed(Cost::Cublas, || Blas::new(&streams, info.compute_capability))?;
        let mut alloc =
            CachingAllocator::new(DriverMemory { ctx: ctx.clone() }, DriverEvents::new(ctx.clone(), streams.clone()));
        alloc.set_memory_limit(super::alloc::memory_limit_from_env()?);
        let error_flag = super::error_flag::ErrorFlag::new(&ctx)?;
        Ok(CudaDevice {
            error_flag,
            ordinal,
            sms: (info.multiprocessors as usize).max(1),
            info,
            arch,
            ctx,
            streams,
            blas: Mutex::new(blas),
            tf32: AtomicBool::new(super::matmul::default_tf32()),
            alloc: Mutex::new(alloc),
            funcs: DeviceFuncs::default(),
            pending: Mutex::new(Default::default()),
        })
    }

    pub(crate) fn allocator(&self) -> MutexGuard<'_, CachingAllocator<DriverMemory, DriverEvents>> {
        lock(&self.alloc)
    }

    /// `bytes` of device memory for this thread's current stream.
    pub(crate) fn alloc_bytes(&self, bytes: usize) -> Result<Allocation> {
        Ok(self.allocator().allocate(bytes, self.current_stream_id())?)
    }

    /// `bytes` from the copy stream's pool (written by a prefetch before compute sees them).
    pub(crate) fn alloc_bytes_for_copy(&self, bytes: usize) -> Result<Allocation> {
        Ok(self.allocator().allocate(bytes, COPY)?)
    }

    /// Work on `stream` uses `a` too: its block must not be reused before that work is done.
    pub(crate) fn record_use(&self, a: &Allocation, stream: StreamId) -> Result<()> {
        Ok(self.allocator().record_stream(a, stream)?)
    }

    pub(crate) fn free(&self, a: Allocation) {
        if let Err(e) = self.allocator().free(a) {
            // Freeing only fails when the driver is broken; the block is then leaked on purpose.
            eprintln!("ferrograd: cuda free failed: {e}");
        }
    }

    /// Keep `keep` alive until `done` completes (asynchronous copies from host memory).
    pub(crate) fn defer(&self, done: super::event::Event, keep: Box<dyn Send + Sync>) {
        let mut p = lock(&self.pending);
        p.collect();
        p.push(done, keep);
    }

    /// One allocation and free through the caching allocator (what the alloc benchmark times).
    pub fn cached_alloc_free(&self, bytes: usize) -> Result<()> {
        let a = self.alloc_bytes(bytes)?;
        self.free(a);
        Ok(())
    }

    /// One raw `cuMemAlloc` + `cuMemFree`, bypassing the cache (the benchmark's baseline).
    pub fn raw_alloc_free(&self, bytes: usize) -> Result<()> {
        self.ctx.bind_to_thread().map_err(|e| driver_err("cuCtxSetCurrent", e))?;
        // SAFETY: a fresh allocation freed at once; nothing else sees the pointer.
        let p = sync::host_wait("cuMemAlloc", || unsafe {
            cudarc::driver::result::malloc_sync(bytes).map_err(|e| driver_err("cuMemAlloc", e))
        })?;
        // SAFETY: as above.
        sync::host_wait("cuMemFree", || unsafe {
            cudarc::driver::result::free_sync(p).map_err(|e| driver_err("cuMemFree", e))
        })
    }

    /// The caching allocator's counters (`torch.cuda.memory_stats()`).
    pub fn memory_stats(&self) -> MemoryStats {
        self.allocator().stats()
    }

    /// Reset every peak to the current value (`torch.cuda.reset_peak_memory_stats()`).
    pub fn reset_peak_stats(&self) {
        self.allocator().reset_peak_stats()
    }

    /// Return every cached, unused segment to the driver.
    pub fn empty_cache(&self) -> Result<()> {
        Ok(self.allocator().empty_cache()?)
    }

    /// Behave as if the card had only `limit` bytes (`None` lifts the cap).
    pub fn set_memory_limit(&self, limit: Option<usize>) {
        self.allocator().set_memory_limit(limit)
    }

    /// The allocator's cap, if one is set.
    pub fn memory_limit(&self) -> Option<usize> {
        self.allocator().memory_limit()
    }

    /// The driver's (free, total) bytes for this device.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        self.ctx.mem_get_info().map_err(|e| driver_err("cuMemGetInfo", e))
    }

    /// Block until all queued work on every stream of the device is done (a counted host wait);
    /// a bad index a kernel met since the last host read is reported here
    /// (`Error::IndexOutOfRange`).
    pub fn synchronize(&self) -> Result<()> {
        sync::host_wait("cuCtxSynchronize", || self.ctx.synchronize().map_err(|e| driver_err("cuCtxSynchronize", e)))?;
        // Every copy has finished: what they kept alive can go.
        lock(&self.pending).collect();
        self.take_device_error()
    }

    /// Multiprocessors of this GPU.
    pub fn sm_count(&self) -> usize {
        self.sms
    }

    /// The kernel `name` from `module`, compiling (or loading from the disk cache) on first use.
    /// Kernels are cached by (module, name): a model's kernel named like a core kernel is its own.
    pub(crate) fn func(&self, module: &Module, name: &str) -> Result<CudaFunction> {
        self.funcs.get(
            module,
            name,
            |m| self.load_cuda_module(m),
            |m, name| {
                m.load_function(name).map_err(|e| Error::Kernel {
                    name: name.to_string(),
                    msg: format!("not found in module {}: {e:?}", module.name),
                })
            },
        )
    }

    /// Launch `f` on this thread's current stream: the driver call itself, with the arguments'
    /// pointers on the stack (what the `launch!` macro ends in; cudarc's builder would collect
    /// them in a `Vec`).
    ///
    /// # Safety
    /// The arguments must match the kernel's parameters in type and count, and every device
    /// pointer among them must address live memory of the sizes the kernel touches.
    #[inline]
    pub(crate) unsafe fn launch_args(
        &self,
        f: &CudaFunction,
        name: &str,
        cfg: cudarc::driver::LaunchConfig,
        args: &mut KernelArgs<'_>,
    ) -> Result<()> {
        let Some(ptrs) = args.as_mut_slice() else {
            return Err(Error::Kernel {
                name: name.to_string(),
                msg: format!("more than {MAX_KERNEL_ARGS} arguments"),
            });
        };
        self.ctx.bind_to_thread().map_err(|e| driver_err("cuCtxSetCurrent", e))?;
        let _nvtx = super::nvtx::range_with(|| name.to_string());
        let span = super::profile::begin(self, || name.to_string());
        // SAFETY: the caller vouches for the arguments.
        let launched = unsafe {
            cudarc::driver::result::launch_kernel(
                f.cu_function(),
                cfg.grid_dim,
                cfg.block_dim,
                cfg.shared_mem_bytes,
                self.stream().cu_stream(),
                ptrs,
            )
        }
        .map_err(|e| driver_err(&format!("launch {name}"), e));
        if let Some(span) = span {
            span.end(self);
        }
        launched
    }

    /// Launch `name` from an embedded `module` (a model's own fused kernels) on the current stream.
    ///
    /// # Safety
    /// `args` must point to values whose types and count match the kernel's parameters, and every
    /// device pointer among them must address live memory of the sizes the kernel touches.
    pub unsafe fn launch_raw(
        &self,
        module: &Module,
        name: &str,
        grid: u32,
        block: u32,
        shared_mem_bytes: u32,
        args: &mut [*mut std::ffi::c_void],
    ) -> Result<()> {
        let f = self.func(module, name)?;
        if shared_mem_bytes > 48 * 1024 {
            f.set_attribute(
                cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                shared_mem_bytes as i32,
            )
            .map_err(|e| driver_err(&format!("cuFuncSetAttribute({name})"), e))?;
        }
        self.ctx.bind_to_thread().map_err(|e| driver_err("cuCtxSetCurrent", e))?;
        // SAFETY: the caller vouches for the arguments (see above).
        unsafe {
            cudarc::driver::result::launch_kernel(
                f.cu_function(),
                (grid, 1, 1),
                (block, 1, 1),
                shared_mem_bytes,
                self.stream().cu_stream(),
                args,
            )
        }
        .map_err(|e| driver_err(&format!("launch {name}"), e))
    }

    /// Shared memory one block may use once it opts in (227 KiB on Hopper, 163 KiB on A100).
    pub fn max_shared_memory_per_block(&self) -> Result<usize> {
        self.ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map(|v| v.max(0) as usize)
            .map_err(|e| driver_err("cuDeviceGetAttribute", e))
    }

    /// Compile (or fetch from the disk cache) and load `module` into this context, once.
    pub fn load_module(&self, module: &Module) -> Result<Arc<CudaModule>> {
        self.funcs.module(module, |m| self.load_cuda_module(m))
    }

    /// Start compiling `modules` for this GPU in the background, all at once (`nvrtc::warm`): a
    /// run that knows its modules calls this first, so that a cold kernel cache costs it about its
    /// longest module instead of their sum. Loading into the context stays with [`load_module`].
    ///
    /// [`load_module`]: CudaDevice::load_module
    pub fn warm(&self, modules: &[&'static Module]) -> nvrtc::Warm {
        nvrtc::warm(self.arch, modules)
    }

    /// The names of the modules loaded into this context so far, sorted (what a run really used:
    /// the tests compare it with the modules a run warms).
    pub fn loaded_modules(&self) -> Vec<&'static str> {
        self.funcs.names()
    }

    fn load_cuda_module(&self, module: &Module) -> Result<Arc<CudaModule>> {
        sync::not_capturable("cuModuleLoadData")?;
        super::startup::timed(Cost::KernelModules, || {
            let compiled = nvrtc::get_or_compile(&module.source(), self.arch)?;
            if !compiled.from_cache {
                super::startup::add(Cost::Nvrtc, compiled.compile_time);
            }
            if log_modules() {
                // Waiting for a warm start's compile shows as a `memory` origin with a long wait.
                eprintln!(
                    "ferrograd: module {} from {:?} in {:.1} ms (NVRTC {:.1} ms)",
                    module.name,
                    compiled.origin,
                    compiled.elapsed.as_secs_f64() * 1e3,
                    compiled.compile_time.as_secs_f64() * 1e3
                );
            }
            let load = |cubin: &[u8]| {
                self.ctx
                    .load_module(cudarc::nvrtc::Ptx::from_binary(cubin.to_vec()))
                    .map_err(|e| driver_err(&format!("cuModuleLoadData({})", module.name), e))
            };
            match load(&compiled.cubin) {
                // A driver older than the NVRTC that built a prebuilt CUBIN refuses it; this
                // machine's NVRTC (if any) builds one the driver takes.
                Err(refused) if compiled.origin == nvrtc::Origin::Prebuilt => {
                    let own = nvrtc::global().get_or_compile_from_source(&module.source(), self.arch).map_err(|e| {
                        Error::Cuda(format!(
                            "{refused} (a prebuilt CUBIN); compiling {} instead failed: {e}",
                            module.name
                        ))
                    })?;
                    if !own.from_cache {
                        super::startup::add(Cost::Nvrtc, own.compile_time);
                    }
                    load(&own.cubin)
                }
                loaded => loaded,
            }
        })
    }
}

/// `FERROGRAD_LOG_MODULES=1`: one stderr line per module a context loads (name, where its CUBIN
/// came from, the time it took), to see what a run compiles and waits for.
fn log_modules() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("FERROGRAD_LOG_MODULES").is_ok_and(|v| v.trim() == "1"))
}
