//! The kernel modules, embedded in the binary, and the one list of them ([`ALL`]) that
//! `ferrograd kernels --precompile` and the NVRTC compile test walk.
//!
//! A module is a `const` [`Module`] (name, source, shared headers, defines) declared next to the
//! code that launches it: the core op families here (their sources in `kernels/`), each fused op in
//! its folder under `src/fused/`. Shared headers live in `kernels/include/` and are listed in
//! [`headers`]; `docs/kernel-abi.md` is the contract between the sources and the launch sites.

pub use super::nvrtc::{Define, Header, Module};

/// The shared headers a module may `#include "name"`.
pub mod headers {
    use super::Header;

    macro_rules! header {
        ($id:ident, $name:literal) => {
            pub const $id: Header = Header { name: $name, src: include_str!(concat!("../../kernels/include/", $name)) };
        };
    }

    // Types, layouts, conversions, block reductions: every module includes it.
    header!(COMMON, "common.cuh");
}

use headers::COMMON;

macro_rules! core_module {
    ($id:ident, $name:literal) => {
        pub const $id: Module =
            Module::new($name, include_str!(concat!("../../kernels/", $name, ".cu"))).with_headers(&[COMMON]);
    };
}

core_module!(COPY, "copy");
core_module!(CAST, "cast");
core_module!(UNARY, "unary");
core_module!(BINARY, "binary");
core_module!(REDUCE, "reduce");
core_module!(SOFTMAX, "softmax");
core_module!(LAYERNORM, "layernorm");
core_module!(INDEX, "index");
core_module!(RNG, "rng");
core_module!(OPTIM, "optim");
core_module!(CROSS_ENTROPY, "cross_entropy");

/// Every module of the library: one line per module, fused ops' included.
pub const ALL: &[&Module] =
    &[&COPY, &CAST, &UNARY, &BINARY, &REDUCE, &SOFTMAX, &LAYERNORM, &INDEX, &RNG, &OPTIM, &CROSS_ENTROPY];

/// Compile every module for `arch` into the on-disk cache, in parallel (`ferrograd kernels
/// --precompile`).
pub fn precompile(arch: super::nvrtc::Arch) -> crate::Result<super::nvrtc::PrecompileReport> {
    let sources: Vec<_> = ALL.iter().map(|m| m.source()).collect();
    Ok(super::nvrtc::precompile(arch, &sources)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::nvrtc::{compile_cubin, find_cuda_include, nvrtc_info, Arch};

    /// Every kernel file compiles under NVRTC for Ampere and Hopper. Runs wherever libnvrtc is
    /// found (CI installs it from PyPI); FERROGRAD_REQUIRE_NVRTC=1 turns a skip into a failure.
    #[test]
    fn every_kernel_compiles_for_sm80_and_sm90() {
        if let Err(e) = nvrtc_info() {
            assert!(std::env::var_os("FERROGRAD_REQUIRE_NVRTC").is_none_or(|v| v != "1"), "NVRTC required: {e}");
            println!("skipping: {e}");
            return;
        }
        let include = find_cuda_include().unwrap_or_else(|e| panic!("{e}"));
        for m in ALL {
            for arch in [Arch::SM80, Arch::SM90] {
                let cubin =
                    compile_cubin(&m.source(), arch, &include).unwrap_or_else(|e| panic!("{} for {arch}: {e}", m.name));
                assert!(cubin.len() > 1000, "{} for {arch}: {} bytes", m.name, cubin.len());
                println!("{} {arch}: {} bytes", m.name, cubin.len());
            }
        }
    }

    /// Module names are unique (the device caches loaded modules by name), and every
    /// `#include "..."` of a module or of its headers is among the headers it declares.
    #[test]
    fn modules_have_unique_names_and_declare_their_includes() {
        let mut names: Vec<&str> = ALL.iter().map(|m| m.name).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), ALL.len(), "two modules share a name");
        for m in ALL {
            let texts = std::iter::once(m.src).chain(m.headers.iter().map(|h| h.src));
            for text in texts {
                for line in text.lines().filter_map(|l| l.trim().strip_prefix("#include \"")) {
                    let inc = line.split('"').next().unwrap_or("");
                    assert!(
                        m.headers.iter().any(|h| h.name == inc),
                        "{} includes {inc} but does not declare it",
                        m.name
                    );
                }
            }
        }
    }
}
