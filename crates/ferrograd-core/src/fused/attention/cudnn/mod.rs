//! cuDNN's fused scaled dot-product attention, forward and backward, through the backend (graph)
//! API of a libcudnn 9.x loaded at run time (`lib.rs`; never linked: without cuDNN everything
//! builds and runs on our kernels).
//!
//! Route, and why: cuDNN 9.14 accepts two ways of stating SDPA. (1) The unified
//! `CUDNN_BACKEND_OPERATION_SDPA_FWD_DESCRIPTOR` (9.13.1+): before 9.21 it takes neither a mask
//! (a causal mask needs its score-modifier subgraph, 9.21) nor a backward
//! (`..._SDPA_BWD_DESCRIPTOR` comes later), and cudnn-frontend picks it only for unmasked
//! forwards. (2) The composite graph of matmul, pointwise (scale, GEN_INDEX / CMP_GE /
//! BINARY_SELECT for the causal mask, exp, log, ...) and reduction operations that
//! cudnn-frontend's `CompositeSDPANode` / `CompositeSDPABackwardNode` lower `sdpa` /
//! `sdpa_backward` to for every 9.x, which the backend matches to its fused flash-attention
//! engines. This file uses (2) for both directions: one route for causal and full, forward and
//! backward, on every 9.x (`graph.rs` states the graphs).
//!
//! Plans are built once per problem (shape, dtype, causal, every operand's strides, scale,
//! direction) per device, with heuristic mode A's first engine config that finalizes, and cached
//! (a problem cuDNN cannot plan is cached as such: that call and later ones run our kernels,
//! logged once). Execution enqueues on `CudaDevice::stream()` with a workspace from the caching
//! allocator, no host synchronization, so it can be captured in a CUDA graph (a plan is never
//! built during a capture: a problem first met inside one runs our kernels).
//!
//! q, k, v are read in place from their strides (the `[B, H, T, D]` views of one `[B, T, 3, H, D]`
//! buffer included); a view whose head dim is not contiguous or whose strides are not 16-byte
//! multiples is copied first, as for our tensor-core kernels. O and the gradients are written
//! `[B, T, H, D]`, the statistics `[B, H, Tq]` f32 (natural-log log-sum-exp, the format our
//! kernels save and read).

mod desc;
mod graph;
mod lib;
mod plan_cache;

use super::cuda::{grad_out, lse_ptr, operand, Stride4};
use super::select::log_once;
use super::Problem;
use crate::cuda::buffer::CudaBuffer;
use crate::cuda::device::driver_err;
use crate::cuda::{CudaDevice, CudaStorage};
use crate::fused::FusedOutputs;
use crate::{DType, Error, Layout, Result, Shape as TShape};
use cudarc::cudnn::sys::{cudnnBackendAttributeName_t as A, cudnnBackendDescriptorType_t as D, cudnnDataType_t};
use desc::Desc;
use graph::{uid, Builder, Plan, Shape, Strides};
pub use lib::CudnnLib;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

/// cuDNN, loaded on first use (`Err`: why it cannot be used here).
pub fn library() -> Result<&'static CudnnLib> {
    lib::cudnn()
}

/// Whether libcudnn 9.x can be loaded here.
pub fn available() -> bool {
    library().is_ok()
}

/// Why the last problem cuDNN was asked for got no plan (for tests and logs), if one did not.
pub fn last_plan_error() -> Option<String> {
    lock(&LAST_ERROR).clone()
}

static LAST_ERROR: Mutex<Option<String>> = Mutex::new(None);

/// Plans restored from the disk cache (`plan_cache.rs`) so far in this process.
pub fn plans_restored() -> u64 {
    RESTORED.load(std::sync::atomic::Ordering::Relaxed)
}

static RESTORED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Drop every device's in-memory plans, as a new process starts without them: the next call of
/// each problem builds its plan again or restores it from the disk cache. For tests and benches
/// (the plans still referenced by queued work stay alive until it is done).
pub fn forget_plans() {
    if let Some(devices) = DEVICES.get() {
        for st in lock(devices).values() {
            lock(&st.plans).clear();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Key {
    shape: Shape,
    backward: bool,
    /// q, k, v, o, dO, dq, dk, dv (the backward's; zero where the forward has none).
    strides: [Strides; 8],
    scale: u32,
}

/// cuDNN's state on one device: its handle (one caller at a time: the stream is set per call) and
/// the plans.
struct DeviceState {
    lib: &'static CudnnLib,
    handle: Mutex<lib::Handle>,
    plans: Mutex<HashMap<Key, Option<Arc<Plan>>>>,
}

// SAFETY: the handle is used only under its mutex; plans are finalized, read-only descriptors.
unsafe impl Send for DeviceState {}
unsafe impl Sync for DeviceState {}

impl Drop for DeviceState {
    fn drop(&mut self) {
        let h = *self.handle.get_mut().unwrap_or_else(|e| e.into_inner());
        // SAFETY: created by cudnnCreate; nothing uses it any more.
        unsafe { self.lib.destroy_handle(h) }
    }
}

static DEVICES: OnceLock<Mutex<HashMap<usize, Arc<DeviceState>>>> = OnceLock::new();

fn state(dev: &CudaDevice) -> Result<Arc<DeviceState>> {
    let mut map = lock(DEVICES.get_or_init(Default::default));
    if let Some(s) = map.get(&dev.ordinal) {
        return Ok(s.clone());
    }
    let t = std::time::Instant::now();
    let lib = library()?;
    dev.ctx.bind_to_thread().map_err(|e| driver_err("cuCtxSetCurrent", e))?;
    let handle = lib.create_handle()?;
    crate::cuda::startup::add(crate::cuda::startup::Cost::CudnnLoad, t.elapsed());
    let s = Arc::new(DeviceState { lib, handle: Mutex::new(handle), plans: Mutex::new(HashMap::new()) });
    map.insert(dev.ordinal, s.clone());
    Ok(s)
}

/// Whether cuDNN's SDPA can take this problem at all (before anything is built): cuDNN found,
/// bf16 or f16, no dropout (our Philox mask is not cuDNN's), a head dim that is a multiple of 8 up
/// to 128, something to compute.
pub(super) fn supports(pb: &Problem, dtype: DType) -> bool {
    matches!(dtype, DType::BF16 | DType::F16)
        && pb.dropout.is_none()
        && pb.d.is_multiple_of(8)
        && pb.d <= 128
        && pb.b * pb.h * pb.tq * pb.tk > 0
        && available()
}

fn strides(s: Stride4) -> Strides {
    [s.b, s.h, s.t, s.d]
}

fn bthd(t: usize, h: usize, d: usize) -> Strides {
    [(t * h * d) as i64, d as i64, (h * d) as i64, 1]
}

fn shape(pb: &Problem, dtype: DType) -> Shape {
    let io = if dtype == DType::F16 { cudnnDataType_t::CUDNN_DATA_HALF } else { cudnnDataType_t::CUDNN_DATA_BFLOAT16 };
    Shape {
        b: pb.b as i64,
        h: pb.h as i64,
        tq: pb.tq as i64,
        tk: pb.tk as i64,
        d: pb.d as i64,
        io: io as u32,
        causal: pb.causal,
    }
}

/// The cached plan for `key`, built by `build` the first time; `None` when cuDNN cannot plan it
/// (or it is first met during a graph capture).
fn plan_for(
    dev: &CudaDevice,
    st: &DeviceState,
    key: Key,
    build: impl FnOnce(&mut Builder) -> Result<()>,
) -> Result<Option<Arc<Plan>>> {
    let mut plans = lock(&st.plans);
    if let Some(p) = plans.get(&key) {
        return Ok(p.clone());
    }
    if crate::cuda::is_capturing() {
        log_once("cudnn-capture", || {
            "an attention problem first met during a CUDA-graph capture runs our kernels (cuDNN plans are \
             built outside captures; run the step once before capturing)"
                .into()
        });
        return Ok(None);
    }
    dev.ctx.bind_to_thread().map_err(|e| driver_err("cuCtxSetCurrent", e))?;
    let handle = *lock(&st.handle);
    let mut b = Builder::new(st.lib);
    let what = format!(
        "{key:?} cudnn {} on {} sm_{}{}",
        st.lib.version_string(),
        dev.info.name,
        dev.info.compute_capability.0,
        dev.info.compute_capability.1
    );
    let built = crate::cuda::startup::timed(crate::cuda::startup::Cost::CudnnPlans, || -> Result<Plan> {
        build(&mut b)?;
        if let Some((p, ws)) = plan_cache::load(st.lib, handle, &what) {
            RESTORED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return Ok(graph::restored(b, p, ws));
        }
        let p = graph::plan(st.lib, handle, b)?;
        plan_cache::store(st.lib, &p.plan, &what);
        Ok(p)
    });
    let entry = match built {
        Ok(p) => {
            log_once("cudnn-first-plan", || {
                format!(
                    "first cuDNN plan ({}, {:?}): {}, {} bytes of workspace",
                    if key.backward { "backward" } else { "forward" },
                    key.shape,
                    if p.from_disk {
                        "restored from the plan cache".to_string()
                    } else {
                        format!("engine config {} of heuristic A's list", p.choice)
                    },
                    p.workspace
                )
            });
            Some(Arc::new(p))
        }
        Err(e) => {
            let what = format!(
                "cuDNN has no plan for the {} of B={} H={} Tq={} Tk={} D={} causal={}: {e}; our kernels run it",
                if key.backward { "backward" } else { "forward" },
                key.shape.b,
                key.shape.h,
                key.shape.tq,
                key.shape.tk,
                key.shape.d,
                key.shape.causal
            );
            *lock(&LAST_ERROR) = Some(what.clone());
            log_once("cudnn-plan", || what);
            None
        }
    };
    plans.insert(key, entry.clone());
    Ok(entry)
}

/// Enqueue `plan` on the current stream with device pointers `ptrs` and host scalars `scalars`
/// bound to the plan's uids.
fn execute(
    dev: &Arc<CudaDevice>,
    st: &DeviceState,
    plan: &Plan,
    ptrs: &[(i64, u64)],
    scalars: &[(i64, &f32)],
) -> Result<()> {
    let mut uids = vec![];
    let mut data: Vec<*mut c_void> = vec![];
    for &u in &plan.uids {
        let p = if let Some((_, p)) = ptrs.iter().find(|(x, _)| *x == u) {
            *p as *mut c_void
        } else if let Some((_, v)) = scalars.iter().find(|(x, _)| *x == u) {
            *v as *const f32 as *mut c_void
        } else {
            return Err(Error::Cudnn {
                call: "variant pack".into(),
                status: -1,
                msg: format!("no pointer for tensor uid {u}"),
            });
        };
        uids.push(u);
        data.push(p);
    }
    let ws = if plan.workspace > 0 { Some(CudaBuffer::raw(dev, plan.workspace)?) } else { None };
    let ws_ptr = ws.as_ref().and_then(|g| g.allocation()).map_or(0, |a| a.ptr()) as *mut c_void;
    let pack = Desc::new(st.lib, D::CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, "variant pack")?;
    pack.i64s(A::CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, &uids)?;
    pack.void_ptrs(A::CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, &data)?;
    pack.void_ptrs(A::CUDNN_ATTR_VARIANT_PACK_WORKSPACE, &[ws_ptr])?;
    let pack = pack.finalize()?;
    dev.ctx.bind_to_thread().map_err(|e| driver_err("cuCtxSetCurrent", e))?;
    let handle = lock(&st.handle);
    // SAFETY: the handle is live and held; the stream is this thread's current stream of the
    // device whose context the handle was made on; the plan was built for exactly these shapes
    // and strides (the key), every pointer addresses a live buffer of its tensor (the caller's
    // storages, alive until this returns; the workspace until after the launch is enqueued, and
    // the allocator orders its reuse on the stream), the host scalars outlive the call (cuDNN
    // copies them into the launch).
    unsafe {
        st.lib.set_stream(*handle, dev.stream().cu_stream() as *mut c_void)?;
        st.lib.execute(*handle, plan.plan.raw, pack.raw)?;
    }
    drop(ws);
    Ok(())
}

type Operand<'a> = (&'a CudaStorage, &'a Layout);

/// Device int32 buffers of `b` copies of `tq` and of `tk` (the backward's padding-mask
/// workaround), uploaded on first use per (device, b, tq, tk) and kept for the process: a step
/// captured in a CUDA graph reads them without a copy.
fn seq_lens(dev: &Arc<CudaDevice>, b: usize, tq: usize, tk: usize) -> Result<(u64, u64)> {
    type Lens = HashMap<(usize, usize, usize, usize), (CudaStorage, CudaStorage)>;
    static LENS: OnceLock<Mutex<Lens>> = OnceLock::new();
    let mut m = lock(LENS.get_or_init(Default::default));
    let key = (dev.ordinal, b, tq, tk);
    if let Some((q, k)) = m.get(&key) {
        return Ok((q.buf.ptr(), k.buf.ptr()));
    }
    if crate::cuda::is_capturing() {
        return Err(Error::GraphCapture { call: "cuDNN attention: first upload of sequence lengths" });
    }
    let up = |t: usize| CudaStorage::from_cpu(dev, &crate::cpu::CpuStorage::I32(vec![t as i32; b]));
    let (q, k) = (up(tq)?, up(tk)?);
    let ptrs = (q.buf.ptr(), k.buf.ptr());
    m.insert(key, (q, k));
    Ok(ptrs)
}

/// The forward on cuDNN: `Ok(None)` when it has no plan for the problem (the caller runs ours).
/// Outputs as our kernels': O `[B, Tq, H, D]`, the log-sum-exp `[B, H, Tq]` f32.
pub(super) fn forward(pb: &Problem, q: Operand, k: Operand, v: Operand) -> Result<Option<FusedOutputs<CudaStorage>>> {
    let dtype = q.0.dtype();
    let dev = q.0.dev().clone();
    let st = state(&dev)?;
    let Problem { b, h, tq, d, .. } = *pb;
    let (qp, qs, _qc) = operand(q.0, q.1, false, true)?;
    let (kp, ks, _kc) = operand(k.0, k.1, false, true)?;
    let (vp, vs, _vc) = operand(v.0, v.1, false, true)?;
    let os = bthd(tq, h, d);
    let sh = shape(pb, dtype);
    let z = [0i64; 4];
    let key = Key {
        shape: sh,
        backward: false,
        strides: [strides(qs), strides(ks), strides(vs), os, z, z, z, z],
        scale: (pb.scale as f32).to_bits(),
    };
    let Some(plan) = plan_for(&dev, &st, key, |g| g.sdpa_forward(&sh, strides(qs), strides(ks), strides(vs), os))?
    else {
        return Ok(None);
    };
    let o = CudaStorage::uninit(&dev, b * tq * h * d, dtype)?;
    let lse = CudaStorage::uninit(&dev, b * h * tq, DType::F32)?;
    let (scale, neg_inf) = (pb.scale as f32, f32::NEG_INFINITY);
    execute(
        &dev,
        &st,
        &plan,
        &[(uid::Q, qp), (uid::K, kp), (uid::V, vp), (uid::O, o.buf.ptr()), (uid::STATS, lse.buf.ptr())],
        &[(uid::SCALE, &scale), (uid::NEG_INF, &neg_inf)],
    )?;
    Ok(Some(vec![(o, TShape::from(vec![b, tq, h, d])), (lse, TShape::from(vec![b, h, tq]))]))
}

/// The backward on cuDNN: `Ok(None)` when it has no plan. Inputs and outputs as our kernels'
/// (`cuda::backward`).
#[allow(clippy::too_many_arguments)]
pub(super) fn backward(
    pb: &Problem,
    q: Operand,
    k: Operand,
    v: Operand,
    o: Operand,
    dout: Operand,
    lse: Operand,
    packed: bool,
) -> Result<Option<FusedOutputs<CudaStorage>>> {
    let dtype = q.0.dtype();
    let dev = q.0.dev().clone();
    let st = state(&dev)?;
    // Before 9.6 the dQ accumulator had to be zeroed by the caller; we require 9.6 instead.
    if st.lib.version < 90600 {
        return Ok(None);
    }
    let Problem { b, h, tq, tk, d, .. } = *pb;
    let (lp, _lse) = lse_ptr(lse)?;
    let (qp, qs, _qc) = operand(q.0, q.1, false, true)?;
    let (kp, ks, _kc) = operand(k.0, k.1, false, true)?;
    let (vp, vs, _vc) = operand(v.0, v.1, false, true)?;
    let (op, os, _oc) = operand(o.0, o.1, true, true)?;
    let (gp, gs, _gc) = operand(dout.0, dout.1, true, true)?;
    // Where dq, dk, dv go (three [B, T, H, D] buffers or one packed [B, T, 3, H, D]) decides
    // their strides, part of the plan's key; the buffers themselves are made once a plan exists.
    let [dqs, dks, dvs] = if packed {
        let row = (3 * h * d) as i64;
        [[tq as i64 * row, d as i64, row, 1]; 3]
    } else {
        [bthd(tq, h, d), bthd(tk, h, d), bthd(tk, h, d)]
    };
    let sh = shape(pb, dtype);
    let key = Key {
        shape: sh,
        backward: true,
        strides: [strides(qs), strides(ks), strides(vs), strides(os), strides(gs), dqs, dks, dvs],
        scale: (pb.scale as f32).to_bits(),
    };
    let padded = graph::backward_needs_padding(st.lib.version, sh.tq, sh.tk);
    let Some(plan) = plan_for(&dev, &st, key, |g| {
        g.sdpa_backward(&sh, padded, strides(qs), strides(ks), strides(vs), strides(os), strides(gs), dqs, dks, dvs)
    })?
    else {
        return Ok(None);
    };
    // The workaround's sequence lengths (all full), uploaded once per problem and kept.
    let seq_lens = if padded { Some(seq_lens(&dev, b, tq, tk)?) } else { None };
    let out = grad_out(&dev, pb, dtype, packed)?;
    let softmax_sum = CudaStorage::uninit(&dev, b * h * tq, DType::F32)?;
    let dq_accum = CudaStorage::uninit(&dev, b * h * tq * d, DType::F32)?;
    let (scale, neg_inf, one) = (pb.scale as f32, f32::NEG_INFINITY, 1f32);
    execute(
        &dev,
        &st,
        &plan,
        &[
            (uid::Q, qp),
            (uid::K, kp),
            (uid::V, vp),
            (uid::O, op),
            (uid::DO, gp),
            (uid::STATS, lp),
            (uid::DQ, out.ptrs[0]),
            (uid::DK, out.ptrs[1]),
            (uid::DV, out.ptrs[2]),
            (uid::SOFTMAX_SUM, softmax_sum.buf.ptr()),
            (uid::DQ_ACCUM, dq_accum.buf.ptr()),
            (uid::SEQ_LEN_Q, seq_lens.as_ref().map_or(0, |s| s.0)),
            (uid::SEQ_LEN_KV, seq_lens.as_ref().map_or(0, |s| s.1)),
        ],
        &[(uid::SCALE, &scale), (uid::NEG_INF, &neg_inf), (uid::NEG_INF_PAD, &neg_inf), (uid::ONE, &one)],
    )?;
    Ok(Some(out.outs))
}

#[cfg(test)]
mod tests;
