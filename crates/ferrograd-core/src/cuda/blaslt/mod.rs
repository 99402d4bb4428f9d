//! Matmul with fused epilogues through cuBLASLt, with everything a training step repeats cached:
//! one handle per device, one workspace per (device, stream) taken once from the caching
//! allocator, and per problem (shape, transposes, leading dims, alignments, dtype, epilogue) the
//! descriptors and the algorithm the heuristic chose. A step therefore never runs the heuristic
//! again and never allocates, so it can be captured as a CUDA graph.
//!
//! Problems are stated as cuBLASLt states them, column-major: `D (m x n) = op(A) (m x k) · op(B)
//! (k x n)`, then the epilogue. Row-major callers (every tensor here) pass their matrices as the
//! transposes they are in column-major terms; `fused/linear/cuda.rs` shows the mapping.
//!
//! Launches go to `CudaDevice::stream()` (the current stream). Where cuBLASLt has no kernel for a
//! problem (a dtype or leading dimension it does not take) [`gemm`] answers `Ok(false)`, cached like
//! any plan, and the caller falls back to cuBLAS.

mod desc;
pub(crate) mod int8;
mod plan;
#[cfg(test)]
mod tests;

use super::buffer::{AllocGuard, CudaBuffer};
use super::device::{driver_err, CudaDevice};
use super::event::Event;
use crate::{DType, Error, Result};
use cudarc::cublaslt::{result as lt, sys};
use desc::lt_err;
use plan::{Plan, PlanKey};
use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

/// What runs after the product, in cuBLASLt's column-major terms (a bias has one entry per row of
/// D unless stated).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Epilogue {
    /// `D = A B`
    Default,
    /// `D = A B + bias`
    Bias,
    /// `D = relu(A B)`
    Relu,
    /// `D = relu(A B + bias)`
    ReluBias,
    /// `D = gelu(A B)` (GELU in its tanh form, as every GELU epilogue)
    Gelu,
    /// `D = gelu(A B + bias)`
    GeluBias,
    /// `D = gelu(A B)`, `aux = A B`
    GeluAux,
    /// `D = gelu(A B + bias)`, `aux = A B + bias`: the forward of a GELU layer, keeping the
    /// pre-activation its backward needs.
    GeluAuxBias,
    /// `D = (A B) * gelu'(aux)`
    DGelu,
    /// `D = (A B) * gelu'(aux)`, `bias = sum of D over its columns`: the gradient of a GELU layer's
    /// pre-activation and of its bias, when the incoming gradient is itself a product.
    DGeluBGrad,
    /// `D = A B`, `bias = sum of op(B) over k` (one entry per column of D): a weight gradient and
    /// the bias gradient in one call.
    BGradB,
    /// `D = A B`, `bias = sum of op(A) over k` (one entry per row of D): the same when the weight
    /// gradient is written transposed (the incoming gradient is then A).
    BGradA,
}

impl Epilogue {
    /// Whether `Gemm::bias` must be given (read for the forward ones, written for the gradients).
    pub fn uses_bias(self) -> bool {
        matches!(
            self,
            Epilogue::Bias
                | Epilogue::ReluBias
                | Epilogue::GeluBias
                | Epilogue::GeluAuxBias
                | Epilogue::DGeluBGrad
                | Epilogue::BGradB
                | Epilogue::BGradA
        )
    }

    /// Whether `Gemm::aux` must be given (written by the GELU forwards, read by their gradients).
    pub fn uses_aux(self) -> bool {
        matches!(self, Epilogue::GeluAux | Epilogue::GeluAuxBias | Epilogue::DGelu | Epilogue::DGeluBGrad)
    }
}

/// One matrix operand: device address, leading dimension (elements), and for A and B whether the
/// product reads it transposed (`op(X) = X^T`). A stored as `k x m` when transposed, else `m x k`.
#[derive(Clone, Copy, Debug)]
pub struct Operand {
    /// Device address.
    pub ptr: u64,
    /// Leading dimension in elements.
    pub ld: usize,
    /// Whether the product reads it transposed.
    pub trans: bool,
}

/// The aux matrix of the GELU epilogues: `m x n`, column-major, `ld` a multiple of 8.
#[derive(Clone, Copy, Debug)]
pub struct Aux {
    /// Device address.
    pub ptr: u64,
    /// Leading dimension in elements.
    pub ld: usize,
}

/// One `D = epilogue(op(A) op(B))` on `dtype` (f32, f16 or bf16; f32 accumulation; TF32 for f32
/// when the matmul precision is `High`). Bias and aux have D's dtype.
#[derive(Clone, Copy, Debug)]
pub struct Gemm {
    /// Element type of A and B (and of the aux buffer).
    pub dtype: DType,
    /// Element type of D and of the bias: `dtype`, or f32 for an f16/bf16 product kept in f32 (the
    /// f32 weight gradient of a half-precision linear over f32 master weights).
    pub d_dtype: DType,
    /// Rows of `op(A)` and D.
    pub m: usize,
    /// Columns of `op(B)` and D.
    pub n: usize,
    /// The contracted dimension.
    pub k: usize,
    /// Left operand.
    pub a: Operand,
    /// Right operand.
    pub b: Operand,
    /// Output, `m x n`, column-major (its `trans` must be false).
    pub d: Operand,
    /// What is applied to the product before it is stored.
    pub epilogue: Epilogue,
    /// Bias vector (`m` elements) for the bias epilogues.
    pub bias: Option<u64>,
    /// The GELU pre-activation (forward) or its input (backward) for the GELU epilogues.
    pub aux: Option<Aux>,
}

/// What the layer has done: how often the heuristic ran (once per new problem), how many matmuls
/// it launched, how many problems it turned away (no kernel; the caller fell back), and how many
/// launches autotuning spent.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Heuristic queries (one per new problem).
    pub heuristic_calls: u64,
    /// Matmuls launched.
    pub launches: u64,
    /// Problems turned away for want of a kernel.
    pub no_kernel: u64,
    /// Launches made to time a new plan's candidate algorithms (not counted in `launches`).
    pub tuning_launches: u64,
}

const ZERO: Counters = Counters { heuristic_calls: 0, launches: 0, no_kernel: 0, tuning_launches: 0 };
static COUNTERS: Mutex<Counters> = Mutex::new(ZERO);
thread_local! {
    static COUNTERS_HERE: Cell<Counters> = const { Cell::new(ZERO) };
}

fn count(f: impl Fn(&mut Counters)) {
    f(&mut lock(&COUNTERS));
    COUNTERS_HERE.with(|c| {
        let mut v = c.get();
        f(&mut v);
        c.set(v)
    });
}

/// The process-wide counters.
pub fn counters() -> Counters {
    *lock(&COUNTERS)
}

/// The counters of work done on the calling thread (what a test sharing its process with other
/// tests can rely on).
pub fn counters_on_this_thread() -> Counters {
    COUNTERS_HERE.with(|c| c.get())
}

/// cuBLASLt's state for one device.
struct LtDevice {
    handle: sys::cublasLtHandle_t,
    plans: Mutex<HashMap<PlanKey, Option<Plan>>>,
    /// One workspace per stream (keyed by the raw stream handle): two streams running matmuls at
    /// the same time must not share one. Allocated on a stream's first matmul and kept.
    workspaces: Mutex<HashMap<usize, AllocGuard>>,
}

// SAFETY: the handle is only used under the device's plan mutex or for launches, which cuBLASLt
// allows from any thread; the rest is Mutex-protected.
unsafe impl Send for LtDevice {}
unsafe impl Sync for LtDevice {}

static DEVICES: OnceLock<Mutex<HashMap<usize, Arc<LtDevice>>>> = OnceLock::new();

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Bytes of workspace per stream: what NVIDIA recommends (32 MiB on Hopper and later, 4 MiB
/// before), as PyTorch and TransformerEngine use.
fn workspace_bytes(dev: &CudaDevice) -> usize {
    if dev.info.compute_capability.0 >= 9 {
        32 << 20
    } else {
        4 << 20
    }
}

/// Whether libcublasLt can be loaded (cudarc panics on a missing library; we check first).
pub fn available() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only probes whether the shared library can be opened.
    *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() })
}

fn lt_device(dev: &CudaDevice) -> Result<Arc<LtDevice>> {
    let mut map = lock(DEVICES.get_or_init(Default::default));
    if let Some(d) = map.get(&dev.ordinal) {
        return Ok(d.clone());
    }
    if !available() {
        return Err(Error::CudaUnavailable { reason: "libcublasLt was not found".into() });
    }
    dev.ctx.bind_to_thread().map_err(|e| driver_err("cuCtxSetCurrent", e))?;
    let handle = super::startup::timed(super::startup::Cost::CublasLt, lt::create_handle)
        .map_err(|e| lt_err("cublasLtCreate", e))?;
    let d = Arc::new(LtDevice { handle, plans: Mutex::new(HashMap::new()), workspaces: Mutex::new(HashMap::new()) });
    map.insert(dev.ordinal, d.clone());
    Ok(d)
}

/// The workspace of the current stream: (address, bytes).
fn workspace(dev: &Arc<CudaDevice>, lt: &LtDevice) -> Result<(u64, usize)> {
    let stream = dev.stream().cu_stream() as usize;
    let mut ws = lock(&lt.workspaces);
    if let Some(g) = ws.get(&stream) {
        return Ok((g.allocation().map_or(0, |a| a.ptr()), workspace_bytes(dev)));
    }
    let g = CudaBuffer::raw(dev, workspace_bytes(dev))?;
    let ptr = g.allocation().map_or(0, |a| a.ptr());
    ws.insert(stream, g);
    Ok((ptr, workspace_bytes(dev)))
}

fn check(g: &Gemm) -> Result<()> {
    let bad = |msg: String| Err(Error::InvalidArgument(format!("cublasLt matmul {g:?}: {msg}")));
    if g.m == 0 || g.n == 0 || g.k == 0 {
        return bad("every dimension must be at least 1 (callers handle empty products)".into());
    }
    let (ra, rb) = (if g.a.trans { g.k } else { g.m }, if g.b.trans { g.n } else { g.k });
    if g.a.ld < ra || g.b.ld < rb || g.d.ld < g.m || g.d.trans {
        return bad("a leading dimension is below its operand's row count (or D is transposed)".into());
    }
    let wide = g.d_dtype == DType::F32 && matches!(g.dtype, DType::F16 | DType::BF16);
    if g.d_dtype != g.dtype && !wide {
        return bad(format!("D in {} for a {} product (only f16/bf16 may be written in f32)", g.d_dtype, g.dtype));
    }
    if g.epilogue.uses_aux() && g.d_dtype != g.dtype {
        return bad(format!("epilogue {:?} needs D in the operands' dtype", g.epilogue));
    }
    if g.epilogue.uses_bias() != g.bias.is_some() {
        return bad(format!("epilogue {:?} and the bias pointer disagree", g.epilogue));
    }
    if g.epilogue.uses_aux() != g.aux.is_some() {
        return bad(format!("epilogue {:?} and the aux buffer disagree", g.epilogue));
    }
    if let Some(aux) = g.aux {
        if aux.ld < g.m || !aux.ld.is_multiple_of(8) {
            return bad(format!("aux leading dimension {} must be >= m and a multiple of 8", aux.ld));
        }
    }
    Ok(())
}

/// Enqueue `g` on the device's current stream. `Ok(false)`: cuBLASLt has no kernel for this
/// problem (nothing was launched; the caller falls back). The first call for a problem runs the
/// heuristic; later ones reuse its answer.
pub(crate) fn gemm(dev: &Arc<CudaDevice>, g: &Gemm) -> Result<bool> {
    gemm_tuned(dev, g, autotune())
}

/// [`gemm`], timing the heuristic's candidates when the problem is new and `tune_new` is set.
fn gemm_tuned(dev: &Arc<CudaDevice>, g: &Gemm, tune_new: bool) -> Result<bool> {
    check(g)?;
    let lt = lt_device(dev)?;
    let (ws_ptr, ws_bytes) = workspace(dev, &lt)?;
    let key = PlanKey::of(g);
    dev.ctx.bind_to_thread().map_err(|e| driver_err("cuCtxSetCurrent", e))?;
    // The plan stays locked from binding its pointers to the launch: another thread binding the
    // same descriptor in between would send this launch its buffers.
    let mut plans = lock(&lt.plans);
    let plan = match plans.entry(key) {
        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
        std::collections::hash_map::Entry::Vacant(e) => {
            let t = std::time::Instant::now();
            let mut plan = Plan::new(lt.handle, g, &key, ws_bytes)?;
            super::startup::add(super::startup::Cost::CublasLt, t.elapsed());
            if let (Some(p), true) = (plan.as_mut(), tune_new) {
                tune(dev, &lt, p, g, (ws_ptr, ws_bytes))?;
            }
            e.insert(plan)
        }
    };
    let Some(plan) = plan.as_ref() else {
        count(|c| c.no_kernel += 1);
        return Ok(false);
    };
    plan.bind(g)?;
    let span = super::profile::begin(dev, || {
        format!("lt_gemm {:?} {}->{} {}x{}x{}", g.epilogue, g.dtype, g.d_dtype, g.m, g.n, g.k)
    });
    launch(dev, &lt, plan, &plan.algo, g, (ws_ptr, ws_bytes)).map_err(|e| lt_err("cublasLtMatmul", e))?;
    if let Some(span) = span {
        span.end(dev);
    }
    count(|c| c.launches += 1);
    Ok(true)
}

/// One `cublasLtMatmul` of `plan` with `algo` on the current stream.
fn launch(
    dev: &CudaDevice,
    lt: &LtDevice,
    plan: &Plan,
    algo: &sys::cublasLtMatmulAlgo_t,
    g: &Gemm,
    (ws_ptr, ws_bytes): (u64, usize),
) -> std::result::Result<(), lt::CublasError> {
    let (alpha, beta) = (1f32, 0f32);
    // SAFETY: the descriptors and algorithm were built for exactly this key (shapes, leading
    // dims, alignments) and bound to this call's bias/aux; the caller guarantees the pointers
    // address live device buffers of those shapes; the workspace is this stream's own and at least
    // the size the algorithm needs (the heuristic was capped at it); alpha and beta outlive the
    // call (cuBLASLt reads host scalars before returning).
    unsafe {
        lt::matmul(
            lt.handle,
            plan.desc.0,
            &alpha as *const f32 as *const c_void,
            &beta as *const f32 as *const c_void,
            g.a.ptr as *const c_void,
            plan.a.0,
            g.b.ptr as *const c_void,
            plan.b.0,
            g.d.ptr as *const c_void,
            plan.d.0,
            g.d.ptr as *mut c_void,
            plan.d.0,
            algo,
            ws_ptr as *mut c_void,
            ws_bytes,
            dev.stream().cu_stream() as sys::cudaStream_t,
        )
    }
}

/// Whether new plans time the heuristic's candidates: inside a [`tune_new_plans`] scope on this
/// thread, else `FERROGRAD_CUBLASLT_AUTOTUNE=1` (off by default, as PyTorch's TunableOp: the
/// heuristic's first choice, and no wait for the GPU).
fn autotune() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    if UNTUNED.with(|t| t.get() > 0) {
        return false;
    }
    TUNING.with(|t| t.get() > 0)
        || *ON.get_or_init(|| std::env::var("FERROGRAD_CUBLASLT_AUTOTUNE").is_ok_and(|v| v.trim() == "1"))
}

thread_local! {
    static TUNING: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
    static UNTUNED: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Ends a [`without_tuning`] scope when dropped.
#[must_use = "tuning is back when the guard is dropped"]
pub struct NoTuneScope(());

impl Drop for NoTuneScope {
    fn drop(&mut self) {
        UNTUNED.with(|t| t.set(t.get().saturating_sub(1)));
    }
}

/// Until the guard is dropped, plans this thread creates keep the heuristic's first choice, even
/// inside a [`tune_new_plans`] scope or with `FERROGRAD_CUBLASLT_AUTOTUNE=1`. Timing picks the
/// fastest candidate, which can differ from run to run and from an untuned plan of the same
/// problem (different rounding: results equal to the last bit only for the same algorithm); a
/// comparison that needs bit-identical products, such as graph replay against eager steps, runs
/// inside this scope.
pub fn without_tuning() -> NoTuneScope {
    UNTUNED.with(|t| t.set(t.get() + 1));
    NoTuneScope(())
}

/// Ends a [`tune_new_plans`] scope when dropped.
#[must_use = "tuning ends when the guard is dropped"]
pub struct TuneScope(());

impl Drop for TuneScope {
    fn drop(&mut self) {
        TUNING.with(|t| t.set(t.get().saturating_sub(1)));
    }
}

/// Until the guard is dropped, plans this thread creates time the heuristic's candidates on their
/// first call and keep the fastest (one host wait per new problem; never inside a capture). For
/// a loop that runs the same few problems thousands of times, such as a training step warmed up
/// before its CUDA-graph capture: Monster Walk's autograd step has 15 small GEMMs whose skinny
/// weight gradients (K = 5041) the heuristic's first choice runs slowly (measured on an H200:
/// 2.18 s untuned, 2.05 s tuned, for the 113 x 71 run).
pub fn tune_new_plans() -> TuneScope {
    TUNING.with(|t| t.set(t.get() + 1));
    TuneScope(())
}

/// Rounds of timing over a new plan's candidates, and launches per timing. The rounds interleave
/// the candidates, so a clock ramp or a burst of other work hits all of them alike. One launch a
/// timing: a training step runs each GEMM once between kernels that depend on it, so what counts
/// is a launch's latency; back-to-back launches measure throughput instead, and for small GEMMs the
/// two rank the candidates differently. Monster Walk's autograd step as a CUDA graph (its 23
/// plans tuned in the warm-up; H200, BENCHMARKS.md "2026-11-25", P12): 3 rounds x 3 launches
/// 2.072-2.159 s, 7 x 1 2.047-2.077 s, 3 x 1 2.031-2.053 s, 5 x 20 2.277-2.345 s, untuned 2.182 s.
const TUNE_ROUNDS: usize = 3;
const TUNE_LAUNCHES: usize = 1;
/// A candidate replaces the heuristic's first choice only when its best time is at least 3%
/// better. Why: one round of three launches a candidate (the first version) picked a plan 8%
/// slower than the heuristic's for the linear forward at 16384 x 3072 -> 768 (H100, tenth
/// session, BENCHMARKS.md "Linear + GELU in parts"), and a plan that is only as fast brings other
/// rounding for nothing.
const TUNE_MARGIN: f32 = 0.97;

/// Time each candidate algorithm of a new plan on this call's own buffers (one warm-up launch,
/// then [`TUNE_ROUNDS`] timings of [`TUNE_LAUNCHES`] launch each, the best kept; the outputs are
/// simply written again by the real launch) and keep the heuristic's first choice unless [`pick`] finds a
/// clearly faster one. This waits for the GPU once per new problem, the way the heuristic itself
/// runs once: never inside a CUDA-graph capture (there the heuristic's first choice stays).
fn tune(dev: &CudaDevice, lt: &LtDevice, plan: &mut Plan, g: &Gemm, ws: (u64, usize)) -> Result<()> {
    // The caller decided whether to tune (`autotune()` or a test): not checked again here.
    if plan.candidates.len() < 2 {
        return Ok(());
    }
    let capturing = dev.stream().capture_status().map_err(|e| driver_err("cuStreamIsCapturing", e))?;
    if capturing != cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
        return Ok(());
    }
    let candidates = plan.candidates.clone();
    // A candidate cuBLASLt refuses to run is left out (nothing was launched).
    let runs: Vec<bool> = candidates.iter().map(|algo| launch(dev, lt, plan, algo, g, ws).is_ok()).collect();
    count(|c| c.tuning_launches += runs.iter().filter(|&&r| r).count() as u64);
    let (start, end) = (Event::timing()?, Event::timing()?);
    let mut best: Vec<Option<f32>> = vec![None; candidates.len()];
    for _ in 0..TUNE_ROUNDS {
        for (i, algo) in candidates.iter().enumerate() {
            if !runs[i] {
                continue;
            }
            start.record(dev.stream())?;
            let timed = (0..TUNE_LAUNCHES).try_for_each(|_| launch(dev, lt, plan, algo, g, ws));
            end.record(dev.stream())?;
            end.synchronize()?;
            count(|c| c.tuning_launches += TUNE_LAUNCHES as u64);
            if timed.is_ok() {
                let ms = start.elapsed_ms(&end)?;
                best[i] = Some(best[i].map_or(ms, |b| b.min(ms)));
            }
        }
    }
    plan.algo = candidates[pick(&best)];
    Ok(())
}

/// Which candidate to keep, from each one's best time (`None`: it did not run): the heuristic's
/// first choice (index 0) unless another is faster by [`TUNE_MARGIN`]; the fastest if the first
/// did not run.
fn pick(best: &[Option<f32>]) -> usize {
    let fastest = best.iter().enumerate().filter_map(|(i, t)| t.map(|t| (i, t))).min_by(|a, b| a.1.total_cmp(&b.1));
    match (best.first().copied().flatten(), fastest) {
        (Some(first), Some((i, t))) if t < TUNE_MARGIN * first => i,
        (None, Some((i, _))) => i,
        _ => 0,
    }
}

/// How many distinct problems have a cached plan (or a cached "no kernel") on `dev`.
pub fn cached_plans(dev: &CudaDevice) -> usize {
    DEVICES.get().and_then(|m| lock(m).get(&dev.ordinal).map(|d| lock(&d.plans).len())).unwrap_or(0)
}
