//! File bytes straight into device memory (checkpoints, token shards): through cuFile (GPUDirect
//! Storage) where `libcufile` loads, else through two pinned buffers, double-buffered: the host
//! reads chunk i+1 from the file while the DMA engine moves chunk i.
//!
//! cuFile is loaded at run time like cuDNN and NCCL (`FERROGRAD_CUFILE_LIBRARY` names another
//! library; `FERROGRAD_CUFILE=0` turns it off). Without the `nvidia-fs` kernel driver (as on the lent
//! GPU machines) cuFile could only run in its compatibility mode, POSIX reads through its own
//! bounce buffers, which is what the pinned path does; there it is not tried unless
//! `FERROGRAD_CUFILE=1` asks: on a lent H200 the attempt (`cuFileDriverOpen`, then a handle
//! registration the library refused with error 5027) cost 0.38 s of a 0.41 s load of a 0.5 GB
//! model (16.4 GB/s without it, 2026-11-23). [`ReadPath`] says which path ran, for the caller's
//! log line.
//!
//! [`read_tensors`] reads many tensors of one file (a safetensors checkpoint) in one pass: each
//! gets its own device allocation, and the file's byte ranges are streamed through the pinned
//! chunks in file order, every chunk's DMAs scattering its bytes into the tensors it overlaps
//! (so the peak is the tensors themselves plus two 8 MiB pinned chunks, not a second copy of the
//! file on the device, and odd offsets need no alignment). `ferrograd_nn::checkpoint::
//! load_safetensors` is the safetensors front end.

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
    /// Plain reads into host memory (a CPU destination: nothing to choose).
    Host,
}

impl std::fmt::Display for ReadPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReadPath::CuFile { compat: false } => write!(f, "cuFile (GPUDirect Storage)"),
            ReadPath::CuFile { compat: true } => write!(f, "cuFile (compatibility mode: no nvidia-fs)"),
            ReadPath::Pinned => write!(f, "pinned double-buffered reads"),
            ReadPath::Host => write!(f, "host reads"),
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
    let setting = std::env::var("FERROGRAD_CUFILE").unwrap_or_default();
    if setting == "0" {
        why_not("FERROGRAD_CUFILE=0".into());
        return None;
    }
    if setting != "1" && !nvidia_fs() {
        // Compatibility mode only: no faster than the pinned path, and slow to start (module doc).
        why_not("no nvidia-fs driver (FERROGRAD_CUFILE=1 tries cuFile's compatibility mode)".into());
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

/// One destination of a scattered read: `len` bytes at `offset` of the file go to device address
/// `dst`.
#[derive(Debug, Clone, Copy)]
struct Target {
    offset: u64,
    len: usize,
    dst: u64,
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
    read_scattered(dev, file, direct, &[Target { offset, len, dst: dst.ptr() }], allow_cufile)
}

/// The bytes of every target, read into device memory by one path; the host waits until they are
/// there. The destinations must be live device ranges of their lengths.
fn read_scattered(
    dev: &Arc<CudaDevice>,
    file: &File,
    direct: Option<&File>,
    targets: &[Target],
    allow_cufile: bool,
) -> Result<ReadPath> {
    super::sync::not_capturable("file read")?;
    dev.ctx.bind_to_thread().map_err(|e| driver_err("cuCtxSetCurrent", e))?;
    // The blocks may come from memory that queued compute still uses, and fresh blocks may still
    // be being poisoned on the compute stream: let that finish first (both paths write them from
    // outside the compute stream).
    super::sync::host_wait("cuStreamSynchronize", || {
        dev.stream().synchronize().map_err(|e| driver_err("cuStreamSynchronize", e))
    })?;
    let targets: Vec<Target> = targets.iter().copied().filter(|t| t.len > 0).collect();
    if targets.is_empty() {
        return Ok(ReadPath::Pinned);
    }
    if allow_cufile {
        if let Some(lib) = CUFILE.get_or_init(load_cufile) {
            match read_cufile(lib, direct.unwrap_or(file), &targets) {
                Ok(()) => {
                    *WHY_NOT.lock().unwrap_or_else(|e| e.into_inner()) = None;
                    return Ok(ReadPath::CuFile { compat: !nvidia_fs() });
                }
                Err(e) => why_not(e.to_string()),
            }
        }
    }
    read_pinned(dev, file, &targets)?;
    Ok(ReadPath::Pinned)
}

/// Every target through one registered handle (cuFile reads are synchronous: the bytes are on
/// the device when `cuFileRead` returns).
fn read_cufile(lib: &CuFileLib, file: &File, targets: &[Target]) -> Result<()> {
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
    let mut result = Ok(());
    'all: for t in targets {
        let mut done = 0usize;
        while done < t.len {
            // SAFETY: `t.dst` holds at least `t.len` bytes; the handle is registered.
            let n = unsafe {
                (lib.read)(
                    handle,
                    t.dst as usize as *mut c_void,
                    t.len - done,
                    (t.offset + done as u64) as i64,
                    done as i64,
                )
            };
            if n <= 0 {
                result = Err(Error::Cuda(format!(
                    "cuFileRead returned {n} at byte {done} of {} (file offset {})",
                    t.len, t.offset
                )));
                break 'all;
            }
            done += n as usize;
        }
    }
    // SAFETY: registered above, deregistered once.
    unsafe { (lib.deregister)(handle) };
    result
}

/// Chunk of a pinned read, and the piece each thread reads of it.
const CHUNK: usize = 8 << 20;
const PIECE: usize = 1 << 20;
/// Targets closer than this in the file are read as one run (the gap read and dropped): one
/// more request costs more than a megabyte from the page cache.
const GAP: u64 = 1 << 20;

/// Runs of the file to read: `(start, end, targets)`, targets in file order.
fn runs(targets: &[Target]) -> Vec<(u64, u64, Vec<Target>)> {
    let mut sorted = targets.to_vec();
    sorted.sort_by_key(|t| t.offset);
    let mut out: Vec<(u64, u64, Vec<Target>)> = Vec::new();
    for t in sorted {
        let end = t.offset + t.len as u64;
        match out.last_mut() {
            Some((_, e, ts)) if t.offset <= e.saturating_add(GAP) => {
                *e = (*e).max(end);
                ts.push(t);
            }
            _ => out.push((t.offset, end, vec![t])),
        }
    }
    out
}

fn read_pinned(dev: &Arc<CudaDevice>, file: &File, targets: &[Target]) -> Result<()> {
    let mut bufs = [PinnedBuf::new(dev, CHUNK)?, PinnedBuf::new(dev, CHUNK)?];
    let events = [Event::new()?, Event::new()?];
    let mut used = [false, false];
    let mut k = 0usize;
    let mut stream_all = || -> Result<()> {
        for (start, end, ts) in runs(targets) {
            // Targets before `first` are complete (they end at or before the chunk read now).
            let mut first = 0;
            let mut at = start;
            while at < end {
                let (b, n) = (k % 2, (CHUNK as u64).min(end - at) as usize);
                if used[b] {
                    events[b].synchronize()?;
                }
                // One thread's `pread` from the page cache runs at about 7 GB/s, a few times
                // below the link: read the chunk's pieces on all cores.
                bufs[b]
                    .as_mut_slice(n)
                    .par_chunks_mut(PIECE)
                    .enumerate()
                    .try_for_each(|(j, piece)| file.read_exact_at(piece, at + (j * PIECE) as u64))?;
                let chunk_end = at + n as u64;
                while first < ts.len() && ts[first].offset + ts[first].len as u64 <= at {
                    first += 1;
                }
                for t in ts[first..].iter().take_while(|t| t.offset < chunk_end) {
                    let (lo, hi) = (t.offset.max(at), (t.offset + t.len as u64).min(chunk_end));
                    if lo < hi {
                        // SAFETY: the pinned chunk holds `n` bytes covering [lo, hi), not touched
                        // again before its event; `t.dst` holds `t.len` bytes.
                        unsafe {
                            super::transfer::dma_htod(
                                dev,
                                t.dst + (lo - t.offset),
                                bufs[b].as_ptr().add((lo - at) as usize),
                                (hi - lo) as usize,
                            )?
                        };
                    }
                }
                events[b].record(dev.copy_stream())?;
                used[b] = true;
                k += 1;
                at = chunk_end;
            }
        }
        Ok(())
    };
    let result = stream_all();
    // Also on an error: the DMAs already queued read the pinned chunks (which go back to the
    // pool on return) and write the destinations (which the caller may free).
    for (e, u) in events.iter().zip(used) {
        if u {
            e.synchronize()?;
        }
    }
    result
}

/// One tensor to read from a file: `shape` elements of `dtype`, little-endian, at `offset`.
#[derive(Debug, Clone)]
pub struct FileTensor {
    /// Byte offset in the file.
    pub offset: u64,
    /// The tensor's shape.
    pub shape: crate::Shape,
    /// The tensor's dtype.
    pub dtype: crate::DType,
}

/// The tensors `spans` of `path` on GPU `device`, each in its own allocation, read in one pass
/// (see the module documentation), and the path the bytes took. Every span is checked against
/// the file's length before anything is allocated.
pub fn read_tensors(
    path: &std::path::Path,
    spans: &[FileTensor],
    device: usize,
    allow_cufile: bool,
) -> Result<(Vec<crate::Tensor>, ReadPath)> {
    let dev = CudaDevice::get(device)?;
    let file_err = |msg: String| Error::File { path: path.display().to_string(), msg };
    let file = File::open(path).map_err(|e| file_err(e.to_string()))?;
    let size = file.metadata().map_err(|e| file_err(e.to_string()))?.len();
    let mut lens = Vec::with_capacity(spans.len());
    for s in spans {
        let elems = s.shape.checked_elem_count("read_tensors")?;
        let len = elems.checked_mul(s.dtype.size_in_bytes()).ok_or_else(|| {
            Error::InvalidArgument(format!("{:?} of {} overflows the address space", s.shape, s.dtype))
        })?;
        if s.offset.checked_add(len as u64).is_none_or(|end| end > size) {
            return Err(file_err(format!(
                "{len} bytes at offset {} reach past the end of the file ({size} bytes)",
                s.offset
            )));
        }
        lens.push(len);
    }
    let storages = spans
        .iter()
        .zip(&lens)
        .map(|(s, &len)| super::CudaStorage::uninit(&dev, len / s.dtype.size_in_bytes(), s.dtype))
        .collect::<Result<Vec<_>>>()?;
    let targets: Vec<Target> = spans
        .iter()
        .zip(&lens)
        .zip(&storages)
        .map(|((s, &len), st)| Target { offset: s.offset, len, dst: st.buf.ptr() })
        .collect();
    let direct = allow_cufile
        .then(|| std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(path).ok())
        .flatten();
    let how = read_scattered(&dev, &file, direct.as_ref(), &targets, allow_cufile)?;
    let tensors = storages
        .into_iter()
        .zip(spans)
        .map(|(st, s)| crate::Tensor::from_storage(crate::storage::Storage::Cuda(st), s.shape.clone(), None))
        .collect();
    Ok((tensors, how))
}

/// A tensor of `shape` and `dtype` on GPU `device`, its bytes read from `path` at `offset`
/// (a token shard, a raw payload), and the path the bytes took: [`read_tensors`] of one.
pub fn read_tensor(
    path: &std::path::Path,
    offset: u64,
    shape: impl Into<crate::Shape>,
    dtype: crate::DType,
    device: usize,
    allow_cufile: bool,
) -> Result<(crate::Tensor, ReadPath)> {
    let span = FileTensor { offset, shape: shape.into(), dtype };
    let (mut ts, how) = read_tensors(path, std::slice::from_ref(&span), device, allow_cufile)?;
    let t = ts.pop().ok_or_else(|| Error::InvalidArgument("read_tensors returned no tensor".into()))?;
    Ok((t, how))
}
