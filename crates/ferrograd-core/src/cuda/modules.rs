//! The kernel sources, embedded in the binary. Each module is `common.cuh` followed by one file;
//! `docs/kernel-abi.md` is the contract between these and the Rust launch sites.

pub struct Module {
    pub name: &'static str,
    pub src: &'static str,
}

macro_rules! module {
    ($id:ident, $name:literal) => {
        pub const $id: Module = Module {
            name: $name,
            src: concat!(
                include_str!("../../kernels/common.cuh"),
                "\n",
                include_str!(concat!("../../kernels/", $name, ".cu"))
            ),
        };
    };
}

module!(COPY, "copy");
module!(UNARY, "unary");
module!(BINARY, "binary");
module!(REDUCE, "reduce");
module!(SOFTMAX, "softmax");
module!(LAYERNORM, "layernorm");
module!(INDEX, "index");
module!(RNG, "rng");
module!(OPTIM, "optim");
module!(CROSS_ENTROPY, "cross_entropy");

/// Every module, for `ferrograd kernels --precompile` and the NVRTC compile test.
pub const ALL: &[&Module] = &[
    &COPY,
    &UNARY,
    &BINARY,
    &REDUCE,
    &SOFTMAX,
    &LAYERNORM,
    &INDEX,
    &RNG,
    &OPTIM,
    &CROSS_ENTROPY,
    // src/fused/attention: one module per head dim.
    crate::fused::attention::MODULES[0],
    crate::fused::attention::MODULES[1],
    crate::fused::attention::MODULES[2],
    crate::fused::attention::MODULES[3],
    crate::fused::attention::MODULES[4],
    // src/fused/selective_scan.
    &crate::fused::selective_scan::MODULE,
];

/// Compile every module for `arch` into the on-disk cache (`ferrograd kernels --precompile`).
pub fn precompile(arch: super::kernels::Arch) -> crate::Result<super::kernels::PrecompileReport> {
    let sources: Vec<super::kernels::KernelSource> =
        ALL.iter().map(|m| super::kernels::KernelSource::new(m.name, m.src)).collect();
    Ok(super::kernels::precompile_kernels(arch, &sources)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::kernels::{compile_cubin, find_cuda_include, nvrtc_info, Arch, KernelSource};

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
                let cubin = compile_cubin(&KernelSource::new(m.name, m.src), arch, &include)
                    .unwrap_or_else(|e| panic!("{} for {arch}: {e}", m.name));
                assert!(cubin.len() > 1000, "{} for {arch}: {} bytes", m.name, cubin.len());
                println!("{} {arch}: {} bytes", m.name, cubin.len());
            }
        }
    }
}
