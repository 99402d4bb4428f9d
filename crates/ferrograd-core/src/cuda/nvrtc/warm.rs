//! Warm start: compile the kernel modules a run is about to need, all at once, before it needs them.
//!
//! A module is compiled (or read from the disk cache) when the first kernel in it launches, on the
//! launching thread. On a cold cache (a new machine, a new ferrograd version, an emptied
//! `FERROGRAD_CACHE_DIR`) a run therefore paid its modules' NVRTC times one after another, each
//! single-threaded, while the GPU and the other cores waited. A run that knows its modules
//! (Monster Walk's training, for one) calls [`KernelCache::warm`] first: the compiles start on all
//! cores, longest first, and the call returns at once. A launch that needs a module while it
//! compiles waits for that compile (the cache's per-module slot), one that needs a module not
//! started yet compiles it itself, so nothing compiles twice and nothing waits longer than it would
//! have without warming. On a warm cache each module is one disk read.
//!
//! Unlike `ferrograd kernels --precompile`, which fills the cache with every module, a warm start
//! compiles only the run's own. `FERROGRAD_WARM=0` turns it off (to measure both sides).

use super::arch::Arch;
use super::cache::{global, longest_first, BatchSlot, KernelCache, Origin};
use super::error::KernelError;
use super::source::{KernelSource, Module};
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::thread::JoinHandle;

/// `FERROGRAD_WARM=0` turns warm starts off.
pub const WARM_ENV: &str = "FERROGRAD_WARM";

/// Whether warm starts are on (read once): everything but `FERROGRAD_WARM=0`.
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var(WARM_ENV).map_or(true, |v| v.trim() != "0"))
}

/// Compiles started by [`KernelCache::warm`]. Dropping it leaves them running: each ends in the
/// cache (and on disk, written atomically), where the run's launches find it.
#[derive(Debug)]
pub struct Warm {
    names: Vec<&'static str>,
    results: Arc<Vec<BatchSlot>>,
    threads: Vec<JoinHandle<()>>,
}

impl Warm {
    /// The modules being compiled or read, longest expected compile first (duplicates and modules
    /// the architecture does not run left out).
    pub fn modules(&self) -> &[&'static str] {
        &self.names
    }

    /// Wait for every compile: per module, where its CUBIN came from, or why it could not be had
    /// (a launch from that module reports the same error). A module whose thread could not start
    /// is reported as not compiled: `Err(KernelError::Nvrtc { call: "warm thread", .. })`.
    pub fn wait(self) -> Vec<(&'static str, Result<Origin, KernelError>)> {
        for t in self.threads {
            // A panicking compile leaves its slot empty: reported below as not compiled.
            let _ = t.join();
        }
        self.names
            .iter()
            .zip(self.results.iter())
            .map(|(&name, r)| {
                let r = r.lock().unwrap_or_else(PoisonError::into_inner).take().unwrap_or_else(|| {
                    Err(KernelError::Nvrtc { name: name.to_string(), call: "warm thread", code: "did not run".into() })
                });
                (name, r.map(|c| c.origin))
            })
            .collect()
    }
}

impl KernelCache {
    /// Start compiling (or reading from disk) `modules` for `arch` on up to one thread per core,
    /// longest expected compile first, and return at once (see the module docs). Modules that
    /// `arch` does not run are left out; with `FERROGRAD_WARM=0` nothing starts.
    pub fn warm(&'static self, arch: Arch, modules: &[&'static Module]) -> Warm {
        let mut kernels: Vec<KernelSource<'static>> = Vec::with_capacity(modules.len());
        for m in modules {
            let k = m.source();
            if enabled() && k.needed_for(arch) && !kernels.iter().any(|x| x.name == k.name) {
                kernels.push(k);
            }
        }
        // Sorted longest first here, so that `modules()` lists them in the order they start.
        let order = longest_first(&kernels);
        let kernels: Arc<Vec<KernelSource<'static>>> = Arc::new(order.iter().map(|&i| kernels[i]).collect());
        let order: Arc<Vec<usize>> = Arc::new((0..kernels.len()).collect());
        let names: Vec<&'static str> = kernels.iter().map(|k| k.name).collect();
        let results: Arc<Vec<BatchSlot>> = Arc::new(kernels.iter().map(|_| Mutex::new(None)).collect());
        let next = Arc::new(AtomicUsize::new(0));
        let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
        let mut threads = Vec::new();
        for i in 0..cores.min(kernels.len()) {
            let (kernels, order, results, next) =
                (Arc::clone(&kernels), Arc::clone(&order), Arc::clone(&results), Arc::clone(&next));
            let spawned = std::thread::Builder::new()
                .name(format!("ferrograd-warm-{i}"))
                .spawn(move || self.drain(&kernels, &order, &next, &results, arch));
            // No thread (a process at its limit): the launches compile what is left, as before.
            match spawned {
                Ok(t) => threads.push(t),
                Err(_) => break,
            }
        }
        Warm { names, results, threads }
    }
}

/// [`KernelCache::warm`] on the [`global`] cache.
pub fn warm(arch: Arch, modules: &[&'static Module]) -> Warm {
    global().warm(arch, modules)
}
