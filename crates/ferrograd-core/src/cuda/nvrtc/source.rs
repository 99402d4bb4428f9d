//! What NVRTC compiles: a module's source, the shared headers it may `#include`, the `-D` defines
//! Rust passes to it, and the compile options.
//!
//! A kernel module is declared once as a `const` [`Module`] (name, source, headers, defines) next
//! to the code that launches it: core ops in `src/cuda/modules.rs`, a fused op in its own folder
//! under `src/fused/`, a model's own kernels in the model's crate. Constants that both sides must
//! agree on (a row cap, a table size, a sentinel) are Rust constants passed as defines, so the
//! `.cu` file never repeats a number by hand; they are part of the cache key.

use super::arch::Arch;

/// A header a module may include by name (`#include "row_reduce.cuh"`): NVRTC gets its text
/// directly, so nothing is read from disk at run time. A header brings the defines its text needs
/// (`common.cuh` needs `FG_MAX_DIMS`), so every module that includes it gets them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Header {
    /// The name the source includes it by.
    pub name: &'static str,
    /// Its text.
    pub src: &'static str,
    /// Defines every includer gets.
    pub defines: &'static [Define],
}

impl Header {
    /// A header without defines.
    pub const fn new(name: &'static str, src: &'static str) -> Header {
        Header { name, src, defines: &[] }
    }

    /// The header with these defines.
    pub const fn with_defines(self, defines: &'static [Define]) -> Header {
        Header { defines, ..self }
    }
}

/// A `-D NAME=VALUE` define from Rust. `suffix` is appended to the value (`u` for an unsigned
/// constant such as a `0xffffffff` sentinel).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Define {
    /// The macro name.
    pub name: &'static str,
    /// Its value.
    pub value: i64,
    /// Appended to the value (`u` or nothing).
    pub suffix: &'static str,
}

impl Define {
    /// A signed integer constant.
    pub const fn int(name: &'static str, value: i64) -> Define {
        Define { name, value, suffix: "" }
    }

    /// An `unsigned int` constant (the value gets a `u` suffix).
    pub const fn uint(name: &'static str, value: u32) -> Define {
        Define { name, value: value as i64, suffix: "u" }
    }

    /// The NVRTC option.
    pub fn option(&self) -> String {
        format!("-D{}={}{}", self.name, self.value, self.suffix)
    }
}

/// Per-kernel compile options. `Copy` and const-constructible so a kernel table can be a
/// `const` next to the `include_str!`s.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct CompileOptions {
    /// `--use_fast_math`: approximate transcendentals, flush denormals. Only for kernels whose
    /// CPU twin tolerates it; exact by default.
    pub fast_math: bool,
    /// Extra NVRTC flags, e.g. `-lineinfo` for profiling.
    pub extra: &'static [&'static str],
    /// A Hopper-only module (`wgmma` kernels): built for `sm_90a` where the target is `sm_90`, and
    /// needed on no other target (a launch picks it on sm_90 devices only; `kernels --precompile`
    /// for another architecture skips it). An `sm_90a` CUBIN loads on sm_90 devices alone.
    pub sm90a: bool,
}

impl CompileOptions {
    /// Exact math, no extra flags.
    pub const DEFAULT: CompileOptions = CompileOptions { fast_math: false, extra: &[], sm90a: false };
    /// `--use_fast_math`.
    pub const FAST_MATH: CompileOptions = CompileOptions { fast_math: true, extra: &[], sm90a: false };
    /// Exact math, built for `sm_90a` on Hopper.
    pub const SM90A: CompileOptions = CompileOptions { fast_math: false, extra: &[], sm90a: true };
}

/// One kernel module as the cache sees it: a name for logs and errors, the CUDA C source, the
/// headers it may include, the defines and how to compile it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelSource<'a> {
    /// Name for logs and errors.
    pub name: &'a str,
    /// The CUDA C source.
    pub src: &'a str,
    /// Headers it may include.
    pub headers: &'a [Header],
    /// `-D` defines.
    pub defines: &'a [Define],
    /// Compile options.
    pub options: CompileOptions,
    /// Roughly how long NVRTC takes, for ordering a parallel precompile (see [`Module::cost_ms`]).
    pub cost_ms: u32,
}

impl<'a> KernelSource<'a> {
    /// A source without headers or defines, compiled exactly.
    pub const fn new(name: &'a str, src: &'a str) -> KernelSource<'a> {
        KernelSource { name, src, headers: &[], defines: &[], options: CompileOptions::DEFAULT, cost_ms: 0 }
    }

    /// With these options.
    pub const fn with_options(self, options: CompileOptions) -> KernelSource<'a> {
        KernelSource { options, ..self }
    }

    /// With these headers.
    pub const fn with_headers(self, headers: &'a [Header]) -> KernelSource<'a> {
        KernelSource { headers, ..self }
    }

    /// With these defines.
    pub const fn with_defines(self, defines: &'a [Define]) -> KernelSource<'a> {
        KernelSource { defines, ..self }
    }

    /// Bytes of CUDA C NVRTC reads (source and headers).
    pub fn source_len(&self) -> usize {
        self.src.len() + self.headers.iter().map(|h| h.src.len()).sum::<usize>()
    }

    /// Whether a build for `arch` is of any use: a Hopper-only module is not, elsewhere.
    pub fn needed_for(&self, arch: Arch) -> bool {
        !self.options.sm90a || arch.number() == 90
    }

    /// The architecture this source is built for when `arch` is asked: `sm_90a` for an `sm90a`
    /// module on `sm_90`, else `arch` itself. Every compile path goes through it, so the cache key,
    /// the log and the CUBIN agree.
    pub fn target(&self, arch: Arch) -> Arch {
        if self.options.sm90a && arch == Arch::SM90 {
            arch.arch_specific()
        } else {
            arch
        }
    }

    /// The key of this source's CUBIN when `arch` is asked and NVRTC `nvrtc` compiles it (the
    /// target [`KernelSource::target`] picks, the options NVRTC gets, `FERROGRAD_NVRTC_OPTIONS`
    /// included): the one key the disk cache, the prebuilt kernels and their freshness test use.
    pub fn cache_key(&self, arch: Arch, nvrtc: super::compiler::NvrtcVersion) -> super::key::CacheKey {
        let target = self.target(arch);
        let options = nvrtc_options(target, self);
        super::key::CacheKey::new(self.name, self.src, self.headers, &options, nvrtc, target)
    }

    /// The expected NVRTC milliseconds: `cost_ms` where the module declares it, else a guess from
    /// the source length (a poor predictor: the back end's work depends on the instantiations).
    pub fn expected_ms(&self) -> u64 {
        if self.cost_ms > 0 {
            u64::from(self.cost_ms)
        } else {
            (self.source_len() / 20) as u64
        }
    }
}

/// A kernel module declared in Rust: `const MODULE: Module = Module::new("softmax",
/// include_str!("softmax.cu")).with_headers(&[COMMON, ROW_REDUCE]).with_defines(&[...]);`.
/// Registered in `src/cuda/modules.rs` `ALL` (what `ferrograd kernels --precompile` and the NVRTC
/// compile test walk); a model's own module (`CudaDevice::launch_raw`) need not be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Module {
    /// The module's name (kernel cache logs, `ferrograd kernels`).
    pub name: &'static str,
    /// The CUDA C source.
    pub src: &'static str,
    /// Headers it may include.
    pub headers: &'static [Header],
    /// `-D` defines.
    pub defines: &'static [Define],
    /// Compile options.
    pub options: CompileOptions,
    /// NVRTC milliseconds this module took for sm_90 on the 2-core dev machine, 0 where not
    /// measured. Only orders a cold `ferrograd kernels --precompile` (longest first, so that the
    /// long compiles do not start last); not part of the cache key.
    pub cost_ms: u32,
}

impl Module {
    /// A module without headers or defines, compiled exactly.
    pub const fn new(name: &'static str, src: &'static str) -> Module {
        Module { name, src, headers: &[], defines: &[], options: CompileOptions::DEFAULT, cost_ms: 0 }
    }

    /// This module's measured NVRTC time in milliseconds: a cold precompile starts the longest first.
    pub const fn with_cost_ms(self, cost_ms: u32) -> Module {
        Module { cost_ms, ..self }
    }

    /// With these headers (their defines come along).
    pub const fn with_headers(self, headers: &'static [Header]) -> Module {
        Module { headers, ..self }
    }

    /// With these defines.
    pub const fn with_defines(self, defines: &'static [Define]) -> Module {
        Module { defines, ..self }
    }

    /// With these options.
    pub const fn with_options(self, options: CompileOptions) -> Module {
        Module { options, ..self }
    }

    /// What the kernel cache compiles.
    pub const fn source(&self) -> KernelSource<'static> {
        KernelSource {
            name: self.name,
            src: self.src,
            headers: self.headers,
            defines: self.defines,
            options: self.options,
            cost_ms: self.cost_ms,
        }
    }

    /// Bytes of CUDA C NVRTC reads for this module (source and headers).
    pub fn source_len(&self) -> usize {
        self.source().source_len()
    }
}

/// Extra NVRTC flags for every module, whitespace-separated (`-lineinfo` for a profiler,
/// `--Ofast-compile=min` to measure what it saves and costs). They are part of the cache key, like
/// every option, so a run with them never reads a CUBIN built without them.
pub const NVRTC_OPTIONS_ENV: &str = "FERROGRAD_NVRTC_OPTIONS";

/// [`NVRTC_OPTIONS_ENV`]'s flags, read once per process.
pub fn env_options() -> &'static [String] {
    static OPTIONS: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    OPTIONS.get_or_init(|| {
        std::env::var(NVRTC_OPTIONS_ENV)
            .map_or_else(|_| Vec::new(), |v| v.split_whitespace().map(str::to_string).collect())
    })
}

/// The NVRTC flags that determine the output, i.e. everything but the include path.
pub(crate) fn nvrtc_options(arch: Arch, kernel: &KernelSource<'_>) -> Vec<String> {
    options_with(arch, kernel, env_options())
}

fn options_with(arch: Arch, kernel: &KernelSource<'_>, env: &[String]) -> Vec<String> {
    let mut out = vec![format!("--gpu-architecture={arch}"), "-std=c++17".to_string()];
    if kernel.options.fast_math {
        out.push("--use_fast_math".to_string());
    }
    out.extend(kernel.options.extra.iter().map(|s| s.to_string()));
    out.extend(env.iter().cloned());
    let headers = kernel.headers.iter().flat_map(|h| h.defines);
    out.extend(headers.chain(kernel.defines).map(Define::option));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_are_exact_and_fast_math_only_when_asked() {
        let o = nvrtc_options(Arch::SM80, &KernelSource::new("k", ""));
        assert_eq!(o, ["--gpu-architecture=sm_80", "-std=c++17"]);
        let k = KernelSource::new("k", "").with_options(CompileOptions {
            fast_math: true,
            extra: &["-lineinfo"],
            sm90a: false,
        });
        let o = nvrtc_options(Arch::SM90.arch_specific(), &k);
        assert_eq!(o, ["--gpu-architecture=sm_90a", "-std=c++17", "--use_fast_math", "-lineinfo"]);
    }

    #[test]
    fn sm90a_modules_target_sm90a_on_hopper_only() {
        let k = KernelSource::new("k", "").with_options(CompileOptions::SM90A);
        assert_eq!(k.target(Arch::SM90), Arch::SM90.arch_specific());
        assert_eq!(k.target(Arch::SM80), Arch::SM80);
        assert_eq!(k.target(Arch::new(10, 0)), Arch::new(10, 0));
        assert_eq!(KernelSource::new("k", "").target(Arch::SM90), Arch::SM90);
        assert_eq!(nvrtc_options(k.target(Arch::SM90), &k)[0], "--gpu-architecture=sm_90a");
        assert!(k.needed_for(Arch::SM90) && k.needed_for(Arch::SM90.arch_specific()) && !k.needed_for(Arch::SM80));
        assert!(KernelSource::new("k", "").needed_for(Arch::SM80));
    }

    #[test]
    fn env_options_follow_the_module_flags() {
        let k = KernelSource::new("k", "").with_options(CompileOptions {
            fast_math: false,
            extra: &["-lineinfo"],
            sm90a: false,
        });
        const D: &[Define] = &[Define::int("FG_X", 1)];
        let env = ["--Ofast-compile=min".to_string()];
        let o = options_with(Arch::SM90, &k.with_defines(D), &env);
        assert_eq!(o, ["--gpu-architecture=sm_90", "-std=c++17", "-lineinfo", "--Ofast-compile=min", "-DFG_X=1"]);
    }

    #[test]
    fn defines_become_d_options_after_the_flags() {
        const D: &[Define] = &[Define::int("FG_ROW_CAP", 32), Define::uint("FG_IGNORED", u32::MAX)];
        let o = nvrtc_options(Arch::SM90, &KernelSource::new("k", "").with_defines(D));
        assert_eq!(o, ["--gpu-architecture=sm_90", "-std=c++17", "-DFG_ROW_CAP=32", "-DFG_IGNORED=4294967295u"]);
    }

    #[test]
    fn a_module_hands_everything_to_its_source() {
        const H: &[Header] = &[Header::new("a.cuh", "#define A 1\n").with_defines(&[Define::int("C", 3)])];
        const D: &[Define] = &[Define::int("B", 2)];
        const M: Module = Module::new("m", "A B").with_headers(H).with_defines(D);
        let s = M.source();
        assert_eq!((s.name, s.src, s.headers, s.defines), ("m", "A B", H, D));
        assert_eq!(M.source_len(), 3 + 12);
        // The header's defines come first, then the module's.
        assert_eq!(&nvrtc_options(Arch::SM80, &s)[2..], ["-DC=3", "-DB=2"]);
    }
}
