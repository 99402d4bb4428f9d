//! The models' own CUDA modules compile under NVRTC for Ampere and Hopper, wherever libnvrtc is
//! found (FERROGRAD_REQUIRE_NVRTC=1 turns a skip into a failure, as in the core's compile test).
//! FERROGRAD_DUMP_CUBIN=DIR also writes each cubin there, for cuobjdump.

use ferrograd_core::cuda::nvrtc::{compile_cubin, find_cuda_include, kernel_names, nvrtc_info, Arch};
use ferrograd_models::persistent::{trainer, Precision};

#[test]
fn model_kernels_compile_for_sm80_and_sm90() {
    if let Err(e) = nvrtc_info() {
        assert!(std::env::var_os("FERROGRAD_REQUIRE_NVRTC").is_none_or(|v| v != "1"), "NVRTC required: {e}");
        println!("skipping: {e}");
        return;
    }
    let include = find_cuda_include().unwrap_or_else(|e| panic!("{e}"));
    let precompiled = ferrograd_models::modules().unwrap_or_else(|e| panic!("{e}"));
    for m in ferrograd_models::MODULES.iter().chain(&precompiled) {
        for arch in [Arch::SM80, Arch::SM90] {
            let t = std::time::Instant::now();
            let cubin =
                compile_cubin(&m.source(), arch, &include).unwrap_or_else(|e| panic!("{} for {arch}: {e}", m.name));
            assert!(cubin.len() > 1000, "{} for {arch}: {} bytes", m.name, cubin.len());
            println!("{} {arch}: {} bytes in {:.1} s", m.name, cubin.len(), t.elapsed().as_secs_f64());
            if let Some(dir) = std::env::var_os("FERROGRAD_DUMP_CUBIN") {
                let path = std::path::Path::new(&dir).join(format!("{}_{arch}.cubin", m.name));
                std::fs::write(&path, &cubin).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            }
        }
    }
}

/// Each precision's launch finds its kernel in the module `trainer::module` picks.
#[test]
fn each_precision_finds_its_kernel_in_its_module() {
    if let Err(e) = nvrtc_info() {
        assert!(std::env::var_os("FERROGRAD_REQUIRE_NVRTC").is_none_or(|v| v != "1"), "NVRTC required: {e}");
        println!("skipping: {e}");
        return;
    }
    for p in [Precision::F32, Precision::Tf32, Precision::Bf16] {
        let m = trainer::module(p);
        assert!(ferrograd_models::MODULES.contains(&m), "{} is not in MODULES", m.name);
        let cubin = ferrograd_core::cuda::nvrtc::get_or_compile(&m.source(), Arch::SM90)
            .unwrap_or_else(|e| panic!("{}: {e}", m.name));
        assert_eq!(kernel_names(&cubin.cubin), [p.kernel()], "{}", m.name);
    }
}

/// A launch's module is the general one with its layout's descriptor compiled in: the same
/// kernel name, one module per layout (cached: asking twice gives the same module), and the
/// precompiled set holds Monster Walk's modules for a 132-SM GPU.
#[test]
fn specialized_modules_differ_by_layout_and_keep_the_kernel_name() {
    use ferrograd_models::monster_walk::persistent::{modules_for, spec, PRECOMPILE_SMS};
    use ferrograd_models::persistent::trainer::{layout_for, specialized};
    let mw = spec().unwrap_or_else(|e| panic!("{e}"));
    let (a, b) = (layout_for(&mw, 132, 5041), layout_for(&mw, 114, 5041));
    let (ma, mb) = (specialized(Precision::F32, &a), specialized(Precision::F32, &b));
    assert!(std::ptr::eq(ma, specialized(Precision::F32, &a)), "the same layout gives the same module");
    assert_ne!(ma.name, mb.name);
    assert!(
        ma.name.starts_with("mlp_persistent_f32_") && ma.src.starts_with("#define MLP_FIXED_DESC 8, "),
        "{}",
        ma.name
    );
    assert!(ma.src.ends_with(trainer::module(Precision::F32).src));
    let pre = modules_for(PRECOMPILE_SMS).unwrap_or_else(|e| panic!("{e}"));
    assert!(pre.iter().any(|m| std::ptr::eq(*m, ma)));
    assert!(ferrograd_models::modules().unwrap_or_else(|e| panic!("{e}")).iter().any(|m| std::ptr::eq(*m, ma)));
    if nvrtc_info().is_err() {
        return;
    }
    for (p, m) in [Precision::F32, Precision::Tf32, Precision::Bf16].into_iter().zip(pre) {
        let cubin = ferrograd_core::cuda::nvrtc::get_or_compile(&m.source(), Arch::SM90)
            .unwrap_or_else(|e| panic!("{}: {e}", m.name));
        assert_eq!(kernel_names(&cubin.cubin), [p.kernel()], "{}", m.name);
    }
}
