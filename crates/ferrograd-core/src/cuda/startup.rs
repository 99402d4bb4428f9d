//! One-time costs of the CUDA backend, counted where they are paid: a context, library handles,
//! kernel modules, cuBLASLt and cuDNN plans, and the driver allocations that grow the caching
//! allocator. They happen lazily, inside whatever first needs them (most inside a training run's
//! first step), so a wall-clock breakdown of a run's start (`gpt train` under
//! `FERROGRAD_PROFILE=1`) reports these totals beside its phases to say what the phases spent.
//!
//! Always on: each is one `Instant` pair on a path that runs once per module, handle or problem
//! (and per `cuMemAlloc`, which itself waits for the device), never per kernel launch.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// What a one-time cost was spent on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cost {
    /// `CudaDevice::open`: the CUDA context, the stream table, the error flag.
    Context,
    /// The cuBLAS handle (`cublasCreate`, loading libcublas).
    Cublas,
    /// Kernel modules: reading the CUBIN from the disk cache (or compiling) and `cuModuleLoadData`.
    KernelModules,
    /// The NVRTC compiles among them (a cold kernel cache; `ferrograd kernels --precompile` fills it).
    Nvrtc,
    /// cuBLASLt: its handle and, per new problem, the descriptors and the heuristic.
    CublasLt,
    /// cuDNN: loading the library and creating its handle.
    CudnnLoad,
    /// cuDNN: per new attention problem, a plan built (heuristics, finalize: its runtime-compiled
    /// engine compiles a kernel) or restored from the plan cache.
    CudnnPlans,
    /// `cuMemAlloc` calls of the caching allocator (each waits for the device).
    DeviceMalloc,
}

const ALL: [Cost; 8] = [
    Cost::Context,
    Cost::Cublas,
    Cost::KernelModules,
    Cost::Nvrtc,
    Cost::CublasLt,
    Cost::CudnnLoad,
    Cost::CudnnPlans,
    Cost::DeviceMalloc,
];

impl Cost {
    /// How the breakdown names it.
    pub fn name(self) -> &'static str {
        match self {
            Cost::Context => "CUDA context + streams",
            Cost::Cublas => "cuBLAS handle",
            Cost::KernelModules => "kernel modules (cache read + load)",
            Cost::Nvrtc => "  of which NVRTC compiles",
            Cost::CublasLt => "cuBLASLt handle + plans",
            Cost::CudnnLoad => "cuDNN load + handle",
            Cost::CudnnPlans => "cuDNN plans",
            Cost::DeviceMalloc => "cuMemAlloc (allocator growth)",
        }
    }
}

static NANOS: [AtomicU64; 8] = [const { AtomicU64::new(0) }; 8];
static CALLS: [AtomicU64; 8] = [const { AtomicU64::new(0) }; 8];

/// Count `d` (one call) against `cost`.
pub(crate) fn add(cost: Cost, d: Duration) {
    let i = ALL.iter().position(|c| *c == cost).unwrap_or(0);
    NANOS[i].fetch_add(d.as_nanos().min(u64::MAX as u128) as u64, Ordering::Relaxed);
    CALLS[i].fetch_add(1, Ordering::Relaxed);
}

/// Run `f`, counting its wall time against `cost`.
pub(crate) fn timed<T>(cost: Cost, f: impl FnOnce() -> T) -> T {
    let t = Instant::now();
    let out = f();
    add(cost, t.elapsed());
    out
}

/// Every cost so far in this process: `(what, calls, total time)`, those never paid left out.
pub fn costs() -> Vec<(Cost, u64, Duration)> {
    ALL.iter()
        .enumerate()
        .map(|(i, c)| (*c, CALLS[i].load(Ordering::Relaxed), Duration::from_nanos(NANOS[i].load(Ordering::Relaxed))))
        .filter(|(_, n, _)| *n > 0)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn costs_add_up_by_kind() {
        let before = costs().into_iter().find(|c| c.0 == Cost::CudnnPlans).map_or((0, Duration::ZERO), |c| (c.1, c.2));
        add(Cost::CudnnPlans, Duration::from_millis(3));
        assert_eq!(timed(Cost::CudnnPlans, || 7), 7);
        let after = costs().into_iter().find(|c| c.0 == Cost::CudnnPlans).map(|c| (c.1, c.2));
        let (n, d) = after.expect("counted");
        assert_eq!(n, before.0 + 2);
        assert!(d >= before.1 + Duration::from_millis(3));
    }
}
