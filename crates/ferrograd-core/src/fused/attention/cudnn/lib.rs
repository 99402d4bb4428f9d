//! Finding and loading libcudnn (9.x) at run time, and the few functions the attention path calls.
//!
//! cudarc's `cudnn::sys` gives the header's enums (attribute names, descriptor types, data
//! types), which this path uses as constants. Its functions are not used: each looks its symbol
//! up on every call and panics when one is missing, and they return `cudnnStatus_t` as a Rust
//! enum, which a status code the enum does not list (cuDNN 9 has sub-codes such as 2002 or 3007)
//! would make undefined behaviour. So this file loads the library itself, binds the functions once
//! with the C prototypes of `cudnn_graph.h` (status as a plain integer), and turns every status
//! into a typed [`Error::Cudnn`] carrying cuDNN's own message.
//!
//! Candidates, in order: `$FERROGRAD_CUDNN_LIBRARY` (alone, when set); `libcudnn.so.9` and
//! `libcudnn.so` through the linker's search (LD_LIBRARY_PATH, ld.so.cache). A library older than
//! 9.0 is refused (the backend graph API for attention needs 9).

use crate::Error;
use cudarc::cudnn::sys::{
    cudnnBackendAttributeName_t as Attr, cudnnBackendAttributeType_t as AttrType,
    cudnnBackendDescriptorType_t as DescType,
};
use libloading::Library;
use std::ffi::{c_char, c_void};
use std::sync::OnceLock;

pub(super) type Handle = *mut c_void;
pub(super) type Descriptor = *mut c_void;

type Status = i32;
type CreateDescriptor = unsafe extern "C" fn(u32, *mut Descriptor) -> Status;
type DestroyDescriptor = unsafe extern "C" fn(Descriptor) -> Status;
type Finalize = unsafe extern "C" fn(Descriptor) -> Status;
type SetAttribute = unsafe extern "C" fn(Descriptor, u32, u32, i64, *const c_void) -> Status;
type GetAttribute = unsafe extern "C" fn(Descriptor, u32, u32, i64, *mut i64, *mut c_void) -> Status;
type Execute = unsafe extern "C" fn(Handle, Descriptor, Descriptor) -> Status;
type Create = unsafe extern "C" fn(*mut Handle) -> Status;
type Destroy = unsafe extern "C" fn(Handle) -> Status;
type SetStream = unsafe extern "C" fn(Handle, *mut c_void) -> Status;
type GetErrorString = unsafe extern "C" fn(Status) -> *const c_char;
type GetLastErrorString = unsafe extern "C" fn(*mut c_char, usize);
type GetVersion = unsafe extern "C" fn() -> usize;

/// The loaded library and the functions the attention path calls.
pub struct CudnnLib {
    /// The file it was loaded from.
    pub path: String,
    /// `CUDNN_VERSION`: major * 10000 + minor * 100 + patch (9.14.0 is 91400).
    pub version: usize,
    create_descriptor: CreateDescriptor,
    destroy_descriptor: DestroyDescriptor,
    finalize: Finalize,
    set_attribute: SetAttribute,
    get_attribute: GetAttribute,
    execute: Execute,
    create: Create,
    destroy: Destroy,
    set_stream: SetStream,
    error_string: GetErrorString,
    last_error_string: GetLastErrorString,
    // Declared last: the function pointers above point into it.
    _lib: Library,
}

impl std::fmt::Debug for CudnnLib {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "cuDNN {} ({})", self.version_string(), self.path)
    }
}

/// The oldest cuDNN whose backend takes the SDPA graphs built here.
const MIN_VERSION: usize = 90000;

static CUDNN: OnceLock<Result<CudnnLib, String>> = OnceLock::new();

/// cuDNN, loaded on first use; `Err` says why not (every candidate tried, or too old).
pub fn cudnn() -> Result<&'static CudnnLib, Error> {
    match CUDNN.get_or_init(load) {
        Ok(lib) => Ok(lib),
        Err(why) => Err(Error::CudnnUnavailable { reason: why.clone() }),
    }
}

fn candidates() -> Vec<String> {
    if let Ok(p) = std::env::var("FERROGRAD_CUDNN_LIBRARY") {
        return vec![p];
    }
    vec!["libcudnn.so.9".into(), "libcudnn.so".into()]
}

fn load() -> Result<CudnnLib, String> {
    let mut searched = vec![];
    for c in candidates() {
        // SAFETY: loading cuDNN runs its initialisers, which have no preconditions.
        match unsafe { Library::new(&c) } {
            Ok(lib) => match bind(lib, &c) {
                Ok(l) if l.version >= MIN_VERSION => return Ok(l),
                Ok(l) => searched.push(format!("{c} (cuDNN {} is older than 9.0)", l.version_string())),
                Err(e) => searched.push(format!("{c} ({e})")),
            },
            Err(e) => {
                let e = e.to_string();
                searched.push(format!("{c} ({})", e.rsplit(": ").next().unwrap_or(&e)));
            }
        }
    }
    Err(format!("libcudnn was not found or not usable: tried {}", searched.join("; ")))
}

fn bind(lib: Library, path: &str) -> Result<CudnnLib, String> {
    /// Copy one symbol's address out of the library.
    unsafe fn sym<T: Copy>(lib: &Library, name: &str) -> Result<T, String> {
        // SAFETY (caller): `T` is the symbol's true type.
        unsafe { lib.get::<T>(name.as_bytes()) }.map(|s| *s).map_err(|e| format!("missing {name}: {e}"))
    }
    // SAFETY: each type alias above is the C prototype from cudnn_graph.h for that name (enums
    // are C enums: 32-bit; cudnnStatus_t read as i32).
    unsafe {
        let get_version: GetVersion = sym(&lib, "cudnnGetVersion")?;
        Ok(CudnnLib {
            path: path.to_string(),
            version: get_version(),
            create_descriptor: sym(&lib, "cudnnBackendCreateDescriptor")?,
            destroy_descriptor: sym(&lib, "cudnnBackendDestroyDescriptor")?,
            finalize: sym(&lib, "cudnnBackendFinalize")?,
            set_attribute: sym(&lib, "cudnnBackendSetAttribute")?,
            get_attribute: sym(&lib, "cudnnBackendGetAttribute")?,
            execute: sym(&lib, "cudnnBackendExecute")?,
            create: sym(&lib, "cudnnCreate")?,
            destroy: sym(&lib, "cudnnDestroy")?,
            set_stream: sym(&lib, "cudnnSetStream")?,
            error_string: sym(&lib, "cudnnGetErrorString")?,
            last_error_string: sym(&lib, "cudnnGetLastErrorString")?,
            _lib: lib,
        })
    }
}

impl CudnnLib {
    /// The version as `major.minor.patch`.
    pub fn version_string(&self) -> String {
        let v = self.version;
        format!("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100)
    }

    /// `Ok` for CUDNN_STATUS_SUCCESS, else the typed error naming `call`, with cuDNN's name for
    /// the status and its last error message (what the backend says went wrong).
    pub(super) fn check(&self, call: &str, status: Status) -> Result<(), Error> {
        if status == 0 {
            return Ok(());
        }
        // SAFETY: cudnnGetErrorString returns a static NUL-terminated string for any code.
        let name = unsafe { (self.error_string)(status) };
        let name = if name.is_null() {
            format!("status {status}")
        } else {
            // SAFETY: non-null, NUL-terminated, static.
            unsafe { std::ffi::CStr::from_ptr(name) }.to_string_lossy().into_owned()
        };
        let mut buf = vec![0 as c_char; 1024];
        // SAFETY: the buffer holds `len` bytes; cuDNN writes a NUL-terminated message into it.
        unsafe { (self.last_error_string)(buf.as_mut_ptr(), buf.len()) };
        // SAFETY: zero-initialised and written NUL-terminated within its length.
        let msg = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().trim().to_string();
        Err(Error::Cudnn {
            call: call.to_string(),
            status,
            msg: if msg.is_empty() { name } else { format!("{name}: {msg}") },
        })
    }

    pub(super) fn create_descriptor(&self, ty: DescType) -> Result<Descriptor, Error> {
        let mut d: Descriptor = std::ptr::null_mut();
        // SAFETY: `d` is a valid out-pointer; the type is a header constant.
        self.check(&format!("cudnnBackendCreateDescriptor({ty:?})"), unsafe {
            (self.create_descriptor)(ty as u32, &mut d)
        })?;
        Ok(d)
    }

    /// # Safety
    /// `d` was created by [`create_descriptor`](Self::create_descriptor) and is destroyed once.
    pub(super) unsafe fn destroy_descriptor(&self, d: Descriptor) {
        // SAFETY: (caller) a live descriptor. A failure to destroy leaks it; nothing to report.
        let _ = unsafe { (self.destroy_descriptor)(d) };
    }

    /// # Safety
    /// `d` is a live descriptor; `data` points to `count` elements of the C type `ty` names.
    pub(super) unsafe fn set_attribute(
        &self,
        d: Descriptor,
        name: Attr,
        ty: AttrType,
        count: i64,
        data: *const c_void,
    ) -> Result<(), Error> {
        // SAFETY: (caller).
        self.check(&format!("cudnnBackendSetAttribute({name:?})"), unsafe {
            (self.set_attribute)(d, name as u32, ty as u32, count, data)
        })
    }

    /// # Safety
    /// `d` is a live, finalized descriptor; `out` has room for `requested` elements of `ty`.
    pub(super) unsafe fn get_attribute(
        &self,
        d: Descriptor,
        name: Attr,
        ty: AttrType,
        requested: i64,
        out: *mut c_void,
    ) -> Result<i64, Error> {
        let mut n = 0i64;
        // SAFETY: (caller); `n` is a valid out-pointer.
        self.check(&format!("cudnnBackendGetAttribute({name:?})"), unsafe {
            (self.get_attribute)(d, name as u32, ty as u32, requested, &mut n, out)
        })?;
        Ok(n)
    }

    pub(super) fn finalize(&self, d: Descriptor, what: &str) -> Result<(), Error> {
        // SAFETY: `d` is a live descriptor (every caller owns it through `Desc`).
        self.check(&format!("cudnnBackendFinalize({what})"), unsafe { (self.finalize)(d) })
    }

    /// # Safety
    /// The plan and variant pack are finalized; the pointers they carry address live buffers of
    /// the shapes the plan was built for; the handle's stream is set.
    pub(super) unsafe fn execute(&self, h: Handle, plan: Descriptor, pack: Descriptor) -> Result<(), Error> {
        // SAFETY: (caller).
        self.check("cudnnBackendExecute", unsafe { (self.execute)(h, plan, pack) })
    }

    /// A new handle on the calling thread's current CUDA context.
    pub(super) fn create_handle(&self) -> Result<Handle, Error> {
        let mut h: Handle = std::ptr::null_mut();
        // SAFETY: `h` is a valid out-pointer.
        self.check("cudnnCreate", unsafe { (self.create)(&mut h) })?;
        Ok(h)
    }

    /// # Safety
    /// `h` was created by [`create_handle`](Self::create_handle) and is not used afterwards.
    pub(super) unsafe fn destroy_handle(&self, h: Handle) {
        // SAFETY: (caller).
        let _ = unsafe { (self.destroy)(h) };
    }

    /// # Safety
    /// `h` is a live handle; `stream` a live stream of the handle's context.
    pub(super) unsafe fn set_stream(&self, h: Handle, stream: *mut c_void) -> Result<(), Error> {
        // SAFETY: (caller).
        self.check("cudnnSetStream", unsafe { (self.set_stream)(h, stream) })
    }
}
