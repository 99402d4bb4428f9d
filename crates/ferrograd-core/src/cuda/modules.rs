//! The kernel modules, embedded in the binary, and the one list of them ([`ALL`]) that
//! `ferrograd kernels --precompile` and the NVRTC compile test walk.
//!
//! A module is a `const` [`Module`] (name, source, shared headers, defines) declared next to the
//! code that launches it: the core op families here (their sources in `kernels/`), each fused op in
//! its folder under `src/fused/`. Shared headers live in `kernels/include/` and are listed in
//! [`headers`]; `docs/kernel-abi.md` is the contract between the sources and the launch sites.

pub use super::nvrtc::{CompileOptions, Define, Header, Module};

/// The shared headers a module may `#include "name"` (each brings the defines its text needs).
pub mod headers {
    use super::{Define, Header};
    use crate::cuda::launch::{ROW_CAP_DOUBLE, ROW_CAP_FLOAT};

    macro_rules! header {
        ($id:ident, $name:literal $(, $defines:expr)?) => {
            /// One of the shared headers of `kernels/include/`.
            pub const $id: Header =
                Header::new($name, include_str!(concat!("../../kernels/include/", $name))) $(.with_defines($defines))?;
        };
    }

    // Types, the kernel `Layout`, conversions, block reductions: every module includes it.
    header!(COMMON, "common.cuh", &[Define::int("FG_MAX_DIMS", crate::cuda::klayout::MAX_DIMS as i64)]);
    // exp, log, tanh, ... in the accumulation type, op.rs's constants, tanh-GELU and its derivative.
    header!(ACC_MATH, "acc_math.cuh");
    // The running (max, sum of exp) pair of softmax and cross entropy.
    header!(ONLINE_SOFTMAX, "online_softmax.cuh");
    // Cross entropy's row pass (online pair by vectors, log-sum-exp, target decoding, loss), shared
    // by cross_entropy.cu and classifier.cu; the encoded ignored target is the index kernels' "no id".
    header!(CE_ROW, "ce_row.cuh", &[Define::uint("FG_CE_IGNORED", crate::cuda::ops::index::NO_ID)]);
    // Rows in registers: which rows a thread holds, reductions over a row's group of threads.
    header!(
        ROW_REDUCE,
        "row_reduce.cuh",
        &[
            Define::int("FG_ROW_CAP_FLOAT", ROW_CAP_FLOAT as i64),
            Define::int("FG_ROW_CAP_DOUBLE", ROW_CAP_DOUBLE as i64),
        ]
    );
    // 16-byte row loads and stores, plain and cache-streaming.
    header!(VEC_LOAD, "vec_load.cuh");
    // How a kernel reports a bad index through the device's error flag.
    header!(ERROR_FLAG, "error_flag.cuh");
    // The second stage of a deterministic column sum (bias gradients).
    header!(COL_SUMS, "col_sums.cuh");

    /// Every shared header, for the tests that read them all.
    pub const ALL: &[Header] = &[COMMON, ACC_MATH, ONLINE_SOFTMAX, CE_ROW, ROW_REDUCE, VEC_LOAD, ERROR_FLAG, COL_SUMS];
}

use headers::{ACC_MATH, COMMON, ERROR_FLAG};

// `; ms N`: the module's measured NVRTC time (`Module::cost_ms`), which orders a cold precompile.
macro_rules! core_module {
    ($id:ident, $name:literal, $headers:expr $(, $defines:expr)? $(; ms $ms:literal)?) => {
        /// One of core's kernel modules (`kernels/NAME.cu`).
        pub const $id: Module = Module::new($name, include_str!(concat!("../../kernels/", $name, ".cu")))
            .with_headers($headers) $(.with_defines($defines))? $(.with_cost_ms($ms))?;
    };
}

core_module!(COPY, "copy", &[COMMON]; ms 300);
core_module!(CAST, "cast", &[COMMON]; ms 1500);
core_module!(UNARY, "unary", &[COMMON, ACC_MATH]; ms 1300);
// binary.cu in three parts that compile in parallel (`FG_BINARY_PART`; ops/binary.rs `module`
// picks one): `binary_{f32,f64}`; `binary_{f16,bf16}`; the integer binaries, `cmp_*`, `where_*`.
macro_rules! binary_part {
    ($id:ident, $name:literal, $part:literal, $ms:literal) => {
        /// One part of `kernels/binary.cu` (see above).
        pub const $id: Module = Module::new($name, include_str!("../../kernels/binary.cu"))
            .with_headers(&[COMMON])
            .with_defines(&[Define::int("FG_BINARY_PART", $part)])
            .with_cost_ms($ms);
    };
}
binary_part!(BINARY, "binary", 0, 1000);
binary_part!(BINARY_HALF, "binary_half", 1, 1300);
binary_part!(BINARY_REST, "binary_rest", 2, 1400);
core_module!(REDUCE, "reduce", &[COMMON]; ms 1100);
core_module!(INDEX, "index", &[COMMON, ERROR_FLAG], &[Define::uint("FG_ID_NONE", super::ops::index::NO_ID)]; ms 600);
core_module!(RNG, "rng", &[COMMON]; ms 500);
core_module!(OPTIM, "optim", &[COMMON], &[Define::int("FG_OPT_MAX", super::ops::optim::MAX as i64)]; ms 150);

/// Every module of the library, fused ops' included: one line per module. What
/// `ferrograd kernels --precompile` and the NVRTC compile test walk.
pub const ALL: &[&Module] = &[
    &COPY,
    &CAST,
    &UNARY,
    &BINARY,
    &BINARY_HALF,
    &BINARY_REST,
    &REDUCE,
    &INDEX,
    &RNG,
    &OPTIM,
    &crate::fused::softmax::MODULE,
    &crate::fused::layer_norm::MODULE,
    &crate::fused::layer_norm::MODULE_BWD,
    &crate::fused::add_layer_norm::MODULE,
    &crate::fused::bias_gelu::MODULE,
    &crate::fused::fake_quantize::MODULE,
    &crate::quant::MODULE,
    &crate::fused::classifier::MODULE,
    &crate::fused::cross_entropy::MODULE,
    // src/fused/linear: one part per dtype.
    crate::fused::linear::MODULES[0],
    crate::fused::linear::MODULES[1],
    crate::fused::linear::MODULES[2],
    crate::fused::linear::MODULES[3],
    &crate::fused::mse_loss::MODULE,
    // src/fused/attention: one module per head dim and dtype.
    crate::fused::attention::MODULES[0],
    crate::fused::attention::MODULES[1],
    crate::fused::attention::MODULES[2],
    crate::fused::attention::MODULES[3],
    crate::fused::attention::MODULES[4],
    crate::fused::attention::MODULES[5],
    crate::fused::attention::MODULES[6],
    crate::fused::attention::MODULES[7],
    crate::fused::attention::MODULES[8],
    crate::fused::attention::MODULES[9],
    crate::fused::attention::MODULES[10],
    crate::fused::attention::MODULES[11],
    crate::fused::attention::MODULES[12],
    crate::fused::attention::MODULES[13],
    crate::fused::attention::MODULES[14],
    // The Hopper (wgmma) parts: d 64 / 128, bf16 / f16, without and with dropout, built for sm_90a.
    crate::fused::attention::WG_MODULES[0],
    crate::fused::attention::WG_MODULES[1],
    crate::fused::attention::WG_MODULES[2],
    crate::fused::attention::WG_MODULES[3],
    crate::fused::attention::WG_MODULES[4],
    crate::fused::attention::WG_MODULES[5],
    crate::fused::attention::WG_MODULES[6],
    crate::fused::attention::WG_MODULES[7],
    // src/fused/selective_scan: forward per dtype, backward per dtype and chunk length.
    crate::fused::selective_scan::MODULES[0],
    crate::fused::selective_scan::MODULES[1],
    crate::fused::selective_scan::MODULES[2],
    crate::fused::selective_scan::MODULES[3],
    crate::fused::selective_scan::MODULES[4],
    crate::fused::selective_scan::MODULES[5],
    // src/fused/conv1d_causal.
    &crate::fused::conv1d_causal::MODULE,
];

/// Compile every module for `arch`, and `extra` (other crates' modules, such as
/// `ferrograd_models::MODULES`), into the on-disk cache, all in parallel (`ferrograd kernels
/// --precompile`).
pub fn precompile(arch: super::nvrtc::Arch, extra: &[&Module]) -> crate::Result<super::nvrtc::PrecompileReport> {
    let sources: Vec<_> = for_arch(arch, extra).into_iter().map(|m| m.source()).collect();
    Ok(super::nvrtc::precompile(arch, &sources)?)
}

/// The modules a GPU of `arch` runs, of [`ALL`] and `extra`: not the Hopper-only ones elsewhere,
/// nor those another module replaces on `arch` ([`crate::fused::attention::superseded_on`]).
pub fn for_arch<'a>(arch: super::nvrtc::Arch, extra: &[&'a Module]) -> Vec<&'a Module> {
    ALL.iter()
        .chain(extra)
        .copied()
        .filter(|m| m.source().needed_for(arch) && !crate::fused::attention::superseded_on(m, arch))
        .collect()
}

/// Test support for a module split into parts: every `(kernel, part)` a launch site would pick is
/// in that part's CUBIN (compiled for sm_90 through the global cache), and every part is picked
/// by some launch. `None` (and a printed line) where NVRTC is missing and not required.
#[cfg(test)]
pub(crate) fn check_routes(parts: &[&Module], routes: &[(String, &'static Module)]) -> Option<()> {
    use crate::cuda::nvrtc::{get_or_compile, kernel_names, nvrtc_info, Arch};
    if let Err(e) = nvrtc_info() {
        assert!(std::env::var_os("FERROGRAD_REQUIRE_NVRTC").is_none_or(|v| v != "1"), "NVRTC required: {e}");
        println!("skipping: {e}");
        return None;
    }
    for part in parts {
        let cubin = get_or_compile(&part.source(), Arch::SM90).unwrap_or_else(|e| panic!("{}: {e}", part.name));
        let names = kernel_names(&cubin.cubin);
        let mine: Vec<&String> = routes.iter().filter(|(_, m)| m.name == part.name).map(|(k, _)| k).collect();
        assert!(!mine.is_empty(), "no launch picks module {}", part.name);
        for k in mine {
            assert!(names.contains(k), "{k} is launched from module {}, which holds {names:?}", part.name);
        }
    }
    Some(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Which modules a GPU runs: sm_80 gets no Hopper-only module; sm_90 gets the Hopper attention
    /// kernels (both builds) and not the four mma.sync modules they replace, unless the Hopper
    /// kernels are turned off for the caller.
    #[test]
    fn for_arch_leaves_out_what_the_gpu_does_not_run() {
        use crate::cuda::nvrtc::Arch;
        let names = |arch| for_arch(arch, &[]).iter().map(|m| m.name).collect::<Vec<_>>();
        let (ampere, hopper) = (names(Arch::SM80), names(Arch::SM90));
        let replaced = ["attention_d64_bf16", "attention_d64_f16", "attention_d128_bf16", "attention_d128_f16"];
        for m in replaced {
            assert!(ampere.contains(&m) && !hopper.contains(&m), "{m}");
        }
        for m in ["attention_d64_bf16_wg", "attention_d128_f16_wgdrop"] {
            assert!(!ampere.contains(&m) && hopper.contains(&m), "{m}");
        }
        assert!(hopper.contains(&"attention_d64_f32") && hopper.contains(&"attention_d96_bf16"));
        assert_eq!(hopper.len() + replaced.len(), ALL.len());
        crate::fused::attention::select::set_wgmma(Some(false));
        let off = names(Arch::SM90);
        crate::fused::attention::select::set_wgmma(None);
        assert!(replaced.iter().all(|m| off.contains(m)), "{off:?}");
    }
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
                if !m.source().needed_for(arch) {
                    continue; // Hopper-only (wgmma): built for sm_90a, never loaded elsewhere
                }
                let cubin =
                    compile_cubin(&m.source(), arch, &include).unwrap_or_else(|e| panic!("{} for {arch}: {e}", m.name));
                assert!(cubin.len() > 1000, "{} for {arch}: {} bytes", m.name, cubin.len());
                println!("{} {arch}: {} bytes", m.name, cubin.len());
            }
        }
    }

    /// Every fused op folder (`src/fused/<op>/` with a `.cu` file) has its kernels in [`ALL`]:
    /// a module named after the folder, or `<op>_<part>` (a module split in parts, such as attention's
    /// per head dim and dtype).
    #[test]
    fn every_fused_op_folder_is_registered() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/fused");
        let mut folders = 0;
        for entry in std::fs::read_dir(&root).unwrap_or_else(|e| panic!("{}: {e}", root.display())) {
            let path = entry.expect("entry").path();
            let has_cu = std::fs::read_dir(&path)
                .map(|d| d.filter_map(|e| e.ok()).any(|e| e.path().extension().is_some_and(|x| x == "cu")))
                .unwrap_or(false);
            if !has_cu {
                continue;
            }
            folders += 1;
            let op = path.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_string();
            assert!(
                ALL.iter().any(|m| m.name == op || m.name.starts_with(&format!("{op}_"))),
                "src/fused/{op}/ has kernels but no module in cuda/modules.rs ALL: add `&crate::fused::{op}::MODULE,`"
            );
        }
        assert!(folders >= 8, "found {folders} fused op folders under {}", root.display());
    }

    /// Every part of a module split in several (by dtype, direction, head dim) is in [`ALL`].
    #[test]
    fn every_part_of_a_split_module_is_registered() {
        let parts = crate::fused::attention::MODULES
            .iter()
            .chain(&crate::fused::attention::WG_MODULES)
            .chain(&crate::fused::selective_scan::MODULES)
            .chain(&crate::fused::linear::MODULES);
        for m in parts.chain(&[&BINARY, &BINARY_HALF, &BINARY_REST]) {
            assert!(ALL.contains(m), "{} is not in cuda/modules.rs ALL", m.name);
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
