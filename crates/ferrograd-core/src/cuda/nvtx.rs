//! NVTX ranges, so that an `nsys` timeline reads in ferrograd's terms (kernel launches by name,
//! GEMMs, backward passes, and whatever a caller brackets with [`range`]).
//!
//! The NVTX library is loaded at run time (`libnvtx3interop`, which CUDA toolkits ship and the lent
//! GPU machines have; `FERROGRAD_NVTX_LIBRARY` names another), the same pattern as cuDNN and NCCL.
//! Where it is absent every call is a silent no-op. Ranges are emitted only when a tool listens
//! (`nsys` sets `NVTX_INJECTION64_PATH`) or `FERROGRAD_NVTX=1` asks: otherwise a range costs one
//! relaxed atomic load, and no string is built.

use libloading::Library;
use std::ffi::{c_char, c_int, CString};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

type Push = unsafe extern "C" fn(*const c_char) -> c_int;
type Pop = unsafe extern "C" fn() -> c_int;

struct Nvtx {
    _lib: Library,
    push: Push,
    pop: Pop,
}

static LIB: OnceLock<Option<Nvtx>> = OnceLock::new();
/// 0: not decided, 1: off, 2: on.
static STATE: AtomicU8 = AtomicU8::new(0);

fn candidates() -> Vec<String> {
    if let Ok(p) = std::env::var("FERROGRAD_NVTX_LIBRARY") {
        return vec![p];
    }
    vec!["libnvtx3interop.so.1".into(), "libnvtx3interop.so".into()]
}

fn load() -> Option<Nvtx> {
    for c in candidates() {
        // SAFETY: loading the NVTX library runs its initialisers, which have no preconditions.
        let Ok(lib) = (unsafe { Library::new(&c) }) else { continue };
        // SAFETY: the prototypes are those of nvToolsExt.h for these names.
        let syms =
            unsafe { (lib.get::<Push>(b"nvtxRangePushA").map(|s| *s), lib.get::<Pop>(b"nvtxRangePop").map(|s| *s)) };
        if let (Ok(push), Ok(pop)) = syms {
            return Some(Nvtx { _lib: lib, push, pop });
        }
    }
    None
}

/// Whether ranges are emitted: a tool listens or `FERROGRAD_NVTX=1`, and the library loaded.
pub fn enabled() -> bool {
    match STATE.load(Ordering::Relaxed) {
        1 => false,
        2 => true,
        _ => {
            let asked = std::env::var("FERROGRAD_NVTX").map(|v| v != "0" && !v.is_empty()).unwrap_or(false)
                || std::env::var_os("NVTX_INJECTION64_PATH").is_some();
            let on = asked && LIB.get_or_init(load).is_some();
            STATE.store(if on { 2 } else { 1 }, Ordering::Relaxed);
            on
        }
    }
}

/// An open NVTX range; popped when dropped.
#[must_use = "the range ends when this guard drops"]
pub struct Range(bool);

impl Drop for Range {
    fn drop(&mut self) {
        if let (true, Some(Some(l))) = (self.0, LIB.get()) {
            // SAFETY: balanced with the push in `range_with`.
            unsafe { (l.pop)() };
        }
    }
}

/// Opens a range named `name` (a no-op guard when NVTX is off or absent).
pub fn range(name: &str) -> Range {
    range_with(|| name.to_string())
}

/// Opens a range whose name is built only when NVTX is on.
pub fn range_with(name: impl FnOnce() -> String) -> Range {
    if !enabled() {
        return Range(false);
    }
    let (Some(Some(l)), Ok(c)) = (LIB.get(), CString::new(name())) else { return Range(false) };
    // SAFETY: a valid NUL-terminated string, copied by NVTX before the call returns.
    unsafe { (l.push)(c.as_ptr()) };
    Range(true)
}

/// Whether the NVTX library could be loaded on this machine (regardless of [`enabled`]).
pub fn available() -> bool {
    LIB.get_or_init(load).is_some()
}

#[cfg(test)]
mod tests {
    #[test]
    fn ranges_are_silent_without_a_listener() {
        // No tool attached in the test run: ranges are no-ops whether or not the library exists,
        // and nesting them never panics.
        let _a = super::range("outer");
        let _b = super::range_with(|| "inner".into());
        let _ = super::available();
    }
}
