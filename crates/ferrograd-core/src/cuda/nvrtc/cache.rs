//! The kernel cache: prebuilt CUBINs, then memory, then disk, then NVRTC; and precompiling many
//! modules at once.

use super::arch::Arch;
use super::compiler::{compile_checked, nvrtc_info};
use super::disk::{DiskCache, Lookup};
use super::error::KernelError;
use super::include::find_cuda_include;
use super::key::CacheKey;
use super::prebuilt::{installed_prebuilt, PrebuiltKernels};
use super::report::{PrecompileEntry, PrecompileReport};
use super::source::{nvrtc_options, KernelSource};
use super::source_dir;
use std::collections::HashMap;
use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

/// Where a [`CompiledKernel`] came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Origin {
    /// Already compiled or read earlier in this process.
    Memory,
    /// Read from the on-disk cache.
    Disk,
    /// Compiled by NVRTC just now.
    Compiled,
    /// Shipped in the program ([`super::install_prebuilt`]).
    Prebuilt,
}

/// A CUBIN ready for `cuModuleLoadData`, and how it was obtained.
#[derive(Debug, Clone)]
pub struct CompiledKernel {
    /// The module's name.
    pub name: String,
    /// The architecture it was compiled for.
    pub arch: Arch,
    /// The cache key (hash of source, headers, options, NVRTC version and arch).
    pub key: CacheKey,
    /// The CUBIN bytes.
    pub cubin: Arc<[u8]>,
    /// `origin != Compiled`: no NVRTC compilation happened in this call.
    pub from_cache: bool,
    /// Memory, disk or a fresh compile.
    pub origin: Origin,
    /// NVRTC time for this kernel: measured now on a miss, as recorded in the entry on a hit.
    pub compile_time: Duration,
    /// Wall time of this call (lookup, and compile on a miss).
    pub elapsed: Duration,
    /// Why the disk cache was skipped or repaired (unreadable dir, corrupt entry, failed write).
    pub cache_warning: Option<String>,
}

#[derive(Clone)]
struct MemoryEntry {
    cubin: Arc<[u8]>,
    compile_time: Duration,
}

/// One key's slot: empty until its CUBIN is known. Locked for the whole lookup-or-compile, so two
/// threads asking for the same module pay NVRTC once, while other modules compile in parallel.
type Slot = Arc<Mutex<Option<MemoryEntry>>>;

/// Which prebuilt CUBINs a cache consults.
#[derive(Clone, Copy)]
enum PrebuiltLayer {
    /// Whatever the process installed, looked up at each call (so a cache made before the
    /// program installed its set still sees it).
    Installed,
    /// None: every module goes to memory, disk and NVRTC.
    Off,
    /// This set (tests).
    Given(&'static dyn PrebuiltKernels),
}

/// In-process cache over an optional [`DiskCache`] over NVRTC, after the prebuilt CUBINs.
pub struct KernelCache {
    prebuilt: PrebuiltLayer,
    disk: Option<DiskCache>,
    include_dir: OnceLock<Result<PathBuf, KernelError>>,
    // The map's lock is held only to find or add a slot, never across a compile.
    memory: Mutex<HashMap<CacheKey, Slot>>,
}

/// Not derived: the map holds CUBIN bytes nobody wants in a debug print.
impl fmt::Debug for KernelCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let entries = self.memory.lock().map_or(0, |m| m.len());
        f.debug_struct("KernelCache")
            .field("prebuilt", &self.prebuilt().map(|p| p.describe()))
            .field("disk", &self.disk)
            .field("include_dir", &self.include_dir.get())
            .field("entries_in_memory", &entries)
            .finish()
    }
}

impl KernelCache {
    /// A cache with an optional disk layer, after the installed prebuilt CUBINs.
    pub fn new(disk: Option<DiskCache>) -> KernelCache {
        KernelCache {
            prebuilt: PrebuiltLayer::Installed,
            disk,
            include_dir: OnceLock::new(),
            memory: Mutex::new(HashMap::new()),
        }
    }

    /// Consult `prebuilt` instead of the installed set (`None`: no prebuilt CUBINs, every module
    /// from memory, disk or NVRTC).
    pub fn with_prebuilt(self, prebuilt: Option<&'static dyn PrebuiltKernels>) -> KernelCache {
        KernelCache { prebuilt: prebuilt.map_or(PrebuiltLayer::Off, PrebuiltLayer::Given), ..self }
    }

    /// The prebuilt CUBINs this cache consults, if any.
    pub fn prebuilt(&self) -> Option<&'static dyn PrebuiltKernels> {
        match self.prebuilt {
            PrebuiltLayer::Installed => installed_prebuilt(),
            PrebuiltLayer::Off => None,
            PrebuiltLayer::Given(p) => Some(p),
        }
    }

    /// Disk cache from [`DiskCache::from_env`], headers from [`find_cuda_include`].
    pub fn from_env() -> KernelCache {
        KernelCache::new(DiskCache::from_env())
    }

    /// Use these headers instead of searching.
    pub fn with_include_dir(self, dir: impl Into<PathBuf>) -> KernelCache {
        let include_dir = OnceLock::new();
        let _ = include_dir.set(Ok(dir.into()));
        KernelCache { include_dir, ..self }
    }

    /// The disk layer, if any.
    pub fn disk(&self) -> Option<&DiskCache> {
        self.disk.as_ref()
    }

    /// Searched only on the first miss: a process whose kernels are all cached needs no headers.
    fn include_dir(&self) -> Result<&Path, KernelError> {
        self.include_dir.get_or_init(find_cuda_include).as_deref().map_err(Clone::clone)
    }

    fn slot(&self, key: CacheKey) -> Slot {
        // A panic while holding the lock cannot leave a half-inserted slot, so the map is still
        // sound after poisoning.
        let mut memory = self.memory.lock().unwrap_or_else(PoisonError::into_inner);
        Arc::clone(memory.entry(key).or_default())
    }

    /// The CUBIN of `kernel` for `arch`: prebuilt, else from memory, else disk, else NVRTC (then
    /// stored in both). Errors only when no CUBIN can be had; cache trouble becomes
    /// `cache_warning`.
    pub fn get_or_compile(&self, kernel: &KernelSource<'_>, arch: Arch) -> Result<CompiledKernel, KernelError> {
        self.lookup(kernel, arch, true)
    }

    /// [`KernelCache::get_or_compile`] without the prebuilt CUBINs: what a device falls back to
    /// when it refuses a prebuilt one (a driver older than the NVRTC that built it).
    pub fn get_or_compile_from_source(
        &self,
        kernel: &KernelSource<'_>,
        arch: Arch,
    ) -> Result<CompiledKernel, KernelError> {
        self.lookup(kernel, arch, false)
    }

    fn lookup(&self, kernel: &KernelSource<'_>, arch: Arch, prebuilt: bool) -> Result<CompiledKernel, KernelError> {
        let start = Instant::now();
        let kernel = &source_dir::with_override(kernel)?;
        let mut warning = None;
        // Before NVRTC is even loaded: a program whose modules are all prebuilt needs none.
        if let Some(p) = self.prebuilt().filter(|_| prebuilt) {
            let key = kernel.cache_key(arch, p.nvrtc());
            match p.get(&key) {
                Ok(Some(hit)) => {
                    return Ok(CompiledKernel {
                        name: kernel.name.to_string(),
                        arch: kernel.target(arch),
                        key,
                        cubin: hit.cubin,
                        from_cache: true,
                        origin: Origin::Prebuilt,
                        compile_time: hit.compile_time,
                        elapsed: start.elapsed(),
                        cache_warning: None,
                    })
                }
                Ok(None) => {}
                Err(why) => warning = Some(format!("prebuilt {} unusable ({why}); compiled", kernel.name)),
            }
        }
        let arch = kernel.target(arch);
        let info = nvrtc_info()?;
        info.check_arch(arch)?;
        let options = nvrtc_options(arch, kernel);
        let key = CacheKey::new(kernel.name, kernel.src, kernel.headers, &options, info.version, arch);
        let done = |entry: &MemoryEntry, origin: Origin, cache_warning: Option<String>| CompiledKernel {
            name: kernel.name.to_string(),
            arch,
            key,
            cubin: Arc::clone(&entry.cubin),
            from_cache: origin != Origin::Compiled,
            origin,
            compile_time: entry.compile_time,
            elapsed: start.elapsed(),
            cache_warning,
        };

        let slot = self.slot(key);
        // Poisoning: a panic mid-compile leaves the slot empty, which only means "compile again".
        let mut slot = slot.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(entry) = slot.as_ref() {
            return Ok(done(entry, Origin::Memory, None));
        }

        if let Some(disk) = &self.disk {
            match disk.get(&key) {
                Ok(Lookup::Hit(hit)) => {
                    let entry = MemoryEntry { cubin: hit.cubin.into(), compile_time: hit.compile_time };
                    *slot = Some(entry.clone());
                    return Ok(done(&entry, Origin::Disk, None));
                }
                Ok(Lookup::Miss) => {}
                Ok(Lookup::Corrupt(why)) => {
                    warning =
                        Some(format!("corrupt cache entry {} ({why}); recompiled", disk.path_for(&key).display()));
                }
                Err(e) => {
                    warning = Some(cache_io_warning("read", &disk.path_for(&key), &e));
                }
            }
        }

        let include_dir = self.include_dir()?;
        let t0 = Instant::now();
        let cubin = compile_checked(kernel, arch, &options, include_dir)?;
        let compile_time = t0.elapsed();

        if let Some(disk) = &self.disk {
            if let Err(e) = disk.put(&key, &cubin, compile_time) {
                warning = Some(cache_io_warning("write", &disk.path_for(&key), &e));
            }
        }
        let entry = MemoryEntry { cubin: cubin.into(), compile_time };
        *slot = Some(entry.clone());
        Ok(done(&entry, Origin::Compiled, warning))
    }

    /// Compile (or find) every kernel for `arch`, several at once: NVRTC compiles one program on
    /// one thread, and a cold cache of a dozen modules took 14-24 s one after another on a 16-core
    /// GPU machine; in parallel it takes about as long as the largest module. Per-kernel failures
    /// are in the report (in the order given); only a missing NVRTC or an unsupported `arch`,
    /// which would fail every kernel, is an `Err`, and not when prebuilt CUBINs may serve them.
    pub fn precompile(&self, arch: Arch, kernels: &[KernelSource<'_>]) -> Result<PrecompileReport, KernelError> {
        let start = Instant::now();
        if self.prebuilt().is_none() {
            nvrtc_info()?.check_arch(arch)?;
        }
        let threads = std::thread::available_parallelism().map_or(4, |n| n.get()).clamp(1, kernels.len().max(1));
        let next = AtomicUsize::new(0);
        let results: Vec<BatchSlot> = kernels.iter().map(|_| Mutex::new(None)).collect();
        let order = longest_first(kernels);
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| self.drain(kernels, &order, &next, &results, arch));
            }
        });
        let entries = kernels
            .iter()
            .zip(results)
            .map(|(k, r)| PrecompileEntry {
                name: k.name.to_string(),
                result: r.into_inner().unwrap_or_else(PoisonError::into_inner).unwrap_or_else(|| {
                    Err(KernelError::Nvrtc {
                        name: k.name.to_string(),
                        call: "precompile thread",
                        code: "panicked".into(),
                    })
                }),
            })
            .collect();
        Ok(PrecompileReport {
            arch,
            cache_dir: self.disk.as_ref().map(|d| d.dir().to_path_buf()),
            kernels: entries,
            elapsed: start.elapsed(),
            threads,
        })
    }
}

/// Where one compile of a parallel batch leaves its result.
pub(super) type BatchSlot = Mutex<Option<Result<CompiledKernel, KernelError>>>;

/// Indices of `kernels`, longest expected compile first (LPT scheduling): a long module started
/// last would finish alone while the other threads sit idle.
pub(super) fn longest_first(kernels: &[KernelSource<'_>]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..kernels.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(kernels[i].expected_ms()));
    order
}

impl KernelCache {
    /// One worker of a parallel batch (`precompile`'s scoped threads, `warm`'s detached ones):
    /// takes the next index of `order` until none is left and puts that kernel's CUBIN, or why
    /// there is none, in its slot of `results`.
    pub(super) fn drain(
        &self,
        kernels: &[KernelSource<'_>],
        order: &[usize],
        next: &AtomicUsize,
        results: &[BatchSlot],
        arch: Arch,
    ) {
        loop {
            let n = next.fetch_add(1, Ordering::Relaxed);
            let Some(&i) = order.get(n) else { break };
            let r = self.get_or_compile(&kernels[i], arch);
            *results[i].lock().unwrap_or_else(PoisonError::into_inner) = Some(r);
        }
    }
}

/// Said once per process on stderr as well as in the result: a cache that silently never works
/// costs seconds at every start and nobody would know why.
fn cache_io_warning(op: &str, path: &Path, e: &io::Error) -> String {
    static SAID: AtomicBool = AtomicBool::new(false);
    let msg = format!("kernel cache {op} failed at {}: {e}; compiling without it", path.display());
    if !SAID.swap(true, Ordering::Relaxed) {
        eprintln!("ferrograd: {msg}");
    }
    msg
}

/// The process-wide cache, configured from the environment on first use.
pub fn global() -> &'static KernelCache {
    static GLOBAL: OnceLock<KernelCache> = OnceLock::new();
    GLOBAL.get_or_init(KernelCache::from_env)
}

/// [`KernelCache::get_or_compile`] on the [`global`] cache.
pub fn get_or_compile(kernel: &KernelSource<'_>, arch: Arch) -> Result<CompiledKernel, KernelError> {
    global().get_or_compile(kernel, arch)
}

/// [`KernelCache::precompile`] on the [`global`] cache: `ferrograd kernels --precompile`.
pub fn precompile(arch: Arch, kernels: &[KernelSource<'_>]) -> Result<PrecompileReport, KernelError> {
    global().precompile(arch, kernels)
}
