//! Embedded CUDA C -> NVRTC -> CUBIN, behind an in-process cache and an on-disk cache. One file
//! per concern: `source` (what is compiled: modules, shared headers, defines), `arch`, `key`, `disk`, `prebuilt` (CUBINs shipped in the program),
//! `include` (CUDA header search), `source_dir` (a developer's edited sources), `compiler` (libnvrtc), `cache` (the layers together and
//! parallel precompile), `warm` (a run's own modules compiled in the background at its start), `report`, `error`.
//!
//! Why CUBIN and not PTX: PTX is JIT-compiled by the driver every time a module is loaded (the
//! driver's own cache is per-user, size-capped and keyed on things we do not control), while a
//! CUBIN built for the device's exact `sm_XY` loads as-is. NVRTC costs ~0.2 s per kernel file cold
//! (more with the fp16/bf16 headers), so a dozen files would cost seconds at every start; the disk
//! cache makes the second start pay only a file read.
//!
//! Before any of them, a program may install prebuilt CUBINs ([`install_prebuilt`]; the
//! `ferrograd-kernels` crate ships them, `prebuilt` says why and when they are used).
//!
//! Three layers, so that each can be tested on its own:
//! - [`DiskCache`]: bytes in, bytes out, keyed by a [`CacheKey`]; knows nothing about CUDA, so its
//!   hit / miss / corruption logic is tested on machines without NVRTC.
//! - [`compile_cubin`]: one NVRTC compilation, no caching.
//! - [`KernelCache`]: the two above plus an in-process map, so a kernel is compiled or read at
//!   most once per process. [`global`] is the process-wide instance configured from the
//!   environment; [`precompile`] warms it for `ferrograd kernels --precompile`.
//!
//! Failure policy: nothing here panics. cudarc panics when libnvrtc is missing (or lacks a symbol),
//! so [`nvrtc_info`] checks both before the first NVRTC call and every path goes through it. A
//! cache that cannot be read or written only costs time: we compile without it and say so in
//! [`CompiledKernel::cache_warning`]. A corrupt entry (bad magic, truncated, checksum mismatch) is
//! recompiled and overwritten.
//!
//! The cache key hashes the source, the program name, the NVRTC options (minus the include path,
//! which names a place, not content: the headers are versioned with the toolkit that NVRTC's
//! version already pins), the NVRTC version and the architecture.
//!
//! Where libnvrtc comes from: cudarc opens it by bare name (`libnvrtc.so`, `libnvrtc.so.13`, ...)
//! through the system loader, so it must be in the loader cache or on `LD_LIBRARY_PATH` when the
//! process starts. The PyPI wheel `nvidia-cuda-nvrtc` ships `nvidia/cu13/lib/libnvrtc.so.13`,
//! which matches one of cudarc's names; its headers come from `nvidia-cuda-runtime`
//! (`nvidia/cu13/include`).

mod arch;
mod cache;
mod compiler;
mod disk;
mod error;
mod include;
mod key;
mod prebuilt;
mod report;
mod source;
mod source_dir;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod testutil;
mod warm;

pub use arch::{cubin_sm, Arch};
pub use cache::{get_or_compile, global, precompile, CompiledKernel, KernelCache, Origin};
pub use compiler::{compile_cubin, kernel_names, nvrtc_info, NvrtcInfo, NvrtcVersion};
pub use disk::{CachedCubin, DiskCache, Lookup, CACHE_DIR_ENV, HEADER_LEN};
pub use error::KernelError;
pub use include::{cuda_include_candidates, find_cuda_include, CUDA_INCLUDE_ENV};
pub(crate) use key::hex;
pub use key::CacheKey;
pub use prebuilt::{install_prebuilt, installed_prebuilt, PrebuiltCubin, PrebuiltKernels, PREBUILT_ENV};
pub use report::{PrecompileEntry, PrecompileReport};
pub use source::{env_options, CompileOptions, Define, Header, KernelSource, Module, NVRTC_OPTIONS_ENV};
pub use source_dir::KERNEL_DIR_ENV;
pub use warm::{warm, Warm, WARM_ENV};
