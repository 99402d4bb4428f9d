//! Prebuilt CUBINs: kernel modules compiled ahead of time and shipped inside a program, so that
//! its first GPU run loads them instead of waiting for NVRTC.
//!
//! Why: NVRTC spends 80-100 s of CPU on the library's ~55 modules (half in NVVM's optimizer,
//! half in PTX -> SASS), 6-9 s of wall time even on a 16-core GPU machine, and every new machine,
//! container or CI runner pays it again. PyTorch ships fat binaries for the same reason. Unlike a
//! fat binary, a prebuilt module here is only ever used when it is exactly what NVRTC would
//! compile now: it is found by the same [`CacheKey`] (module name, source, headers, options,
//! architecture), computed with the NVRTC version that built it. An edited kernel
//! (`FERROGRAD_KERNEL_DIR`), extra NVRTC flags, another architecture or a module generated for
//! another GPU shape has another key and is compiled as before.
//!
//! The core only defines the interface: the CUBINs live in the `ferrograd-kernels` crate, which
//! programs that want them link and install at start ([`install_prebuilt`]); the library's own
//! test binaries do not, so they keep exercising NVRTC and stay small.
//! `FERROGRAD_PREBUILT=0` turns the layer off (to time or test NVRTC itself).

use super::compiler::NvrtcVersion;
use super::key::CacheKey;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// `FERROGRAD_PREBUILT=0`: ignore installed prebuilt kernels and compile with NVRTC.
pub const PREBUILT_ENV: &str = "FERROGRAD_PREBUILT";

/// One prebuilt CUBIN.
#[derive(Debug, Clone)]
pub struct PrebuiltCubin {
    /// The CUBIN bytes, as NVRTC produced them.
    pub cubin: Arc<[u8]>,
    /// What NVRTC took to build it where it was built (what a start saves).
    pub compile_time: Duration,
}

/// A set of prebuilt CUBINs, looked up by cache key.
pub trait PrebuiltKernels: Send + Sync {
    /// The NVRTC that built them: keys are computed with its version, whatever NVRTC (if any)
    /// this process could load.
    fn nvrtc(&self) -> NvrtcVersion;
    /// The CUBIN whose key is `key`, if shipped. An error is a damaged set (a CUBIN that does
    /// not inflate or fails its checksum): the caller compiles instead and says why.
    fn get(&self, key: &CacheKey) -> Result<Option<PrebuiltCubin>, String>;
    /// One line for logs: what is shipped (architectures, module count, NVRTC version).
    fn describe(&self) -> String;
}

static INSTALLED: OnceLock<&'static dyn PrebuiltKernels> = OnceLock::new();

/// Makes `kernels` the prebuilt set every [`super::KernelCache`] consults (one per process; the
/// first call wins and later ones return `false`). Call it before the first kernel loads.
pub fn install_prebuilt(kernels: &'static dyn PrebuiltKernels) -> bool {
    INSTALLED.set(kernels).is_ok()
}

/// The installed set, unless `FERROGRAD_PREBUILT=0`.
pub fn installed_prebuilt() -> Option<&'static dyn PrebuiltKernels> {
    if disabled_by_env() {
        return None;
    }
    INSTALLED.get().copied()
}

fn disabled_by_env() -> bool {
    static OFF: OnceLock<bool> = OnceLock::new();
    *OFF.get_or_init(|| std::env::var(PREBUILT_ENV).is_ok_and(|v| v.trim() == "0"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::nvrtc::{Arch, KernelCache, KernelSource, Origin};

    const V13: NvrtcVersion = NvrtcVersion { major: 13, minor: 0 };
    const KERNEL: KernelSource<'static> = KernelSource::new("k", "extern \"C\" __global__ void k() {}");

    /// A set holding one CUBIN under one key, or failing every lookup.
    struct One {
        key: CacheKey,
        damaged: bool,
    }

    impl PrebuiltKernels for One {
        fn nvrtc(&self) -> NvrtcVersion {
            V13
        }
        fn get(&self, key: &CacheKey) -> Result<Option<PrebuiltCubin>, String> {
            if self.damaged {
                return Err("checksum mismatch".into());
            }
            Ok((*key == self.key)
                .then(|| PrebuiltCubin { cubin: Arc::from(&b"cubin"[..]), compile_time: Duration::from_millis(7) }))
        }
        fn describe(&self) -> String {
            "one".into()
        }
    }

    fn leak(set: One) -> &'static dyn PrebuiltKernels {
        Box::leak(Box::new(set))
    }

    #[test]
    fn a_prebuilt_cubin_is_served_by_its_key_without_nvrtc() {
        let set = leak(One { key: KERNEL.cache_key(Arch::SM90, V13), damaged: false });
        let cache = KernelCache::new(None).with_prebuilt(Some(set));
        // Served even where no libnvrtc can be loaded (CI's compile tests have one; this
        // path must not ask for it).
        let got = cache.get_or_compile(&KERNEL, Arch::SM90).expect("prebuilt");
        assert_eq!((got.origin, got.from_cache, &*got.cubin), (Origin::Prebuilt, true, &b"cubin"[..]));
        assert_eq!(got.compile_time, Duration::from_millis(7));
        assert_eq!(got.key, KERNEL.cache_key(Arch::SM90, V13));
    }

    #[test]
    fn any_other_input_misses_the_prebuilt_set() {
        let set = leak(One { key: KERNEL.cache_key(Arch::SM90, V13), damaged: false });
        let other_src = KernelSource::new("k", "extern \"C\" __global__ void k() { }");
        let fast = KERNEL.with_options(crate::cuda::nvrtc::CompileOptions::FAST_MATH);
        for (k, arch) in [(other_src, Arch::SM90), (fast, Arch::SM90), (KERNEL, Arch::SM80)] {
            assert!(set.get(&k.cache_key(arch, V13)).expect("lookup").is_none());
        }
        assert!(set
            .get(&KERNEL.cache_key(Arch::SM90, NvrtcVersion { major: 13, minor: 1 }))
            .expect("lookup")
            .is_none());
    }

    #[test]
    fn a_cache_without_the_layer_or_a_damaged_set_goes_to_nvrtc() {
        let set = leak(One { key: KERNEL.cache_key(Arch::SM90, V13), damaged: false });
        let damaged = leak(One { key: KERNEL.cache_key(Arch::SM90, V13), damaged: true });
        for cache in [KernelCache::new(None).with_prebuilt(None), KernelCache::new(None).with_prebuilt(Some(damaged))] {
            match cache.get_or_compile(&KERNEL, Arch::SM90) {
                // NVRTC compiled it: a real CUBIN, not the set's bytes.
                Ok(k) => assert_eq!(k.origin, Origin::Compiled),
                Err(e) => assert!(matches!(e, crate::cuda::nvrtc::KernelError::NvrtcMissing { .. }), "{e}"),
            }
        }
        let skip = KernelCache::new(None).with_prebuilt(Some(set));
        match skip.get_or_compile_from_source(&KERNEL, Arch::SM90) {
            Ok(k) => assert_eq!(k.origin, Origin::Compiled),
            Err(e) => assert!(matches!(e, crate::cuda::nvrtc::KernelError::NvrtcMissing { .. }), "{e}"),
        }
    }
}
