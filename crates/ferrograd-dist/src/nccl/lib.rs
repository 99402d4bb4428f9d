//! Finding and loading libnccl at run time, like every CUDA library ferrograd uses.
//!
//! cudarc's own loader (`cudarc::nccl::sys::culib`) tries `libnccl.so` and `libnccl.so.N` for N
//! in {CUDA major, 12, 11, 10, 9, 1}, and panics when none loads. NCCL installs `libnccl.so.2`
//! (the unversioned link comes only with the -dev package) and PyTorch's wheel `nvidia-nccl-cu*`
//! ships only `site-packages/nvidia/nccl/lib/libnccl.so.2`. Loading that file first does not help:
//! the dynamic linker matches an already loaded library by the exact name asked for or its soname
//! (`libnccl.so.2`), never by `libnccl.so`, and LD_LIBRARY_PATH is read once at process start. So
//! this module loads NCCL itself from a list of candidates (below) and binds the few functions
//! ferrograd calls, with cudarc's NCCL types. A miss is a typed error listing every place tried.
//!
//! Candidates, in order: `$FERROGRAD_NCCL_LIBRARY` (alone, when set); `libnccl.so.2` and
//! `libnccl.so` through the linker's search (LD_LIBRARY_PATH, ld.so.cache, /lib, /usr/lib);
//! `nvidia/nccl/lib/libnccl.so.2` under the site-packages of `$VIRTUAL_ENV`, `$CONDA_PREFIX`, every
//! `python3` on PATH and the usual system folders; CUDA and distribution library folders.

use crate::error::{DistError, DistResult};
use cudarc::nccl::sys::{cudaStream_t, ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclUniqueId};
use libloading::Library;
use std::ffi::{c_char, c_int, c_void};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

type GetVersion = unsafe extern "C" fn(*mut c_int) -> c_int;
type GetUniqueId = unsafe extern "C" fn(*mut ncclUniqueId) -> c_int;
type CommInitRank = unsafe extern "C" fn(*mut ncclComm_t, c_int, ncclUniqueId, c_int) -> c_int;
type CommFree = unsafe extern "C" fn(ncclComm_t) -> c_int;
type CommGetAsyncError = unsafe extern "C" fn(ncclComm_t, *mut c_int) -> c_int;
type AllReduce = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    ncclDataType_t,
    ncclRedOp_t,
    ncclComm_t,
    cudaStream_t,
) -> c_int;
type ReduceScatter = AllReduce;
type AllGather =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, ncclDataType_t, ncclComm_t, cudaStream_t) -> c_int;
type Broadcast =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, ncclDataType_t, c_int, ncclComm_t, cudaStream_t) -> c_int;
type Send = unsafe extern "C" fn(*const c_void, usize, ncclDataType_t, c_int, ncclComm_t, cudaStream_t) -> c_int;
type Recv = unsafe extern "C" fn(*mut c_void, usize, ncclDataType_t, c_int, ncclComm_t, cudaStream_t) -> c_int;
type Group = unsafe extern "C" fn() -> c_int;
type ErrorString = unsafe extern "C" fn(c_int) -> *const c_char;

/// The loaded library and the functions ferrograd calls.
pub struct NcclLib {
    pub path: String,
    /// NCCL_VERSION_CODE: major * 10000 + minor * 100 + patch.
    pub version: i32,
    pub(crate) get_unique_id: GetUniqueId,
    pub(crate) comm_init_rank: CommInitRank,
    pub(crate) comm_abort: CommFree,
    pub(crate) comm_get_async_error: CommGetAsyncError,
    pub(crate) all_reduce: AllReduce,
    pub(crate) reduce_scatter: ReduceScatter,
    pub(crate) all_gather: AllGather,
    pub(crate) broadcast: Broadcast,
    pub(crate) send: Send,
    pub(crate) recv: Recv,
    pub(crate) group_start: Group,
    pub(crate) group_end: Group,
    error_string: ErrorString,
    // Declared last: the function pointers above point into it.
    _lib: Library,
}

impl std::fmt::Debug for NcclLib {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NCCL {} ({})", self.version_string(), self.path)
    }
}

/// The oldest NCCL with `ncclAvg`.
const MIN_VERSION: i32 = 21000;

impl NcclLib {
    pub fn version_string(&self) -> String {
        let v = self.version;
        format!("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100)
    }

    /// NCCL's text for a result code.
    pub fn error_text(&self, code: c_int) -> String {
        // SAFETY: ncclGetErrorString returns a static NUL-terminated string for any code.
        let p = unsafe { (self.error_string)(code) };
        if p.is_null() {
            return format!("error {code}");
        }
        // SAFETY: non-null, NUL-terminated, static.
        unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    /// `Ok` for ncclSuccess (0) and ncclInProgress (7), else a typed error naming `op`.
    pub fn check(&self, op: &'static str, code: c_int) -> DistResult<()> {
        match code {
            0 | 7 => Ok(()),
            c => Err(DistError::Nccl { op, code: c, msg: self.error_text(c) }),
        }
    }
}

static NCCL: OnceLock<Result<NcclLib, Vec<String>>> = OnceLock::new();

/// NCCL, loaded on first use.
pub fn nccl() -> DistResult<&'static NcclLib> {
    match NCCL.get_or_init(load) {
        Ok(lib) if lib.version < MIN_VERSION => {
            Err(DistError::NcclTooOld { path: lib.path.clone(), found: lib.version_string() })
        }
        Ok(lib) => Ok(lib),
        Err(searched) => Err(DistError::NcclNotFound { searched: searched.clone() }),
    }
}

/// Whether NCCL can be loaded here (for tests that skip without it).
pub fn available() -> bool {
    nccl().is_ok()
}

fn python_lib_dirs(prefix: &Path) -> Vec<PathBuf> {
    let lib = prefix.join("lib");
    let Ok(rd) = std::fs::read_dir(&lib) else { return vec![] };
    let mut out: Vec<PathBuf> = rd
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
        .flat_map(|e| [e.path().join("site-packages"), e.path().join("dist-packages")])
        .collect();
    out.sort();
    out
}

/// Every place NCCL is looked for, in order.
pub fn candidates() -> Vec<String> {
    if let Ok(p) = std::env::var("FERROGRAD_NCCL_LIBRARY") {
        return vec![p];
    }
    let mut out: Vec<String> = vec!["libnccl.so.2".into(), "libnccl.so".into()];
    let mut prefixes: Vec<PathBuf> = vec![];
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(p) = std::env::var_os(var) {
            prefixes.push(PathBuf::from(&p));
            out.push(PathBuf::from(p).join("lib/libnccl.so.2").display().to_string());
        }
    }
    // The Python on PATH (a venv's bin/python3 lives in <prefix>/bin).
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            if dir.join("python3").exists() {
                if let Some(prefix) = dir.parent() {
                    prefixes.push(prefix.to_path_buf());
                }
            }
        }
    }
    prefixes.extend(["/usr/local", "/usr", "/opt/conda"].map(PathBuf::from));
    if let Some(home) = std::env::var_os("HOME") {
        prefixes.push(PathBuf::from(home).join(".local"));
    }
    let mut sites: Vec<PathBuf> = prefixes.iter().flat_map(|p| python_lib_dirs(p)).collect();
    sites.push(PathBuf::from("/usr/lib/python3/dist-packages"));
    for s in sites {
        let c = s.join("nvidia/nccl/lib/libnccl.so.2").display().to_string();
        if !out.contains(&c) {
            out.push(c);
        }
    }
    for dir in
        ["/usr/local/cuda/lib64", "/usr/local/nccl/lib", "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu"]
    {
        out.push(format!("{dir}/libnccl.so.2"));
    }
    out
}

fn load() -> Result<NcclLib, Vec<String>> {
    let mut searched = vec![];
    for c in candidates() {
        // Absolute candidates that do not exist are listed without trying them.
        if c.starts_with('/') && !Path::new(&c).exists() {
            searched.push(format!("{c} (absent)"));
            continue;
        }
        // SAFETY: loading NCCL runs its initialisers, which have no preconditions.
        match unsafe { Library::new(&c) } {
            Ok(lib) => match bind(lib, &c) {
                Ok(n) => return Ok(n),
                Err(e) => searched.push(format!("{c} ({e})")),
            },
            Err(e) => searched.push(format!("{c} ({})", short(&e.to_string()))),
        }
    }
    Err(searched)
}

fn short(s: &str) -> String {
    // dlopen's message repeats the name; keep the reason.
    s.rsplit(": ").next().unwrap_or(s).to_string()
}

fn bind(lib: Library, path: &str) -> Result<NcclLib, String> {
    /// Copy one symbol's address out of the library.
    unsafe fn sym<T: Copy>(lib: &Library, name: &str) -> Result<T, String> {
        // SAFETY (caller): `T` is the symbol's true type.
        unsafe { lib.get::<T>(name.as_bytes()) }.map(|s| *s).map_err(|e| format!("missing {name}: {e}"))
    }
    // SAFETY: each type alias above is the C prototype from nccl.h for that name.
    unsafe {
        let get_version: GetVersion = sym(&lib, "ncclGetVersion")?;
        let mut version = 0;
        if get_version(&mut version) != 0 {
            return Err("ncclGetVersion failed".into());
        }
        Ok(NcclLib {
            path: path.to_string(),
            version,
            get_unique_id: sym(&lib, "ncclGetUniqueId")?,
            comm_init_rank: sym(&lib, "ncclCommInitRank")?,
            comm_abort: sym(&lib, "ncclCommAbort")?,
            comm_get_async_error: sym(&lib, "ncclCommGetAsyncError")?,
            all_reduce: sym(&lib, "ncclAllReduce")?,
            reduce_scatter: sym(&lib, "ncclReduceScatter")?,
            all_gather: sym(&lib, "ncclAllGather")?,
            broadcast: sym(&lib, "ncclBroadcast")?,
            send: sym(&lib, "ncclSend")?,
            recv: sym(&lib, "ncclRecv")?,
            group_start: sym(&lib, "ncclGroupStart")?,
            group_end: sym(&lib, "ncclGroupEnd")?,
            error_string: sym(&lib, "ncclGetErrorString")?,
            _lib: lib,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidates_start_with_the_versioned_name_and_cover_pytorch_wheels() {
        if std::env::var_os("FERROGRAD_NCCL_LIBRARY").is_some() {
            return;
        }
        let c = candidates();
        assert_eq!(&c[..2], ["libnccl.so.2", "libnccl.so"]);
        assert!(c.iter().all(|p| !p.is_empty()));
        assert!(c.iter().any(|p| p.ends_with("nvidia/nccl/lib/libnccl.so.2")), "{c:?}");
    }

    #[test]
    fn a_missing_library_is_an_error_listing_what_was_searched() {
        if let Err(e) = nccl() {
            let msg = e.to_string();
            assert!(msg.contains("libnccl.so.2") && msg.contains("FERROGRAD_NCCL_LIBRARY"), "{msg}");
        }
    }
}
