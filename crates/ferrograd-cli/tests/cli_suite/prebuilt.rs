//! The shipped CUBINs are today's: every module a GPU of a shipped architecture runs has its
//! CUBIN shipped under its current key, none is shipped for nothing, each inflates to its
//! checksum as a CUDA ELF for its architecture and, where NVRTC is present (CI installs it), is
//! byte for byte what NVRTC builds from today's sources.
//!
//! When this fails after a kernel change: `scripts/prebuild-kernels.sh`, then commit
//! `crates/ferrograd-kernels/prebuilt/`.
//!
//! Here and not in ferrograd-kernels' own tests: this binary links the shipped CUBINs anyway (the
//! CLI does), while a test binary of their own would carry them and all of the models' code a
//! second time into the GPU bundle (~8 MB packed).

use crate::common::{bin, text};
use ferrograd_core::cuda::modules;
use ferrograd_core::cuda::nvrtc::{self, Arch, KernelCache, Module, PrebuiltKernels};
use std::process::Command;

fn all_modules() -> Vec<&'static Module> {
    let models = ferrograd_models::modules().expect("the models' modules");
    modules::ALL.iter().copied().chain(models).collect()
}

const REBUILD: &str = "run scripts/prebuild-kernels.sh and commit crates/ferrograd-kernels/prebuilt/";

#[test]
fn every_module_is_shipped_under_its_current_key() {
    let set = ferrograd_kernels::prebuilt().expect("the manifests parse");
    let all = all_modules();
    for arch in ferrograd_kernels::archs() {
        let f = ferrograd_kernels::freshness(set, arch, &all);
        assert!(f.stale.is_empty(), "{arch}: changed since the prebuilt kernels were built: {:?}; {REBUILD}", f.stale);
        assert!(f.orphans.is_empty(), "{arch}: shipped for no current module: {:?}; {REBUILD}", f.orphans);
        // Every module the architecture runs, the Hopper-only ones on sm_90 alone.
        let wanted = all.iter().filter(|m| m.source().needed_for(arch)).count();
        assert_eq!(f.current.len(), wanted, "{arch}");
        assert!(wanted >= 40, "{arch}: {wanted} modules");
    }
}

#[test]
fn every_shipped_cubin_inflates_to_its_checksum_for_its_arch() {
    let set = ferrograd_kernels::prebuilt().expect("the manifests parse");
    let mut n = 0;
    for arch in ferrograd_kernels::archs() {
        for e in set.modules(arch) {
            let cubin = e.cubin().unwrap_or_else(|err| panic!("{arch} {}: {err}", e.name));
            assert_eq!(cubin.len(), e.len);
            assert_eq!(nvrtc::cubin_sm(&cubin), Some(arch.number()), "{arch} {}: not a CUDA ELF of it", e.name);
            assert_eq!(e.target.number(), arch.number());
            // Through the interface the kernel cache uses.
            let got = set.get(&e.key).expect("lookup").expect("shipped");
            assert_eq!(got.cubin, cubin);
            n += 1;
        }
    }
    assert!(n >= 80, "{n} CUBINs");
    assert!(set.describe().contains("sm_80") && set.describe().contains("sm_90"), "{}", set.describe());
}

#[test]
fn shipped_cubins_are_what_nvrtc_builds_now() {
    match nvrtc::nvrtc_info() {
        Ok(i) if i.version == ferrograd_kernels::prebuilt().expect("parse").nvrtc() => {}
        Ok(i) => {
            println!("skipping: NVRTC {} here, the shipped kernels were built by another version", i.version);
            return;
        }
        Err(e) => {
            assert!(std::env::var_os("FERROGRAD_REQUIRE_NVRTC").is_none_or(|v| v != "1"), "NVRTC required: {e}");
            println!("skipping: {e}");
            return;
        }
    }
    let set = ferrograd_kernels::prebuilt().expect("the manifests parse");
    // NVRTC (or the user's disk cache of its output), never the shipped bytes themselves.
    let cache = KernelCache::from_env().with_prebuilt(None);
    for arch in ferrograd_kernels::archs() {
        let sources: Vec<_> =
            all_modules().iter().map(|m| m.source()).filter(|s| s.needed_for(arch)).collect::<Vec<_>>();
        let report = cache.precompile(arch, &sources).expect("precompile");
        for e in report.kernels {
            let built = e.result.unwrap_or_else(|err| panic!("{arch} {}: {err}", e.name));
            assert_ne!(built.origin, nvrtc::Origin::Prebuilt);
            let shipped =
                set.get(&built.key).expect("lookup").unwrap_or_else(|| panic!("{arch} {}: {REBUILD}", e.name));
            assert!(shipped.cubin == built.cubin, "{arch} {}: shipped CUBIN differs from NVRTC's", e.name);
        }
    }
}

#[test]
fn archs_are_the_shipped_ones() {
    assert_eq!(ferrograd_kernels::archs().collect::<Vec<_>>(), [Arch::SM80, Arch::SM90]);
}

#[test]
fn kernels_precompile_finds_every_module_prebuilt_without_nvrtc() {
    let dir = std::env::temp_dir().join(format!("kcache-pre-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // No NVRTC on the loader path (CI's comes from LD_LIBRARY_PATH alone): the shipped CUBINs
    // serve every module, and nothing is written to the disk cache.
    let o = Command::new(bin())
        .args(["kernels", "--precompile", "--arch", "sm_90"])
        .env("FERROGRAD_CACHE_DIR", &dir)
        .env("LD_LIBRARY_PATH", "")
        .output()
        .unwrap();
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    assert!(out.contains("shipped CUBINs built by NVRTC 13.0"), "{out}");
    let summary = out.lines().find(|l| l.contains(" prebuilt, 0 hit, 0 compiled, 0 failed")).unwrap_or_default();
    let n: usize = summary.split(' ').next().and_then(|n| n.parse().ok()).unwrap_or(0);
    assert!(n >= 50, "{out}");
    assert_eq!(out.lines().filter(|l| l.contains("  prebuilt  ")).count(), n, "{out}");
    // --write-prebuilt refuses flags that would make CUBINs no normal run asks for.
    let o = Command::new(bin())
        .args(["kernels", "--write-prebuilt", dir.to_str().unwrap(), "--arch", "sm_80"])
        .env("FERROGRAD_NVRTC_OPTIONS", "-lineinfo")
        .output()
        .unwrap();
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{out}\n{err}");
    assert!(err.starts_with("error: --write-prebuilt with FERROGRAD_NVRTC_OPTIONS set"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
