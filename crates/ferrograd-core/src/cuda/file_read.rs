//! File bytes straight into device memory (checkpoints, token shards): through cuFile (GPUDirect
//! Storage) where `libcufile` loads, else through two pinned buffers, double-buffered: the host
//! reads chunk i+1 from the file while the DMA engine moves chunk i.
//!
//! cuFile is loaded at run time like cuDNN and NCCL (`FERROGRAD_CUFILE_LIBRARY` names another
//! library; `FERROGRAD_CUFILE=0` turns it off). Without the `nvidia-fs` kernel driver (as on the lent
//! GPU machines) cuFile runs in its compatibility mode, POSIX reads through its own bounce buffers;
//! [`ReadPath`] says which path ran, for the caller's log line.

use super::buffer::CudaBuffer;
use super::device::{driver_err, CudaDevice};
use super::event::Event;
use super::pinned::PinnedBuf;
use crate::{Error, Result};
use libloading::Library;
use rayon::prelude::*;
use std::ffi::{c_int, c_void};
use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::sync::{Arc, OnceLock};

/// Which way the bytes went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadPath {
    /// cuFile; `compat` when `nvidia-fs` is absent and cuFile fell back to POSIX reads itself.
    CuFile {
        /// Compatibility mode (no `nvidia-fs`).
        compat: bool,
    },
    /// Two pinned buffers, double-buffered.
    Pinned,
}

impl std::fmt::Display for ReadPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReadPath::CuFile { compat: false } => write!(f, "cuFile (GPUDirect Storage)"),
            ReadPath::CuFile { compat: true } => write!(f, "cuFile (compatibility mode: no nvidia-fs)"),
            ReadPath::Pinned => write!(f, "pinned double-buffered reads"),
        }
    }
}

/// `CUfileError_t`: the cuFile status and, for CUDA errors, the driver's.
#[repr(C)]
#[derive(Clone, Copy)]
struct CuFileError {
    err: c_int,
    cu_err: c_int,
}

/// `CUfileDescr_t` (cufile.h): the handle type, a union of a file descriptor and a Windows
/// handle, and optional user file-system operations.
#[repr(C)]
struct CuFileDescr {
    kind: c_int,
    handle: *mut c_void,
    fs_ops: *const c_void,
}

/// `CU_FILE_HANDLE_TYPE_OPAQUE_FD`.
const HANDLE_TYPE_FD: c_int = 1;

type DriverOpen = unsafe extern "C" fn() -> CuFileError;
type HandleRegister = unsafe extern "C" fn(*mut *mut c_void, *mut CuFileDescr) -> CuFileError;
type HandleDeregister = unsafe extern "C" fn(*mut c_void);
type Read = unsafe extern "C" fn(*mut c_void, *mut c_void, usize, i64, i64) -> isize;

struct CuFileLib {
    _lib: Library,
    register: HandleRegister,
    deregister: HandleDeregister,
    read: Read,
}

static CUFILE: OnceLock<Option<CuFileLib>> = OnceLock::new();
/// Why the last read did not go through cuFile (`None` once it did).
static WHY_NOT: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);

fn why_not(reason: String) {
    *WHY_NOT.lock().unwrap_or_else(|e| e.into_inner()) = Some(reason);
}

/// `Ok` when the last read went through cuFile (or none was tried), else why it did not: the
/// library missing, `cuFileDriverOpen` or a handle refused, a read that failed.
pub fn cufile_status() -> std::result::Result<(), String> {
    match WHY_NOT.lock().unwrap_or_else(|e| e.into_inner()).clone() {
        Some(w) => Err(w),
        None => Ok(()),
    }
}

fn load_cufile() -> Option<CuFileLib> {
    if std::env::var("FERROGRAD_CUFILE").is_ok_and(|v| v == "0") {
        why_not("FERROGRAD_CUFILE=0".into());
        return None;
    }
    let names = match std::env::var("FERROGRAD_CUFILE_LIBRARY") {
        Ok(p) => vec![p],
        Err(_) => vec!["libcufile.so.0".to_string(), "libcufile.so".to_string()],
    };
    for n in names {
        // SAFETY: loading libcufile runs its initialisers, which have no preconditions.
        let Ok(lib) = (unsafe { Library::new(&n) }) else { continue };
        // SAFETY: the prototypes are those of cufile.h for these names.
        let l = unsafe {
            let open = lib.get::<DriverOpen>(b"cuFileDriverOpen").map(|s| *s);
            let reg = lib.get::<HandleRegister>(b"cuFileHandleRegister").map(|s| *s);
            let dereg = lib.get::<HandleDeregister>(b"cuFileHandleDeregister").map(|s| *s);
            let read = lib.get::<Read>(b"cuFileRead").map(|s| *s);
            match (open, reg, dereg, read) {
                (Ok(open), Ok(register), Ok(deregister), Ok(read)) => {
                    let e = open();
                    if e.err != 0 {
                        why_not(format!("{n}: cuFileDriverOpen failed: error {} (CUDA {})", e.err, e.cu_err));
                        continue;
                    }
                    CuFileLib { _lib: lib, register, deregister, read }
                }
                _ => {
                    why_not(format!("{n}: a cuFile symbol is missing"));
                    continue;
                }
            }
        };
        return Some(l);
    }
    if cufile_status().is_ok() {
        why_not("libcufile.so.0 not found".into());
    }
    None
}

/// Whether the `nvidia-fs` driver (true GPUDirect Storage) is loaded.
fn nvidia_fs() -> bool {
    std::path::Path::new("/proc/driver/nvidia-fs").exists()
}

/// Reads `len` bytes of `file` at `offset` into the start of `dst`; returns the path taken. With
/// `allow_cufile` false the pinned path runs (tests compare both). `direct`, the same file opened
/// with `O_DIRECT` where the file system allows it, is what cuFile reads (GPUDirect needs it). The
/// host waits until the bytes are on the device.
pub fn read_to_device(
    dev: &Arc<CudaDevice>,
    file: &File,
    direct: Option<&File>,
    offset: u64,
    len: usize,
    dst: &CudaBuffer,
    allow_cufile: bool,
) -> Result<ReadPath> {
    if len > dst.bytes() {
        return Err(Error::InvalidArgument(format!("read of {len} bytes into a buffer of {}", dst.bytes())));
    }
    super::sync::not_capturable("file read")?;
    dev.ctx.bind_to_thread().map_err(|e| driver_err("cuCtxSetCurrent", e))?;
    // The block may come from memory that queued compute still uses: let that finish first (both
    // paths write it from outside the compute stream).
    super::sync::host_wait("cuStreamSynchronize", || {
        dev.stream().synchronize().map_err(|e| driver_err("cuStreamSynchronize", e))
    })?;
    if len == 0 {
        return Ok(ReadPath::Pinned);
    }
    if allow_cufile {
        if let Some(lib) = CUFILE.get_or_init(load_cufile) {
            match read_cufile(lib, direct.unwrap_or(file), offset, len, dst) {
                Ok(()) => {
                    *WHY_NOT.lock().unwrap_or_else(|e| e.into_inner()) = None;
                    return Ok(ReadPath::CuFile { compat: !nvidia_fs() });
                }
                Err(e) => why_not(e.to_string()),
            }
        }
    }
    read_pinned(dev, file, offset, len, dst)?;
    Ok(ReadPath::Pinned)
}

fn read_cufile(lib: &CuFileLib, file: &File, offset: u64, len: usize, dst: &CudaBuffer) -> Result<()> {
    let mut descr = CuFileDescr {
        kind: HANDLE_TYPE_FD,
        handle: file.as_raw_fd() as isize as *mut c_void,
        fs_ops: std::ptr::null(),
    };
    let mut handle: *mut c_void = std::ptr::null_mut();
    // SAFETY: `descr` names an open file descriptor that outlives the handle.
    let e = unsafe { (lib.register)(&mut handle, &mut descr) };
    if e.err != 0 {
        return Err(Error::Cuda(format!("cuFileHandleRegister: error {} (CUDA {})", e.err, e.cu_err)));
    }
    let mut done = 0usize;
    let mut result = Ok(());
    while done < len {
        // SAFETY: `dst` holds at least `len` bytes; the handle is registered.
        let n = unsafe {
            (lib.read)(
                handle,
                dst.ptr() as usize as *mut c_void,
                len - done,
                (offset + done as u64) as i64,
                done as i64,
            )
        };
        if n <= 0 {
            result = Err(Error::Cuda(format!("cuFileRead returned {n} at byte {done} of {len}")));
            break;
        }
        done += n as usize;
    }
    // SAFETY: registered above, deregistered once.
    unsafe { (lib.deregister)(handle) };
    result
}

/// Chunk of a pinned read, and the piece each thread reads of it.
const CHUNK: usize = 8 << 20;
const PIECE: usize = 1 << 20;

fn read_pinned(dev: &Arc<CudaDevice>, file: &File, offset: u64, len: usize, dst: &CudaBuffer) -> Result<()> {
    let mut bufs = [PinnedBuf::new(dev, CHUNK)?, PinnedBuf::new(dev, CHUNK)?];
    let events = [Event::new()?, Event::new()?];
    let mut used = [false, false];
    let s = dev.copy_stream();
    for i in 0..len.div_ceil(CHUNK) {
        let (b, n) = (i % 2, CHUNK.min(len - i * CHUNK));
        if used[b] {
            events[b].synchronize()?;
        }
        // One thread's `pread` from the page cache runs at about 7 GB/s, a few times below the
        // link: read the chunk's pieces on all cores.
        let at = offset + (i * CHUNK) as u64;
        bufs[b]
            .as_mut_slice(n)
            .par_chunks_mut(PIECE)
            .enumerate()
            .try_for_each(|(j, piece)| file.read_exact_at(piece, at + (j * PIECE) as u64))?;
        // SAFETY: the pinned chunk holds `n` bytes and is not touched again before its event.
        unsafe {
            cudarc::driver::sys::cuMemcpyHtoDAsync_v2(
                dst.ptr() + (i * CHUNK) as u64,
                bufs[b].as_ptr() as *const _,
                n,
                s.cu_stream(),
            )
        }
        .result()
        .map_err(|e| driver_err("cuMemcpyHtoDAsync", e))?;
        events[b].record(s)?;
        used[b] = true;
    }
    for (e, u) in events.iter().zip(used) {
        if u {
            e.synchronize()?;
        }
    }
    Ok(())
}

/// A tensor of `shape` and `dtype` on GPU `device`, its bytes read from `path` at `offset`
/// (a safetensors payload, a token shard), and the path the bytes took.
pub fn read_tensor(
    path: &std::path::Path,
    offset: u64,
    shape: impl Into<crate::Shape>,
    dtype: crate::DType,
    device: usize,
    allow_cufile: bool,
) -> Result<(crate::Tensor, ReadPath)> {
    let shape = shape.into();
    let dev = CudaDevice::get(device)?;
    let len = shape
        .elem_count()
        .checked_mul(dtype.size_in_bytes())
        .ok_or_else(|| Error::InvalidArgument(format!("{shape:?} of {dtype} overflows the address space")))?;
    let file_err = |msg: String| Error::File { path: path.display().to_string(), msg };
    let file = File::open(path).map_err(|e| file_err(e.to_string()))?;
    let size = file.metadata().map_err(|e| file_err(e.to_string()))?.len();
    if offset.checked_add(len as u64).is_none_or(|end| end > size) {
        return Err(file_err(format!("{len} bytes at offset {offset} reach past the end of the file ({size} bytes)")));
    }
    let s = super::CudaStorage::uninit(&dev, shape.elem_count(), dtype)?;
    let direct = allow_cufile
        .then(|| std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(path).ok())
        .flatten();
    let how = read_to_device(&dev, &file, direct.as_ref(), offset, len, &s.buf, allow_cufile)?;
    Ok((crate::Tensor::from_storage(crate::storage::Storage::Cuda(s), shape, None), how))
}
