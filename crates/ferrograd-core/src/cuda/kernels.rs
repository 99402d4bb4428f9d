//! Embedded CUDA C -> NVRTC -> CUBIN, behind an in-process cache and an on-disk cache.
//!
//! Why CUBIN and not PTX: PTX is JIT-compiled by the driver every time a module is loaded (the
//! driver's own cache is per-user, size-capped and keyed on things we do not control), while a
//! CUBIN built for the device's exact `sm_XY` loads as-is. NVRTC costs ~0.2 s per kernel file cold
//! (more with the fp16/bf16 headers), so a dozen files would cost seconds at every start; the disk
//! cache makes the second start pay only a file read.
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

use std::collections::HashMap;
use std::ffi::{c_char, c_int, CString, OsString};
use std::fmt;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use cudarc::nvrtc::sys as nvrtc_sys;
use sha2::{Digest, Sha256};

/// Directory of the on-disk cache; empty disables it.
pub const CACHE_DIR_ENV: &str = "FERROGRAD_CACHE_DIR";
/// Directory (or `:`-separated list) searched first for the CUDA headers.
pub const CUDA_INCLUDE_ENV: &str = "FERROGRAD_CUDA_INCLUDE";

/// Headers our kernels include; a directory counts as a CUDA include dir only if it has all.
const REQUIRED_HEADERS: [&str; 2] = ["cuda_fp16.h", "cuda_bf16.h"];

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

/// Everything that can go wrong while turning a kernel source into a CUBIN.
///
/// Clone because [`nvrtc_info`] remembers its outcome for the whole process and hands out copies.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    #[error(
        "libnvrtc not found: none of [{}] could be loaded from the loader path; install the CUDA \
         toolkit, or `pip install nvidia-cuda-nvrtc` and put its nvidia/cu13/lib on \
         LD_LIBRARY_PATH before the process starts",
        .candidates.join(", ")
    )]
    NvrtcMissing { candidates: Vec<String> },

    #[error("libnvrtc at {library} lacks `{symbol}`; it is too old (CUDA 12 or newer is needed)")]
    NvrtcTooOld { library: String, symbol: String },

    #[error(
        "CUDA headers ({}) not found; searched: {}. Set {CUDA_INCLUDE_ENV} or CUDA_HOME, or \
         `pip install nvidia-cuda-runtime` (headers in nvidia/cu13/include)",
        REQUIRED_HEADERS.join(", "),
        display_paths(.searched)
    )]
    HeadersNotFound { searched: Vec<PathBuf> },

    #[error("`{0}` is not a GPU architecture (expected sm_80, sm_90a, 90, 9.0, ...)")]
    InvalidArch(String),

    #[error("NVRTC {nvrtc} cannot compile for {arch}; it supports {}", display_archs(.supported))]
    UnsupportedArch { arch: Arch, nvrtc: NvrtcVersion, supported: Vec<u32> },

    #[error("kernel `{name}`: {what} contains a NUL byte")]
    InvalidInput { name: String, what: String },

    #[error("kernel `{name}` failed to compile for {arch} ({code}); options {options:?}:\n{log}")]
    Compile { name: String, arch: Arch, code: String, options: Vec<String>, log: String },

    #[error("kernel `{name}`: NVRTC call {call} failed: {code}")]
    Nvrtc { name: String, call: &'static str, code: String },
}

impl KernelError {
    /// The kernel the error is about, for callers that file it under a per-kernel error.
    pub fn kernel_name(&self) -> Option<&str> {
        match self {
            KernelError::InvalidInput { name, .. }
            | KernelError::Compile { name, .. }
            | KernelError::Nvrtc { name, .. } => Some(name),
            _ => None,
        }
    }
}

fn display_paths(paths: &[PathBuf]) -> String {
    if paths.is_empty() {
        return "nothing (no candidate directory)".to_string();
    }
    paths.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
}

fn display_archs(archs: &[u32]) -> String {
    archs.iter().map(|a| format!("sm_{a}")).collect::<Vec<_>>().join(", ")
}

// ---------------------------------------------------------------------------------------------
// Architecture and options
// ---------------------------------------------------------------------------------------------

/// A real GPU architecture (`sm_XY`), the unit a CUBIN is built for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Arch {
    major: u32,
    minor: u32,
    specific: bool,
}

impl Arch {
    pub const SM80: Arch = Arch::new(8, 0);
    pub const SM90: Arch = Arch::new(9, 0);

    pub const fn new(major: u32, minor: u32) -> Arch {
        Arch { major, minor, specific: false }
    }

    /// The `a` variant (`sm_90a`): unlocks instructions that exist only on that exact chip
    /// (wgmma, setmaxnreg), at the price of a CUBIN that loads on nothing else.
    pub const fn arch_specific(self) -> Arch {
        Arch { specific: true, ..self }
    }

    /// From the driver's compute-capability attributes, which are `c_int`s.
    pub fn from_compute_capability(major: i32, minor: i32) -> Result<Arch, KernelError> {
        match (u32::try_from(major), u32::try_from(minor)) {
            (Ok(ma), Ok(mi)) if ma > 0 && mi < 10 => Ok(Arch::new(ma, mi)),
            _ => Err(KernelError::InvalidArch(format!("{major}.{minor}"))),
        }
    }

    pub fn major(self) -> u32 {
        self.major
    }

    pub fn minor(self) -> u32 {
        self.minor
    }

    pub fn is_arch_specific(self) -> bool {
        self.specific
    }

    /// The number NVRTC uses in `nvrtcGetSupportedArchs` (90 for sm_90 and sm_90a).
    pub fn number(self) -> u32 {
        self.major * 10 + self.minor
    }
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let suffix = if self.specific { "a" } else { "" };
        write!(f, "sm_{}{}{suffix}", self.major, self.minor)
    }
}

/// Accepts `sm_90`, `sm_90a`, `90`, `9.0`: the spellings of `nvcc`, `nvidia-smi` and PyTorch's
/// `TORCH_CUDA_ARCH_LIST`, so a user can paste whichever they have.
impl FromStr for Arch {
    type Err = KernelError;

    fn from_str(s: &str) -> Result<Arch, KernelError> {
        let bad = || KernelError::InvalidArch(s.to_string());
        let t = s.trim();
        let t = t.strip_prefix("sm_").unwrap_or(t);
        let (t, specific) = match t.strip_suffix('a') {
            Some(rest) => (rest, true),
            None => (t, false),
        };
        let arch = if let Some((ma, mi)) = t.split_once('.') {
            let major = ma.parse::<u32>().map_err(|_| bad())?;
            let minor = mi.parse::<u32>().map_err(|_| bad())?;
            if minor > 9 {
                return Err(bad());
            }
            Arch::new(major, minor)
        } else {
            if !(2..=3).contains(&t.len()) || !t.bytes().all(|b| b.is_ascii_digit()) {
                return Err(bad());
            }
            let n = t.parse::<u32>().map_err(|_| bad())?;
            Arch::new(n / 10, n % 10)
        };
        if arch.major == 0 {
            return Err(bad());
        }
        Ok(if specific { arch.arch_specific() } else { arch })
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
}

impl CompileOptions {
    pub const DEFAULT: CompileOptions = CompileOptions { fast_math: false, extra: &[] };
    pub const FAST_MATH: CompileOptions = CompileOptions { fast_math: true, extra: &[] };
}

/// One kernel file: a name for logs and errors, the CUDA C source, how to compile it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelSource<'a> {
    pub name: &'a str,
    pub src: &'a str,
    pub options: CompileOptions,
}

impl<'a> KernelSource<'a> {
    pub const fn new(name: &'a str, src: &'a str) -> KernelSource<'a> {
        KernelSource { name, src, options: CompileOptions::DEFAULT }
    }

    pub const fn with_options(self, options: CompileOptions) -> KernelSource<'a> {
        KernelSource { options, ..self }
    }
}

/// The NVRTC flags that determine the output, i.e. everything but the include path.
fn nvrtc_options(arch: Arch, options: &CompileOptions) -> Vec<String> {
    let mut out = vec![format!("--gpu-architecture={arch}"), "-std=c++17".to_string()];
    if options.fast_math {
        out.push("--use_fast_math".to_string());
    }
    out.extend(options.extra.iter().map(|s| s.to_string()));
    out
}

// ---------------------------------------------------------------------------------------------
// Cache key
// ---------------------------------------------------------------------------------------------

/// SHA-256 naming one CUBIN: equal keys must mean byte-identical compiler input.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct CacheKey([u8; 32]);

impl CacheKey {
    /// Each field is tagged and length-prefixed so that moving bytes from one field into the
    /// next (source ending in "x", option starting with "x") cannot produce the same key.
    pub fn new(name: &str, source: &str, options: &[String], nvrtc: NvrtcVersion, arch: Arch) -> CacheKey {
        fn field(h: &mut Sha256, tag: &[u8], bytes: &[u8]) {
            h.update(tag);
            h.update((bytes.len() as u64).to_le_bytes());
            h.update(bytes);
        }
        let mut h = Sha256::new();
        field(&mut h, b"ferrograd-kernel-key/1", b"");
        field(&mut h, b"name", name.as_bytes());
        field(&mut h, b"source", source.as_bytes());
        for opt in options {
            field(&mut h, b"option", opt.as_bytes());
        }
        field(&mut h, b"nvrtc", nvrtc.to_string().as_bytes());
        field(&mut h, b"arch", arch.to_string().as_bytes());
        CacheKey(h.finalize().into())
    }

    pub const fn from_bytes(bytes: [u8; 32]) -> CacheKey {
        CacheKey(bytes)
    }

    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    pub fn to_hex(&self) -> String {
        hex(&self.0)
    }
}

impl fmt::Display for CacheKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for CacheKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CacheKey({})", self.to_hex())
    }
}

fn hex(bytes: &[u8]) -> String {
    use fmt::Write as _;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        // Writing to a String cannot fail.
        let _ = write!(s, "{b:02x}");
    }
    s
}

// ---------------------------------------------------------------------------------------------
// On-disk cache
// ---------------------------------------------------------------------------------------------

// Entry layout, integers little-endian:
//   magic [8] | format version u32 | flags u32 (reserved, 0) | key [32] | compile time µs u64 |
//   payload length u64 | payload SHA-256 [32] | payload
// The key is repeated inside so that a file copied or renamed onto another key's name is caught;
// the length and hash catch truncation, a torn write from a crashed process, and bit rot.
const MAGIC: [u8; 8] = *b"FGCUBIN\0";
const FORMAT_VERSION: u32 = 1;
const OFF_VERSION: usize = 8;
const OFF_KEY: usize = 16;
const OFF_COMPILE_MICROS: usize = 48;
const OFF_PAYLOAD_LEN: usize = 56;
const OFF_PAYLOAD_SHA: usize = 64;
/// Bytes before the payload.
pub const HEADER_LEN: usize = 96;

/// A CUBIN read back from disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CachedCubin {
    pub cubin: Vec<u8>,
    /// What NVRTC took when the entry was written: the time a cache hit saves.
    pub compile_time: Duration,
}

/// Outcome of [`DiskCache::get`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    Hit(CachedCubin),
    Miss,
    /// The file exists but cannot be trusted; the reason says why. Recompile and `put` over it.
    Corrupt(String),
}

/// A directory of CUBINs, one file per [`CacheKey`], written atomically.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskCache {
    dir: PathBuf,
}

impl DiskCache {
    pub fn new(dir: impl Into<PathBuf>) -> DiskCache {
        DiskCache { dir: dir.into() }
    }

    /// `$FERROGRAD_CACHE_DIR`, else `$HOME/.cache/ferrograd/kernels`; `None` when the variable
    /// is set but empty (caching switched off) or there is no home directory.
    pub fn from_env() -> Option<DiskCache> {
        default_cache_dir(&|k| std::env::var_os(k)).map(DiskCache::new)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn path_for(&self, key: &CacheKey) -> PathBuf {
        self.dir.join(format!("{}.cubin", key.to_hex()))
    }

    /// A missing file is a miss, an untrustworthy one `Corrupt`; only I/O trouble other than
    /// "not found" is an error.
    pub fn get(&self, key: &CacheKey) -> io::Result<Lookup> {
        let bytes = match fs::read(self.path_for(key)) {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Lookup::Miss),
            Err(e) => return Err(e),
        };
        Ok(decode_entry(key, &bytes))
    }

    /// Write through the project's one atomic write (`crate::io::write_atomic`: an exclusive
    /// temporary file in the same directory, fsync, rename): readers in other processes see the
    /// old entry or the new one, never half of one, two processes writing the same key both leave
    /// a valid file, and a symlink planted in the cache directory is never followed.
    pub fn put(&self, key: &CacheKey, cubin: &[u8], compile_time: Duration) -> io::Result<PathBuf> {
        fs::create_dir_all(&self.dir)?;
        let path = self.path_for(key);
        let entry = encode_entry(key, cubin, compile_time);
        crate::io::write_atomic(&path, &entry).map_err(|e| io::Error::other(e.to_string()))?;
        Ok(path)
    }
}

fn default_cache_dir(env: &dyn Fn(&str) -> Option<OsString>) -> Option<PathBuf> {
    match env(CACHE_DIR_ENV) {
        Some(dir) if dir.is_empty() => None,
        Some(dir) => Some(PathBuf::from(dir)),
        None => env("HOME")
            .filter(|h| !h.is_empty())
            .map(|home| PathBuf::from(home).join(".cache").join("ferrograd").join("kernels")),
    }
}

fn encode_entry(key: &CacheKey, cubin: &[u8], compile_time: Duration) -> Vec<u8> {
    let micros = u64::try_from(compile_time.as_micros()).unwrap_or(u64::MAX);
    let mut out = Vec::with_capacity(HEADER_LEN + cubin.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(key.as_bytes());
    out.extend_from_slice(&micros.to_le_bytes());
    out.extend_from_slice(&(cubin.len() as u64).to_le_bytes());
    out.extend_from_slice(&Sha256::digest(cubin));
    debug_assert_eq!(out.len(), HEADER_LEN);
    out.extend_from_slice(cubin);
    out
}

fn decode_entry(key: &CacheKey, bytes: &[u8]) -> Lookup {
    let corrupt = |why: String| Lookup::Corrupt(why);
    if bytes.len() < HEADER_LEN {
        return corrupt(format!("{} bytes, shorter than the {HEADER_LEN}-byte header", bytes.len()));
    }
    let u32_at = |o: usize| bytes[o..o + 4].try_into().map(u32::from_le_bytes);
    let u64_at = |o: usize| bytes[o..o + 8].try_into().map(u64::from_le_bytes);
    if bytes[..8] != MAGIC {
        return corrupt("bad magic: not a ferrograd kernel cache entry".to_string());
    }
    match u32_at(OFF_VERSION) {
        Ok(FORMAT_VERSION) => {}
        Ok(v) => return corrupt(format!("format version {v}, this build reads {FORMAT_VERSION}")),
        Err(_) => return corrupt("unreadable format version".to_string()),
    }
    if bytes[OFF_KEY..OFF_KEY + 32] != key.as_bytes()[..] {
        return corrupt(format!("holds key {}, not {key}", hex(&bytes[OFF_KEY..OFF_KEY + 32])));
    }
    let (Ok(micros), Ok(len)) = (u64_at(OFF_COMPILE_MICROS), u64_at(OFF_PAYLOAD_LEN)) else {
        return corrupt("unreadable header".to_string());
    };
    let payload = &bytes[HEADER_LEN..];
    if payload.len() as u64 != len {
        return corrupt(format!("payload is {} bytes, header says {len}", payload.len()));
    }
    if Sha256::digest(payload)[..] != bytes[OFF_PAYLOAD_SHA..OFF_PAYLOAD_SHA + 32] {
        return corrupt("payload checksum mismatch".to_string());
    }
    Lookup::Hit(CachedCubin { cubin: payload.to_vec(), compile_time: Duration::from_micros(micros) })
}

// ---------------------------------------------------------------------------------------------
// CUDA header search
// ---------------------------------------------------------------------------------------------

/// Every directory [`find_cuda_include`] would look at, in order, for this process.
pub fn cuda_include_candidates() -> Vec<PathBuf> {
    let nvrtc_lib = loaded_nvrtc_path();
    include_candidates(&|k| std::env::var_os(k), nvrtc_lib.as_deref())
}

/// The first candidate holding `cuda_fp16.h` and `cuda_bf16.h`, or an error listing them all.
pub fn find_cuda_include() -> Result<PathBuf, KernelError> {
    first_include_dir(cuda_include_candidates())
}

fn first_include_dir(candidates: Vec<PathBuf>) -> Result<PathBuf, KernelError> {
    match candidates.iter().find(|d| REQUIRED_HEADERS.iter().all(|h| d.join(h).is_file())) {
        Some(dir) => Ok(dir.clone()),
        None => Err(KernelError::HeadersNotFound { searched: candidates }),
    }
}

/// Order: what the user named, then the headers next to the libnvrtc actually loaded (they
/// match its version), then the usual toolkit place, then pip wheels in any Python we can see.
fn include_candidates(env: &dyn Fn(&str) -> Option<OsString>, nvrtc_lib: Option<&Path>) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = Vec::new();
    if let Some(list) = env(CUDA_INCLUDE_ENV) {
        out.extend(std::env::split_paths(&list).filter(|p| !p.as_os_str().is_empty()));
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(root) = env(var).filter(|v| !v.is_empty()) {
            out.push(PathBuf::from(root).join("include"));
        }
    }
    // Toolkit: <root>/lib64/libnvrtc.so -> <root>/include; wheel: cu13/lib -> cu13/include.
    if let Some(lib_dir) = nvrtc_lib.and_then(Path::parent) {
        if let Some(root) = lib_dir.parent() {
            out.push(root.join("include"));
        }
    }
    out.push(PathBuf::from("/usr/local/cuda/include"));
    let mut prefixes: Vec<PathBuf> = Vec::new();
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(p) = env(var).filter(|v| !v.is_empty()) {
            prefixes.push(PathBuf::from(p));
        }
    }
    if let Some(home) = env("HOME").filter(|v| !v.is_empty()) {
        prefixes.push(PathBuf::from(home).join(".local"));
    }
    prefixes.push(PathBuf::from("/usr/local"));
    prefixes.push(PathBuf::from("/usr"));
    for prefix in prefixes {
        for py in python_lib_dirs(&prefix.join("lib")) {
            for packages in ["site-packages", "dist-packages"] {
                out.push(py.join(packages).join("nvidia").join("cu13").join("include"));
            }
        }
    }
    let mut seen = std::collections::HashSet::new();
    out.retain(|p| seen.insert(p.clone()));
    out
}

/// `<lib>/python3*`, sorted so the search order does not depend on directory order.
fn python_lib_dirs(lib: &Path) -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir(lib) else {
        return Vec::new();
    };
    let mut dirs: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
        .map(|e| e.path())
        .filter(|p| p.is_dir())
        .collect();
    dirs.sort();
    dirs
}

/// Where the loader found libnvrtc, read from the process's own mappings (the loader does not
/// tell libloading's callers which path it picked).
#[cfg(target_os = "linux")]
fn loaded_nvrtc_path() -> Option<PathBuf> {
    let maps = fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines().find_map(|line| {
        let path = line.split_whitespace().nth(5)?;
        let file = Path::new(path).file_name()?.to_str()?;
        (file.starts_with("libnvrtc.") && !file.contains("builtins")).then(|| PathBuf::from(path))
    })
}

#[cfg(not(target_os = "linux"))]
fn loaded_nvrtc_path() -> Option<PathBuf> {
    None
}

// ---------------------------------------------------------------------------------------------
// NVRTC
// ---------------------------------------------------------------------------------------------

/// `nvrtcVersion()`: the CUDA release the compiler belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NvrtcVersion {
    pub major: u32,
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
    pub version: NvrtcVersion,
    /// `nvrtcGetSupportedArchs`, e.g. `[75, 80, 86, 87, 89, 90, 100, ...]`.
    pub supported_archs: Vec<u32>,
    /// The file the loader picked, when it can be found out (Linux).
    pub library: Option<PathBuf>,
}

impl NvrtcInfo {
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
/// CUDA headers (see [`find_cuda_include`]).
pub fn compile_cubin(kernel: &KernelSource<'_>, arch: Arch, include_dir: &Path) -> Result<Vec<u8>, KernelError> {
    nvrtc_info()?.check_arch(arch)?;
    compile_checked(kernel, arch, &nvrtc_options(arch, &kernel.options), include_dir)
}

/// `compile_cubin` once NVRTC is known to be loaded and `arch` supported.
fn compile_checked(
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
    let nvrtc_err = |call: &'static str, r: nvrtc_sys::nvrtcResult| KernelError::Nvrtc {
        name: name.to_string(),
        call,
        code: format!("{r:?}"),
    };

    let mut raw: nvrtc_sys::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: src and c_name outlive the program (dropped after `prog` below); no headers given.
    unsafe {
        nvrtc_sys::nvrtcCreateProgram(&mut raw, src.as_ptr(), c_name.as_ptr(), 0, std::ptr::null(), std::ptr::null())
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

// ---------------------------------------------------------------------------------------------
// The kernel cache: memory, then disk, then NVRTC
// ---------------------------------------------------------------------------------------------

/// Where a [`CompiledKernel`] came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Origin {
    /// Already compiled or read earlier in this process.
    Memory,
    /// Read from the on-disk cache.
    Disk,
    /// Compiled by NVRTC just now.
    Compiled,
}

/// A CUBIN ready for `cuModuleLoadData`, and how it was obtained.
#[derive(Debug, Clone)]
pub struct CompiledKernel {
    pub name: String,
    pub arch: Arch,
    pub key: CacheKey,
    pub cubin: Arc<[u8]>,
    /// `origin != Compiled`: no NVRTC compilation happened in this call.
    pub from_cache: bool,
    pub origin: Origin,
    /// NVRTC time for this kernel: measured now on a miss, as recorded in the entry on a hit.
    pub compile_time: Duration,
    /// Wall time of this call (lookup, and compile on a miss).
    pub elapsed: Duration,
    /// Why the disk cache was skipped or repaired (unreadable dir, corrupt entry, failed write).
    pub cache_warning: Option<String>,
}

#[derive(Clone)]
struct MemoryEntry {
    cubin: Arc<[u8]>,
    compile_time: Duration,
}

/// In-process cache over an optional [`DiskCache`] over NVRTC.
pub struct KernelCache {
    disk: Option<DiskCache>,
    include_dir: OnceLock<Result<PathBuf, KernelError>>,
    // Held across a compile on purpose: two threads asking for the same kernel must not both
    // pay NVRTC, and compiles happen at start-up where serialising them costs little.
    memory: Mutex<HashMap<CacheKey, MemoryEntry>>,
}

/// Not derived: the map holds CUBIN bytes nobody wants in a debug print.
impl fmt::Debug for KernelCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let entries = self.memory.lock().map_or(0, |m| m.len());
        f.debug_struct("KernelCache")
            .field("disk", &self.disk)
            .field("include_dir", &self.include_dir.get())
            .field("entries_in_memory", &entries)
            .finish()
    }
}

impl KernelCache {
    pub fn new(disk: Option<DiskCache>) -> KernelCache {
        KernelCache { disk, include_dir: OnceLock::new(), memory: Mutex::new(HashMap::new()) }
    }

    /// Disk cache from [`DiskCache::from_env`], headers from [`find_cuda_include`].
    pub fn from_env() -> KernelCache {
        KernelCache::new(DiskCache::from_env())
    }

    /// Use these headers instead of searching.
    pub fn with_include_dir(self, dir: impl Into<PathBuf>) -> KernelCache {
        let include_dir = OnceLock::new();
        let _ = include_dir.set(Ok(dir.into()));
        KernelCache { include_dir, ..self }
    }

    pub fn disk(&self) -> Option<&DiskCache> {
        self.disk.as_ref()
    }

    /// Searched only on the first miss: a process whose kernels are all cached needs no headers.
    fn include_dir(&self) -> Result<&Path, KernelError> {
        self.include_dir.get_or_init(find_cuda_include).as_deref().map_err(Clone::clone)
    }

    /// The CUBIN of `kernel` for `arch`: from memory, else disk, else NVRTC (then stored in
    /// both). Errors only when no CUBIN can be had; cache trouble becomes `cache_warning`.
    pub fn get_or_compile(&self, kernel: &KernelSource<'_>, arch: Arch) -> Result<CompiledKernel, KernelError> {
        let start = Instant::now();
        let info = nvrtc_info()?;
        info.check_arch(arch)?;
        let options = nvrtc_options(arch, &kernel.options);
        let key = CacheKey::new(kernel.name, kernel.src, &options, info.version, arch);
        let done = |entry: &MemoryEntry, origin: Origin, cache_warning: Option<String>| CompiledKernel {
            name: kernel.name.to_string(),
            arch,
            key,
            cubin: Arc::clone(&entry.cubin),
            from_cache: origin != Origin::Compiled,
            origin,
            compile_time: entry.compile_time,
            elapsed: start.elapsed(),
            cache_warning,
        };

        // A panic while holding the lock cannot leave a half-inserted entry, so the map is
        // still sound after poisoning.
        let mut memory = self.memory.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(entry) = memory.get(&key) {
            return Ok(done(entry, Origin::Memory, None));
        }

        let mut warning = None;
        if let Some(disk) = &self.disk {
            match disk.get(&key) {
                Ok(Lookup::Hit(hit)) => {
                    let entry = MemoryEntry { cubin: hit.cubin.into(), compile_time: hit.compile_time };
                    memory.insert(key, entry.clone());
                    return Ok(done(&entry, Origin::Disk, None));
                }
                Ok(Lookup::Miss) => {}
                Ok(Lookup::Corrupt(why)) => {
                    warning =
                        Some(format!("corrupt cache entry {} ({why}); recompiled", disk.path_for(&key).display()));
                }
                Err(e) => {
                    warning = Some(cache_io_warning("read", &disk.path_for(&key), &e));
                }
            }
        }

        let include_dir = self.include_dir()?;
        let t0 = Instant::now();
        let cubin = compile_checked(kernel, arch, &options, include_dir)?;
        let compile_time = t0.elapsed();

        if let Some(disk) = &self.disk {
            if let Err(e) = disk.put(&key, &cubin, compile_time) {
                warning = Some(cache_io_warning("write", &disk.path_for(&key), &e));
            }
        }
        let entry = MemoryEntry { cubin: cubin.into(), compile_time };
        memory.insert(key, entry.clone());
        Ok(done(&entry, Origin::Compiled, warning))
    }

    /// Compile (or find) every kernel for `arch`. Per-kernel failures are in the report;
    /// only a missing NVRTC or an unsupported `arch`, which would fail every kernel, is an `Err`.
    pub fn precompile(&self, arch: Arch, kernels: &[KernelSource<'_>]) -> Result<PrecompileReport, KernelError> {
        let start = Instant::now();
        nvrtc_info()?.check_arch(arch)?;
        let entries = kernels
            .iter()
            .map(|k| PrecompileEntry { name: k.name.to_string(), result: self.get_or_compile(k, arch) })
            .collect();
        Ok(PrecompileReport {
            arch,
            cache_dir: self.disk.as_ref().map(|d| d.dir().to_path_buf()),
            kernels: entries,
            elapsed: start.elapsed(),
        })
    }
}

/// Said once per process on stderr as well as in the result: a cache that silently never works
/// costs seconds at every start and nobody would know why.
fn cache_io_warning(op: &str, path: &Path, e: &io::Error) -> String {
    static SAID: AtomicBool = AtomicBool::new(false);
    let msg = format!("kernel cache {op} failed at {}: {e}; compiling without it", path.display());
    if !SAID.swap(true, Ordering::Relaxed) {
        eprintln!("ferrograd: {msg}");
    }
    msg
}

/// The process-wide cache, configured from the environment on first use.
pub fn global() -> &'static KernelCache {
    static GLOBAL: OnceLock<KernelCache> = OnceLock::new();
    GLOBAL.get_or_init(KernelCache::from_env)
}

/// [`KernelCache::get_or_compile`] on the [`global`] cache.
pub fn get_or_compile(kernel: &KernelSource<'_>, arch: Arch) -> Result<CompiledKernel, KernelError> {
    global().get_or_compile(kernel, arch)
}

/// `ferrograd kernels --precompile`: every `(name, source)` with default options, on the
/// [`global`] cache.
pub fn precompile(arch: Arch, sources: &[(&str, &str)]) -> Result<PrecompileReport, KernelError> {
    let kernels: Vec<KernelSource<'_>> = sources.iter().map(|&(name, src)| KernelSource::new(name, src)).collect();
    global().precompile(arch, &kernels)
}

/// [`precompile`] for kernels that carry their own options.
pub fn precompile_kernels(arch: Arch, kernels: &[KernelSource<'_>]) -> Result<PrecompileReport, KernelError> {
    global().precompile(arch, kernels)
}

#[derive(Debug, Clone)]
pub struct PrecompileEntry {
    pub name: String,
    pub result: Result<CompiledKernel, KernelError>,
}

#[derive(Debug, Clone)]
pub struct PrecompileReport {
    pub arch: Arch,
    pub cache_dir: Option<PathBuf>,
    pub kernels: Vec<PrecompileEntry>,
    pub elapsed: Duration,
}

impl PrecompileReport {
    fn ok(&self) -> impl Iterator<Item = &CompiledKernel> {
        self.kernels.iter().filter_map(|e| e.result.as_ref().ok())
    }

    /// Kernels that needed no NVRTC run.
    pub fn hits(&self) -> usize {
        self.ok().filter(|k| k.from_cache).count()
    }

    /// Kernels compiled by this run.
    pub fn misses(&self) -> usize {
        self.ok().filter(|k| !k.from_cache).count()
    }

    pub fn failures(&self) -> usize {
        self.kernels.iter().filter(|e| e.result.is_err()).count()
    }

    pub fn is_ok(&self) -> bool {
        self.failures() == 0
    }

    /// NVRTC time the next start no longer spends on these kernels.
    pub fn compile_time_saved(&self) -> Duration {
        self.ok().map(|k| k.compile_time).sum()
    }
}

impl fmt::Display for PrecompileReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let dir = self.cache_dir.as_ref().map_or_else(|| "disabled".to_string(), |d| d.display().to_string());
        writeln!(f, "kernels for {} (cache: {dir})", self.arch)?;
        let width = self.kernels.iter().map(|e| e.name.len()).max().unwrap_or(0);
        for e in &self.kernels {
            match &e.result {
                Ok(k) => {
                    let what = match k.origin {
                        Origin::Compiled => "compiled",
                        Origin::Disk => "hit (disk)",
                        Origin::Memory => "hit (memory)",
                    };
                    write!(
                        f,
                        "  {:width$}  {what:12}  {:>9}  nvrtc {:>9}  {:>7} B",
                        e.name,
                        fmt_duration(k.elapsed),
                        fmt_duration(k.compile_time),
                        k.cubin.len(),
                    )?;
                    if let Some(w) = &k.cache_warning {
                        write!(f, "  ({w})")?;
                    }
                    writeln!(f)?;
                }
                Err(err) => writeln!(f, "  {:width$}  FAILED        {err}", e.name)?,
            }
        }
        write!(
            f,
            "{} hit, {} compiled, {} failed in {}; a start now skips {} of NVRTC",
            self.hits(),
            self.misses(),
            self.failures(),
            fmt_duration(self.elapsed),
            fmt_duration(self.compile_time_saved())
        )
    }
}

fn fmt_duration(d: Duration) -> String {
    let ms = d.as_secs_f64() * 1e3;
    if ms >= 1000.0 {
        format!("{:.2} s", ms / 1e3)
    } else {
        format!("{ms:.1} ms")
    }
}

// ---------------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------------

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    /// A unique scratch directory removed on drop; tests must not touch the user's cache.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(tag: &str) -> TempDir {
            static N: AtomicU64 = AtomicU64::new(0);
            let dir = std::env::temp_dir().join(format!(
                "ferrograd-kernels-{tag}-{}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            let _ = fs::remove_dir_all(&dir);
            fs::create_dir_all(&dir).expect("create temp dir");
            TempDir(dir)
        }

        fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    const V13: NvrtcVersion = NvrtcVersion { major: 13, minor: 0 };

    fn key(src: &str) -> CacheKey {
        CacheKey::new("k", src, &nvrtc_options(Arch::SM90, &CompileOptions::DEFAULT), V13, Arch::SM90)
    }

    fn fake_cubin() -> Vec<u8> {
        let mut v = b"\x7fELF fake cubin ".to_vec();
        v.extend((0..1000u32).map(|i| (i * 7 % 251) as u8));
        v
    }

    fn hit(cache: &DiskCache, k: &CacheKey) -> CachedCubin {
        match cache.get(k).expect("read cache") {
            Lookup::Hit(c) => c,
            other => panic!("expected a hit, got {other:?}"),
        }
    }

    fn corrupt_reason(cache: &DiskCache, k: &CacheKey) -> String {
        match cache.get(k).expect("read cache") {
            Lookup::Corrupt(why) => why,
            other => panic!("expected a corrupt entry, got {other:?}"),
        }
    }

    #[test]
    fn disk_cache_miss_then_hit() {
        let dir = TempDir::new("hit");
        let cache = DiskCache::new(dir.path().join("nested/kernels"));
        let k = key("a");
        assert_eq!(cache.get(&k).expect("read"), Lookup::Miss);
        let path = cache.put(&k, &fake_cubin(), Duration::from_millis(812)).expect("write");
        assert_eq!(path, cache.path_for(&k));
        assert_eq!(fs::metadata(&path).expect("stat").len() as usize, HEADER_LEN + fake_cubin().len());
        let got = hit(&cache, &k);
        assert_eq!(got.cubin, fake_cubin());
        assert_eq!(got.compile_time, Duration::from_millis(812));
        // No temp files left behind.
        let names: Vec<_> = fs::read_dir(cache.dir()).expect("ls").filter_map(Result::ok).collect();
        assert_eq!(names.len(), 1);
    }

    #[test]
    fn disk_cache_other_key_misses() {
        let dir = TempDir::new("otherkey");
        let cache = DiskCache::new(dir.path());
        cache.put(&key("a"), &fake_cubin(), Duration::ZERO).expect("write");
        assert_eq!(cache.get(&key("b")).expect("read"), Lookup::Miss);
    }

    #[test]
    fn disk_cache_entry_under_wrong_name_is_corrupt() {
        let dir = TempDir::new("wrongname");
        let cache = DiskCache::new(dir.path());
        let (a, b) = (key("a"), key("b"));
        cache.put(&a, &fake_cubin(), Duration::ZERO).expect("write");
        fs::copy(cache.path_for(&a), cache.path_for(&b)).expect("copy");
        assert!(corrupt_reason(&cache, &b).contains("holds key"));
    }

    #[test]
    fn disk_cache_flipped_payload_byte_is_corrupt_and_put_repairs_it() {
        let dir = TempDir::new("flip");
        let cache = DiskCache::new(dir.path());
        let k = key("a");
        let path = cache.put(&k, &fake_cubin(), Duration::ZERO).expect("write");
        let mut bytes = fs::read(&path).expect("read");
        bytes[HEADER_LEN + 100] ^= 0x01;
        fs::write(&path, &bytes).expect("write");
        assert!(corrupt_reason(&cache, &k).contains("checksum"));
        cache.put(&k, &fake_cubin(), Duration::ZERO).expect("overwrite");
        assert_eq!(hit(&cache, &k).cubin, fake_cubin());
    }

    #[test]
    fn disk_cache_flipped_header_bytes_are_corrupt() {
        let dir = TempDir::new("header");
        let cache = DiskCache::new(dir.path());
        let k = key("a");
        let path = cache.put(&k, &fake_cubin(), Duration::ZERO).expect("write");
        let clean = fs::read(&path).expect("read");
        for (offset, expect) in [
            (0, "magic"),
            (OFF_VERSION, "format version"),
            (OFF_KEY + 5, "holds key"),
            (OFF_PAYLOAD_LEN, "header says"),
            (OFF_PAYLOAD_SHA + 31, "checksum"),
        ] {
            let mut bytes = clean.clone();
            bytes[offset] ^= 0x40;
            fs::write(&path, &bytes).expect("write");
            let why = corrupt_reason(&cache, &k);
            assert!(why.contains(expect), "flip at {offset}: {why}");
        }
    }

    #[test]
    fn disk_cache_truncated_entries_are_corrupt() {
        let dir = TempDir::new("trunc");
        let cache = DiskCache::new(dir.path());
        let k = key("a");
        let path = cache.put(&k, &fake_cubin(), Duration::ZERO).expect("write");
        let full = fs::read(&path).expect("read");
        for len in [0, 7, HEADER_LEN - 1, HEADER_LEN, full.len() - 1] {
            fs::write(&path, &full[..len]).expect("truncate");
            let why = corrupt_reason(&cache, &k);
            assert!(why.contains("bytes"), "len {len}: {why}");
        }
        let mut longer = full.clone();
        longer.push(0);
        fs::write(&path, &longer).expect("extend");
        assert!(corrupt_reason(&cache, &k).contains("header says"));
    }

    #[test]
    fn disk_cache_empty_payload_round_trips() {
        let dir = TempDir::new("empty");
        let cache = DiskCache::new(dir.path());
        cache.put(&key("a"), &[], Duration::ZERO).expect("write");
        assert!(hit(&cache, &key("a")).cubin.is_empty());
    }

    #[test]
    fn disk_cache_unwritable_dir_is_an_error_not_a_panic() {
        let dir = TempDir::new("unwritable");
        // A regular file where the directory should be: create_dir_all fails for any user.
        let blocker = dir.path().join("file");
        fs::write(&blocker, b"x").expect("write");
        let cache = DiskCache::new(blocker.join("kernels"));
        assert!(cache.put(&key("a"), &fake_cubin(), Duration::ZERO).is_err());
        assert!(cache.get(&key("a")).is_err());
    }

    #[test]
    fn cache_key_depends_on_every_input() {
        let opts = nvrtc_options(Arch::SM90, &CompileOptions::DEFAULT);
        let base = CacheKey::new("k", "src", &opts, V13, Arch::SM90);
        assert_eq!(base, CacheKey::new("k", "src", &opts, V13, Arch::SM90));
        let fast = nvrtc_options(Arch::SM90, &CompileOptions::FAST_MATH);
        let others = [
            CacheKey::new("j", "src", &opts, V13, Arch::SM90),
            CacheKey::new("k", "src2", &opts, V13, Arch::SM90),
            CacheKey::new("k", "src", &fast, V13, Arch::SM90),
            CacheKey::new("k", "src", &opts, NvrtcVersion { major: 13, minor: 1 }, Arch::SM90),
            CacheKey::new("k", "src", &opts, V13, Arch::SM80),
            // Bytes moved across a field boundary.
            CacheKey::new("k", "sr", &["c".to_string()], V13, Arch::SM90),
        ];
        for other in others {
            assert_ne!(base, other);
        }
        assert_eq!(base.to_hex().len(), 64);
    }

    #[test]
    fn options_are_exact_and_fast_math_only_when_asked() {
        let o = nvrtc_options(Arch::SM80, &CompileOptions::DEFAULT);
        assert_eq!(o, ["--gpu-architecture=sm_80", "-std=c++17"]);
        let o = nvrtc_options(Arch::SM90.arch_specific(), &CompileOptions { fast_math: true, extra: &["-lineinfo"] });
        assert_eq!(o, ["--gpu-architecture=sm_90a", "-std=c++17", "--use_fast_math", "-lineinfo"]);
    }

    #[test]
    fn arch_parses_common_spellings() {
        for (s, want) in [
            ("sm_90", Arch::SM90),
            ("90", Arch::SM90),
            ("9.0", Arch::SM90),
            ("sm_80", Arch::SM80),
            ("sm_86", Arch::new(8, 6)),
            ("sm_100", Arch::new(10, 0)),
            ("120", Arch::new(12, 0)),
            ("sm_90a", Arch::SM90.arch_specific()),
        ] {
            assert_eq!(s.parse::<Arch>(), Ok(want), "{s}");
        }
        for s in ["", "sm_", "sm_9", "sm_x0", "9.10", "0.5", "sm_1000", "compute_90"] {
            assert!(s.parse::<Arch>().is_err(), "{s}");
        }
        assert_eq!(Arch::new(10, 0).to_string(), "sm_100");
        assert_eq!(Arch::new(10, 0).number(), 100);
        assert_eq!(Arch::from_compute_capability(9, 0), Ok(Arch::SM90));
        assert!(Arch::from_compute_capability(-1, 0).is_err());
    }

    fn env_of(vars: Vec<(&'static str, OsString)>) -> impl Fn(&str) -> Option<OsString> {
        move |k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone())
    }

    #[test]
    fn cache_dir_from_env() {
        let env = env_of(vec![(CACHE_DIR_ENV, "/x/y".into()), ("HOME", "/home/u".into())]);
        assert_eq!(default_cache_dir(&env), Some(PathBuf::from("/x/y")));
        let env = env_of(vec![("HOME", "/home/u".into())]);
        assert_eq!(default_cache_dir(&env), Some(PathBuf::from("/home/u/.cache/ferrograd/kernels")));
        let env = env_of(vec![(CACHE_DIR_ENV, "".into()), ("HOME", "/home/u".into())]);
        assert_eq!(default_cache_dir(&env), None);
        assert_eq!(default_cache_dir(&env_of(vec![])), None);
    }

    fn fake_include(root: &Path, headers: &[&str]) -> PathBuf {
        fs::create_dir_all(root).expect("mkdir");
        for h in headers {
            fs::write(root.join(h), b"// fake").expect("write header");
        }
        root.to_path_buf()
    }

    /// Only the candidates inside a test's temporary tree: a real toolkit in /usr/local/cuda (as
    /// on the GPU machines) must not decide what these tests see.
    fn under(c: Vec<PathBuf>, root: &Path) -> Vec<PathBuf> {
        c.into_iter().filter(|p| p.starts_with(root)).collect()
    }

    #[test]
    fn header_search_order_and_wheel_layout() {
        let dir = TempDir::new("headers");
        let venv = dir.path().join("venv");
        let wheel = venv.join("lib/python3.12/site-packages/nvidia/cu13/include");
        fake_include(&wheel, &REQUIRED_HEADERS);
        let user = fake_include(&dir.path().join("mine"), &REQUIRED_HEADERS);
        let half_only = fake_include(&dir.path().join("cuda/include"), &["cuda_fp16.h"]);

        let env = env_of(vec![("VIRTUAL_ENV", venv.clone().into())]);
        let c = include_candidates(&env, None);
        assert!(c.contains(&wheel), "{c:?}");
        assert_eq!(first_include_dir(under(c, dir.path())), Ok(wheel.clone()));

        // The user's choice wins; a dir lacking cuda_bf16.h does not count.
        let env = env_of(vec![
            (CUDA_INCLUDE_ENV, user.clone().into()),
            ("CUDA_HOME", dir.path().join("cuda").into()),
            ("VIRTUAL_ENV", venv.clone().into()),
        ]);
        let c = include_candidates(&env, None);
        assert_eq!(c[0], user);
        assert_eq!(c[1], half_only);
        assert_eq!(first_include_dir(c), Ok(user));
        let env = env_of(vec![("CUDA_HOME", dir.path().join("cuda").into()), ("VIRTUAL_ENV", venv.clone().into())]);
        assert_eq!(first_include_dir(under(include_candidates(&env, None), dir.path())), Ok(wheel.clone()));

        // Next to the loaded library.
        let lib = wheel.parent().expect("cu13").join("lib/libnvrtc.so.13");
        let c = include_candidates(&env_of(vec![]), Some(&lib));
        assert_eq!(c[0], wheel);
    }

    #[test]
    fn header_search_failure_names_every_place() {
        let dir = TempDir::new("noheaders");
        let venv = dir.path().join("venv");
        fs::create_dir_all(venv.join("lib/python3.11")).expect("mkdir");
        let env = env_of(vec![
            (CUDA_INCLUDE_ENV, dir.path().join("a").into()),
            ("CUDA_PATH", dir.path().join("b").into()),
            ("VIRTUAL_ENV", venv.clone().into()),
        ]);
        let all = include_candidates(&env, None);
        assert!(all.contains(&PathBuf::from("/usr/local/cuda/include")), "{all:?}");
        let candidates = under(all, dir.path());
        let err = first_include_dir(candidates.clone()).expect_err("no headers anywhere");
        let msg = err.to_string();
        for c in &candidates {
            assert!(msg.contains(&c.display().to_string()), "{msg} lacks {}", c.display());
        }
        assert!(msg.contains("venv/lib/python3.11/site-packages/nvidia/cu13/include"), "{msg}");
    }

    #[test]
    fn precompile_report_counts_and_prints() {
        let ok = |name: &str, origin: Origin, ms: u64| PrecompileEntry {
            name: name.to_string(),
            result: Ok(CompiledKernel {
                name: name.to_string(),
                arch: Arch::SM90,
                key: key(name),
                cubin: Arc::from(vec![0u8; 10]),
                from_cache: origin != Origin::Compiled,
                origin,
                compile_time: Duration::from_millis(ms),
                elapsed: Duration::from_millis(1),
                cache_warning: None,
            }),
        };
        let report = PrecompileReport {
            arch: Arch::SM90,
            cache_dir: None,
            kernels: vec![
                ok("unary", Origin::Compiled, 300),
                ok("binary", Origin::Disk, 200),
                PrecompileEntry {
                    name: "bad".to_string(),
                    result: Err(KernelError::InvalidInput { name: "bad".to_string(), what: "the source".to_string() }),
                },
            ],
            elapsed: Duration::from_millis(305),
        };
        assert_eq!((report.hits(), report.misses(), report.failures()), (1, 1, 1));
        assert!(!report.is_ok());
        assert_eq!(report.compile_time_saved(), Duration::from_millis(500));
        let text = report.to_string();
        assert!(text.contains("hit (disk)") && text.contains("FAILED") && text.contains("500.0 ms"), "{text}");
    }

    // -----------------------------------------------------------------------------------------
    // With NVRTC (skipped with one line where libnvrtc is not loadable)
    // -----------------------------------------------------------------------------------------

    const SAMPLE: &str = r#"
#include <cuda_fp16.h>
#include <cuda_bf16.h>

// CPU twin: out[i] = a[i] * s + b[i] in f32, rounded to the storage type.
extern "C" __global__ void axpy_f16(__half* out, const __half* a, const __half* b, float s, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = __float2half(__half2float(a[i]) * s + __half2float(b[i]));
}

extern "C" __global__ void axpy_bf16(__nv_bfloat16* out, const __nv_bfloat16* a,
                                     const __nv_bfloat16* b, float s, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = __float2bfloat16(__bfloat162float(a[i]) * s + __bfloat162float(b[i]));
}

// Warp-shuffle sum of bf16 pairs: exercises the __nv_bfloat162 intrinsics.
extern "C" __global__ void sum_bf16x2(float* out, const __nv_bfloat162* x, int n) {
    float acc = 0.f;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        float2 v = __bfloat1622float2(x[i]);
        acc += v.x + v.y;
    }
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, o);
    if ((threadIdx.x & 31) == 0) atomicAdd(out, acc);
}
"#;

    /// CI sets FERROGRAD_REQUIRE_NVRTC=1 so that a lost LD_LIBRARY_PATH fails the build instead
    /// of quietly turning the compile tests into skips.
    fn nvrtc_or_skip() -> bool {
        match nvrtc_info() {
            Ok(_) => true,
            Err(e @ KernelError::NvrtcMissing { .. }) => {
                if std::env::var_os("FERROGRAD_REQUIRE_NVRTC").is_some_and(|v| v == "1") {
                    panic!("FERROGRAD_REQUIRE_NVRTC=1 but {e}");
                }
                println!(
                    "skipping: libnvrtc not found (loader path; set LD_LIBRARY_PATH to the \
                     nvidia/cu13/lib of `pip install nvidia-cuda-nvrtc`)"
                );
                false
            }
            Err(e) => panic!("libnvrtc is present but unusable: {e}"),
        }
    }

    /// A CUDA ELF image (e_machine EM_CUDA = 190) built for `arch`. The SM number sits in
    /// e_flags: bits 0..8 up to ELF ABI version 7, bits 8..16 from version 8 (CUDA 12.8+),
    /// which NVRTC 13.0 writes (sm_90 -> e_flags 0x6005a04).
    fn assert_cubin_for(cubin: &[u8], arch: Arch) {
        assert!(cubin.len() > 64, "CUBIN of {} bytes", cubin.len());
        assert_eq!(&cubin[..4], b"\x7fELF", "not an ELF image");
        assert_eq!(u16::from_le_bytes([cubin[18], cubin[19]]), 190, "e_machine is not EM_CUDA");
        let flags = u32::from_le_bytes([cubin[48], cubin[49], cubin[50], cubin[51]]);
        let sm = if cubin[8] >= 8 { (flags >> 8) & 0xff } else { flags & 0xff };
        assert_eq!(sm, arch.number(), "e_flags {flags:#x} (ELF ABI {})", cubin[8]);
    }

    #[test]
    fn kernels_compile_for_sm80_and_sm90() {
        if !nvrtc_or_skip() {
            return;
        }
        let info = nvrtc_info().expect("checked above");
        println!("nvrtc {} from {:?}", info.version, info.library);
        let dir = TempDir::new("nvrtc");
        let cache = KernelCache::new(Some(DiskCache::new(dir.path())));
        let kernel = KernelSource::new("sample.cu", SAMPLE);
        let mut cubins = Vec::new();
        for arch in [Arch::SM80, Arch::SM90] {
            let first = cache.get_or_compile(&kernel, arch).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!((first.origin, first.from_cache), (Origin::Compiled, false));
            assert!(first.cache_warning.is_none(), "{:?}", first.cache_warning);
            assert_cubin_for(&first.cubin, arch);
            println!("{arch}: {} B CUBIN in {:?}", first.cubin.len(), first.compile_time);

            let again = cache.get_or_compile(&kernel, arch).expect("memory hit");
            assert_eq!((again.origin, again.from_cache), (Origin::Memory, true));
            assert_eq!(again.cubin, first.cubin);

            // A fresh process (fresh in-memory map) reads the disk entry.
            let fresh = KernelCache::new(Some(DiskCache::new(dir.path())));
            let disk = fresh.get_or_compile(&kernel, arch).expect("disk hit");
            assert_eq!((disk.origin, disk.from_cache), (Origin::Disk, true));
            assert_eq!(disk.cubin, first.cubin);
            assert_eq!(disk.compile_time.as_micros(), first.compile_time.as_micros());

            // A damaged entry is recompiled and rewritten.
            let path = DiskCache::new(dir.path()).path_for(&first.key);
            let mut bytes = fs::read(&path).expect("entry");
            let last = bytes.len() - 1;
            bytes[last] ^= 0xff;
            fs::write(&path, &bytes).expect("damage");
            let fresh = KernelCache::new(Some(DiskCache::new(dir.path())));
            let healed = fresh.get_or_compile(&kernel, arch).expect("recompile");
            assert_eq!(healed.origin, Origin::Compiled);
            assert!(healed.cache_warning.as_deref().is_some_and(|w| w.contains("checksum")));
            assert!(matches!(DiskCache::new(dir.path()).get(&first.key), Ok(Lookup::Hit(_))));
            cubins.push(first.cubin);
        }
        assert_ne!(cubins[0], cubins[1], "sm_80 and sm_90 gave the same CUBIN");
    }

    #[test]
    fn compile_error_carries_the_nvrtc_log() {
        if !nvrtc_or_skip() {
            return;
        }
        let cache = KernelCache::new(None);
        let bad = KernelSource::new("broken.cu", "extern \"C\" __global__ void k() { undeclared_x = 1; }");
        match cache.get_or_compile(&bad, Arch::SM90) {
            Err(KernelError::Compile { name, log, code, .. }) => {
                assert_eq!(name, "broken.cu");
                assert_eq!(code, "NVRTC_ERROR_COMPILATION");
                assert!(log.contains("undeclared_x"), "{log}");
            }
            other => panic!("expected a compile error, got {other:?}"),
        }
    }

    #[test]
    fn unsupported_arch_and_nul_source_are_typed_errors() {
        if !nvrtc_or_skip() {
            return;
        }
        let cache = KernelCache::new(None);
        let k = KernelSource::new("k.cu", "extern \"C\" __global__ void k() {}");
        assert!(matches!(cache.get_or_compile(&k, Arch::new(1, 0)), Err(KernelError::UnsupportedArch { .. })));
        let nul = KernelSource::new("nul.cu", "extern \"C\" __global__ void k() {}\0");
        assert!(matches!(cache.get_or_compile(&nul, Arch::SM90), Err(KernelError::InvalidInput { .. })));
    }

    #[test]
    fn unusable_cache_dir_still_compiles() {
        if !nvrtc_or_skip() {
            return;
        }
        let dir = TempDir::new("badcache");
        let blocker = dir.path().join("not-a-dir");
        fs::write(&blocker, b"x").expect("write");
        let cache = KernelCache::new(Some(DiskCache::new(blocker.join("kernels"))));
        let k = KernelSource::new("tiny.cu", "extern \"C\" __global__ void k(float* x) { x[0] = 2.f; }");
        let got = cache.get_or_compile(&k, Arch::SM80).expect("compiles without the cache");
        assert_eq!(got.origin, Origin::Compiled);
        assert_cubin_for(&got.cubin, Arch::SM80);
        let warning = got.cache_warning.expect("warns about the cache");
        assert!(warning.contains("kernel cache"), "{warning}");
    }

    #[test]
    fn precompile_hits_on_the_second_run() {
        if !nvrtc_or_skip() {
            return;
        }
        let dir = TempDir::new("precompile");
        let kernels = [
            KernelSource::new("tiny.cu", "extern \"C\" __global__ void k(float* x) { x[0] = 1.f; }"),
            KernelSource::new("broken.cu", "this is not CUDA"),
        ];
        let first =
            KernelCache::new(Some(DiskCache::new(dir.path()))).precompile(Arch::SM90, &kernels).expect("nvrtc present");
        println!("{first}");
        assert_eq!((first.hits(), first.misses(), first.failures()), (0, 1, 1));
        let second =
            KernelCache::new(Some(DiskCache::new(dir.path()))).precompile(Arch::SM90, &kernels).expect("nvrtc present");
        println!("{second}");
        assert_eq!((second.hits(), second.misses(), second.failures()), (1, 0, 1));
        assert!(second.compile_time_saved() > Duration::ZERO);
    }
}
