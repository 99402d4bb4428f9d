//! libnvrtc itself: loading it without a panic, describing it, and one compilation to CUBIN.

use super::arch::Arch;
use super::error::KernelError;
use super::include::loaded_nvrtc_path;
use super::source::{nvrtc_options, KernelSource};
use cudarc::nvrtc::sys as nvrtc_sys;
use std::ffi::{c_char, c_int, CString};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// `nvrtcVersion()`: the CUDA release the compiler belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NvrtcVersion {
    /// Major version.
    pub major: u32,
    /// Minor version.
    pub minor: u32,
}

impl fmt::Display for NvrtcVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// What the loaded libnvrtc is and can do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NvrtcInfo {
    /// `nvrtcVersion()`.
    pub version: NvrtcVersion,
    /// `nvrtcGetSupportedArchs`, e.g. `[75, 80, 86, 87, 89, 90, 100, ...]`.
    pub supported_archs: Vec<u32>,
    /// The file the loader picked, when it can be found out (Linux).
    pub library: Option<PathBuf>,
}

impl NvrtcInfo {
    /// `Ok` when this NVRTC can compile for `arch`, else [`KernelError::UnsupportedArch`].
    pub fn check_arch(&self, arch: Arch) -> Result<(), KernelError> {
        if self.supported_archs.contains(&arch.number()) {
            Ok(())
        } else {
            Err(KernelError::UnsupportedArch { arch, nvrtc: self.version, supported: self.supported_archs.clone() })
        }
    }
}

// Every symbol we call. cudarc resolves symbols lazily and panics on a missing one, so an old
// libnvrtc picked up under one of its fallback names (libnvrtc.so.11, ...) must be refused first.
const NVRTC_SYMBOLS: [&str; 10] = [
    "nvrtcVersion",
    "nvrtcGetNumSupportedArchs",
    "nvrtcGetSupportedArchs",
    "nvrtcCreateProgram",
    "nvrtcCompileProgram",
    "nvrtcGetProgramLogSize",
    "nvrtcGetProgramLog",
    "nvrtcGetCUBINSize",
    "nvrtcGetCUBIN",
    "nvrtcDestroyProgram",
];

/// Loads libnvrtc once per process and describes it; the gate every NVRTC call goes through.
pub fn nvrtc_info() -> Result<&'static NvrtcInfo, KernelError> {
    static INFO: OnceLock<Result<NvrtcInfo, KernelError>> = OnceLock::new();
    INFO.get_or_init(load_nvrtc).as_ref().map_err(Clone::clone)
}

fn load_nvrtc() -> Result<NvrtcInfo, KernelError> {
    // SAFETY: only tries to dlopen candidate names; never panics.
    if !unsafe { nvrtc_sys::is_culib_present() } {
        let mut candidates = cudarc::get_lib_name_candidates("nvrtc");
        let mut seen = std::collections::HashSet::new();
        candidates.retain(|c| seen.insert(c.clone()));
        return Err(KernelError::NvrtcMissing { candidates });
    }
    // SAFETY: is_culib_present() just opened one of the names culib() tries, in the same order,
    // so culib() finds a library instead of panicking.
    let lib = unsafe { nvrtc_sys::culib() };
    let library = loaded_nvrtc_path();
    for symbol in NVRTC_SYMBOLS {
        // SAFETY: the symbol is only looked up, never called through this type.
        if unsafe { lib.get::<unsafe extern "C" fn()>(symbol.as_bytes()) }.is_err() {
            return Err(KernelError::NvrtcTooOld {
                library: library.as_ref().map_or_else(|| "(unknown path)".to_string(), |p| p.display().to_string()),
                symbol: symbol.to_string(),
            });
        }
    }
    let nvrtc_err = |call: &'static str, r: nvrtc_sys::nvrtcResult| KernelError::Nvrtc {
        name: "(none)".to_string(),
        call,
        code: format!("{r:?}"),
    };
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: library present and symbol checked; both pointers are valid for writes.
    unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) }.result().map_err(|e| nvrtc_err("nvrtcVersion", e.0))?;
    let mut n: c_int = 0;
    // SAFETY: as above.
    unsafe { nvrtc_sys::nvrtcGetNumSupportedArchs(&mut n) }
        .result()
        .map_err(|e| nvrtc_err("nvrtcGetNumSupportedArchs", e.0))?;
    let mut archs: Vec<c_int> = vec![0; usize::try_from(n).unwrap_or(0)];
    if !archs.is_empty() {
        // SAFETY: the buffer holds exactly the number of entries NVRTC just reported.
        unsafe { nvrtc_sys::nvrtcGetSupportedArchs(archs.as_mut_ptr()) }
            .result()
            .map_err(|e| nvrtc_err("nvrtcGetSupportedArchs", e.0))?;
    }
    Ok(NvrtcInfo {
        version: NvrtcVersion { major: u32::try_from(major).unwrap_or(0), minor: u32::try_from(minor).unwrap_or(0) },
        supported_archs: archs.into_iter().filter_map(|a| u32::try_from(a).ok()).collect(),
        library,
    })
}

/// Owns an `nvrtcProgram` so every exit path destroys it.
struct Program(nvrtc_sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by nvrtcCreateProgram and destroyed only here. A failure would only
        // leak the program; there is nothing better to do with it in a destructor.
        let _ = unsafe { nvrtc_sys::nvrtcDestroyProgram(&mut self.0) };
    }
}

/// One NVRTC compilation of `kernel` for `arch` to CUBIN, no caching. `include_dir` holds the
/// CUDA headers (see [`find_cuda_include`](super::find_cuda_include)); our own shared headers
/// travel with `kernel`.
pub fn compile_cubin(kernel: &KernelSource<'_>, arch: Arch, include_dir: &Path) -> Result<Vec<u8>, KernelError> {
    let arch = kernel.target(arch);
    nvrtc_info()?.check_arch(arch)?;
    compile_checked(kernel, arch, &nvrtc_options(arch, kernel), include_dir)
}

/// `compile_cubin` once NVRTC is known to be loaded and `arch` supported.
pub(crate) fn compile_checked(
    kernel: &KernelSource<'_>,
    arch: Arch,
    options: &[String],
    include_dir: &Path,
) -> Result<Vec<u8>, KernelError> {
    let name = kernel.name;
    let invalid = |what: String| KernelError::InvalidInput { name: name.to_string(), what };
    let src = CString::new(kernel.src).map_err(|_| invalid("the source".to_string()))?;
    let c_name = CString::new(name).map_err(|_| invalid("the name".to_string()))?;
    let mut c_opts = options
        .iter()
        .map(|o| CString::new(o.as_str()).map_err(|_| invalid(format!("option {o:?}"))))
        .collect::<Result<Vec<_>, _>>()?;
    let mut include = b"--include-path=".to_vec();
    include.extend_from_slice(include_dir.as_os_str().as_encoded_bytes());
    c_opts.push(CString::new(include).map_err(|_| invalid(format!("include dir {}", include_dir.display())))?);
    let opt_ptrs: Vec<*const c_char> = c_opts.iter().map(|c| c.as_ptr()).collect();
    // Our shared headers, handed to NVRTC by name: `#include "row_reduce.cuh"` finds them first.
    let header = |what: &str, s: &str| CString::new(s).map_err(|_| invalid(format!("header {what}")));
    let h_names = kernel.headers.iter().map(|h| header(h.name, h.name)).collect::<Result<Vec<_>, _>>()?;
    let h_srcs = kernel.headers.iter().map(|h| header(h.name, h.src)).collect::<Result<Vec<_>, _>>()?;
    let h_name_ptrs: Vec<*const c_char> = h_names.iter().map(|c| c.as_ptr()).collect();
    let h_src_ptrs: Vec<*const c_char> = h_srcs.iter().map(|c| c.as_ptr()).collect();
    let n_headers = c_int::try_from(h_src_ptrs.len()).map_err(|_| invalid("the header count".to_string()))?;
    let nvrtc_err = |call: &'static str, r: nvrtc_sys::nvrtcResult| KernelError::Nvrtc {
        name: name.to_string(),
        call,
        code: format!("{r:?}"),
    };

    let mut raw: nvrtc_sys::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: src, c_name and the header strings outlive the program (dropped after `prog`
    // below); both header arrays hold n_headers NUL-terminated strings.
    unsafe {
        nvrtc_sys::nvrtcCreateProgram(
            &mut raw,
            src.as_ptr(),
            c_name.as_ptr(),
            n_headers,
            h_src_ptrs.as_ptr(),
            h_name_ptrs.as_ptr(),
        )
    }
    .result()
    .map_err(|e| nvrtc_err("nvrtcCreateProgram", e.0))?;
    let prog = Program(raw);

    let n_opts = c_int::try_from(opt_ptrs.len()).unwrap_or(c_int::MAX);
    // SAFETY: opt_ptrs points at n_opts NUL-terminated strings alive for the call.
    let compiled = unsafe { nvrtc_sys::nvrtcCompileProgram(prog.0, n_opts, opt_ptrs.as_ptr()) };
    if compiled != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
        let log = program_log(&prog).unwrap_or_else(|e| format!("(no log: {e})"));
        let mut shown = options.to_vec();
        shown.push(format!("--include-path={}", include_dir.display()));
        return Err(KernelError::Compile {
            name: name.to_string(),
            arch,
            code: format!("{compiled:?}"),
            options: shown,
            log,
        });
    }

    let mut size: usize = 0;
    // SAFETY: prog compiled successfully; size is valid for writes.
    unsafe { nvrtc_sys::nvrtcGetCUBINSize(prog.0, &mut size) }
        .result()
        .map_err(|e| nvrtc_err("nvrtcGetCUBINSize", e.0))?;
    let mut cubin = vec![0u8; size];
    // SAFETY: the buffer has the size NVRTC reported for this program's CUBIN.
    unsafe { nvrtc_sys::nvrtcGetCUBIN(prog.0, cubin.as_mut_ptr().cast::<c_char>()) }
        .result()
        .map_err(|e| nvrtc_err("nvrtcGetCUBIN", e.0))?;
    Ok(cubin)
}

/// The entry points of a CUBIN, sorted: the names of its `.text.<kernel>` sections (read from the
/// ELF section-name table as text, which is enough for the CUBINs NVRTC writes). Lets tests check
/// that the module a launch picks holds the kernel it names, without a GPU.
pub fn kernel_names(cubin: &[u8]) -> Vec<String> {
    const TEXT: &[u8] = b"\0.text.";
    let mut names: Vec<String> = cubin
        .windows(TEXT.len())
        .enumerate()
        .filter(|(_, w)| *w == TEXT)
        .filter_map(|(i, _)| {
            let rest = &cubin[i + TEXT.len()..];
            let end = rest.iter().position(|&b| b == 0)?;
            std::str::from_utf8(&rest[..end]).ok().filter(|n| !n.is_empty()).map(str::to_string)
        })
        .collect();
    names.sort();
    names.dedup();
    names
}

fn program_log(prog: &Program) -> Result<String, String> {
    let mut size: usize = 0;
    // SAFETY: prog is a live program; size is valid for writes.
    unsafe { nvrtc_sys::nvrtcGetProgramLogSize(prog.0, &mut size) }.result().map_err(|e| format!("{:?}", e.0))?;
    let mut log = vec![0u8; size];
    if size > 0 {
        // SAFETY: the buffer has the size NVRTC reported, terminating NUL included.
        unsafe { nvrtc_sys::nvrtcGetProgramLog(prog.0, log.as_mut_ptr().cast::<c_char>()) }
            .result()
            .map_err(|e| format!("{:?}", e.0))?;
    }
    let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
    Ok(String::from_utf8_lossy(&log[..end]).trim_end().to_string())
}
