//! cuDNN execution plans kept on disk between runs, beside the NVRTC kernel cache.
//!
//! Why: cuDNN's fused attention is a runtime-compiled engine. Finalizing its plan compiles a kernel
//! (NVRTC inside cuDNN) every time a process meets a new problem. On an H200, loading cuDNN and
//! building the three plans of a GPT-2 training step (forward, backward, the evaluation forward)
//! added 1.28 s to the start of `gpt train` (BENCHMARKS.md, 2026-11-23); the startup breakdown
//! now reports the load and the plans apart (`cuda::startup`). A finalized plan of such
//! an engine serializes to a JSON string (`CUDNN_ATTR_EXECUTION_PLAN_JSON_REPRESENTATION`, cuDNN's
//! own serialization, the one cudnn-frontend's `Graph::serialize` uses), and a plan descriptor
//! finalized from that string and a handle is ready to execute without the heuristics or the
//! compile.
//!
//! The file is `$cache/cudnn/<sha256 of the description>.plan`: its first line is the description
//! (problem key, cuDNN version, device name and compute capability), the rest the JSON. A file
//! whose first line differs, that cuDNN refuses, or that cannot be read is ignored (the plan is
//! built as before and the file rewritten); writes are atomic; every failure here is logged once
//! and never fails an attention call. Engines that do not serialize are simply not cached.

use super::desc::Desc;
use super::lib::{CudnnLib, Handle};
use crate::cuda::nvrtc::{hex, DiskCache};
use cudarc::cudnn::sys::cudnnBackendDescriptorType_t as D;
use cudarc::cudnn::sys::{cudnnBackendAttributeName_t as A, cudnnBackendAttributeType_t as T};
use sha2::{Digest, Sha256};
use std::path::PathBuf;

/// Where the plan described by `what` lives; `None` when caching is off (`FERROGRAD_CACHE_DIR=`).
fn path(what: &str) -> Option<PathBuf> {
    let dir = DiskCache::from_env()?.dir().join("cudnn");
    Some(dir.join(format!("{}.plan", hex(&Sha256::digest(what.as_bytes())))))
}

/// The plan for `what` restored from disk and finalized on `handle`, with its workspace bytes;
/// `None` on a miss (or a file cuDNN refuses: logged once).
pub(super) fn load(lib: &'static CudnnLib, handle: Handle, what: &str) -> Option<(Desc, usize)> {
    let path = path(what)?;
    let text = std::fs::read_to_string(&path).ok()?;
    let (first, json) = text.split_once('\n')?;
    if first != what {
        return None;
    }
    let restored = (|| -> crate::Result<(Desc, usize)> {
        let p = Desc::new(lib, D::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, "execution plan (from disk)")?;
        p.handle(A::CUDNN_ATTR_EXECUTION_PLAN_HANDLE, handle)?;
        p.chars(A::CUDNN_ATTR_EXECUTION_PLAN_JSON_REPRESENTATION, json.as_bytes())?;
        let p = p.finalize()?;
        let ws = super::graph::workspace(lib, &p)?;
        Ok((p, ws))
    })();
    match restored {
        Ok(r) => Some(r),
        Err(e) => {
            super::log_once("cudnn-plan-cache-load", || {
                format!("a cached cuDNN plan was refused ({}: {e}); building it anew", path.display())
            });
            None
        }
    }
}

/// Write `plan` for `what` (best effort: an engine that does not serialize, or a failed write,
/// is logged once and skipped).
pub(super) fn store(lib: &'static CudnnLib, plan: &Desc, what: &str) {
    let Some(path) = path(what) else { return };
    let saved = (|| -> crate::Result<()> {
        let json = json_of(lib, plan)?;
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let mut bytes = Vec::with_capacity(what.len() + 1 + json.len());
        bytes.extend_from_slice(what.as_bytes());
        bytes.push(b'\n');
        bytes.extend_from_slice(&json);
        crate::io::write_atomic(&path, &bytes)
    })();
    if let Err(e) = saved {
        super::log_once("cudnn-plan-cache-store", || format!("a cuDNN plan was not cached ({}: {e})", path.display()));
    }
}

/// The plan's JSON (`CUDNN_TYPE_CHAR`, its length first).
fn json_of(lib: &'static CudnnLib, plan: &Desc) -> crate::Result<Vec<u8>> {
    // SAFETY: a count query (no output array).
    let n = unsafe {
        lib.get_attribute(
            plan.raw,
            A::CUDNN_ATTR_EXECUTION_PLAN_JSON_REPRESENTATION,
            T::CUDNN_TYPE_CHAR,
            0,
            std::ptr::null_mut(),
        )
    }?;
    let mut buf = vec![0u8; n.max(0) as usize];
    // SAFETY: `buf` holds `n` chars for cuDNN to fill.
    let got = unsafe {
        lib.get_attribute(
            plan.raw,
            A::CUDNN_ATTR_EXECUTION_PLAN_JSON_REPRESENTATION,
            T::CUDNN_TYPE_CHAR,
            n,
            buf.as_mut_ptr() as *mut std::ffi::c_void,
        )
    }?;
    buf.truncate(got.max(0) as usize);
    // A C string: whatever follows its terminator is not the plan.
    if let Some(end) = buf.iter().position(|&b| b == 0) {
        buf.truncate(end);
    }
    if buf.is_empty() {
        return Err(crate::Error::Cudnn { call: "execution plan JSON".into(), status: -1, msg: "empty".into() });
    }
    Ok(buf)
}
