//! int8 x int8 -> int32 matmul through cuBLASLt's IMMA kernels (`CUBLAS_COMPUTE_32I`, alpha and
//! beta int32, as PyTorch's `torch._int_mm`). Stated in cuBLASLt's column-major terms in the one
//! form every IMMA kernel takes with the plain column order, "TN": `D (m x n, i32) = A^T B` with A
//! stored `k x m` and B stored `k x n` (each column `k` contiguous int8). A row-major caller
//! computing `C [M, N] = X [M, K] W [N, K]^T` passes `m = N, A = W, n = M, B = X`.
//!
//! Plans (descriptors and the heuristic's algorithm) are cached per problem as the float plans
//! are, in their own table; the handle and the per-stream workspace are the float path's.

use super::desc::{lt_err, unsupported, MatmulDesc, MatrixLayout, Preference};
use super::plan::alignment;
use super::{count, lock, lt_device, workspace};
use crate::cuda::device::{driver_err, CudaDevice};
use crate::{Error, Result};
use cudarc::cublaslt::{result as lt, sys};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

/// One `D = A^T B` (int8 in, int32 out), column-major, leading dimensions in elements.
#[derive(Clone, Copy, Debug)]
pub(crate) struct GemmI8 {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    /// `k x m` int8, leading dimension `lda >= k`.
    pub a: u64,
    pub lda: usize,
    /// `k x n` int8, leading dimension `ldb >= k`.
    pub b: u64,
    pub ldb: usize,
    /// `m x n` int32, leading dimension `ldd >= m`.
    pub d: u64,
    pub ldd: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Key {
    ordinal: usize,
    m: usize,
    n: usize,
    k: usize,
    lda: usize,
    ldb: usize,
    ldd: usize,
    align: [u16; 3],
}

struct PlanI8 {
    desc: MatmulDesc,
    a: MatrixLayout,
    b: MatrixLayout,
    d: MatrixLayout,
    algo: sys::cublasLtMatmulAlgo_t,
}

// SAFETY: host-side descriptors, used only under the table's mutex (as `plan::Plan`).
unsafe impl Send for PlanI8 {}

static PLANS: OnceLock<Mutex<HashMap<Key, Option<PlanI8>>>> = OnceLock::new();

fn new_plan(handle: sys::cublasLtHandle_t, g: &GemmI8, key: &Key, ws: usize) -> Result<Option<PlanI8>> {
    use sys::cublasLtMatmulDescAttributes_t as D;
    use sys::cublasLtMatmulPreferenceAttributes_t as P;
    use sys::cudaDataType as T;
    let desc = lt::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32I, T::CUDA_R_32I)
        .map(MatmulDesc)
        .map_err(|e| lt_err("cublasLtMatmulDescCreate(32I)", e))?;
    desc.set(D::CUBLASLT_MATMUL_DESC_TRANSA, 1i32)?;
    desc.set(D::CUBLASLT_MATMUL_DESC_TRANSB, 0i32)?;
    let a = MatrixLayout::new(T::CUDA_R_8I, g.k, g.m, g.lda)?;
    let b = MatrixLayout::new(T::CUDA_R_8I, g.k, g.n, g.ldb)?;
    let d = MatrixLayout::new(T::CUDA_R_32I, g.m, g.n, g.ldd)?;
    let pref = Preference::new()?;
    pref.set(P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, ws as u64)?;
    let [aa, ab, ad] = key.align;
    pref.set(P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, aa as u32)?;
    pref.set(P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, ab as u32)?;
    pref.set(P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, ad as u32)?;
    pref.set(P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, ad as u32)?;
    count(|c| c.heuristic_calls += 1);
    let mut result = sys::cublasLtMatmulHeuristicResult_t {
        algo: sys::cublasLtMatmulAlgo_t { data: [0; 8] },
        workspaceSize: 0,
        state: sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS,
        wavesCount: 0.0,
        reserved: [0; 4],
    };
    let mut found = 0i32;
    // SAFETY: the descriptors are alive for the call; C is D (beta = 0); one result slot.
    let status = unsafe {
        sys::cublasLtMatmulAlgoGetHeuristic(handle, desc.0, a.0, b.0, d.0, d.0, pref.0, 1, &mut result, &mut found)
    }
    .result();
    match status {
        Ok(()) => {}
        Err(e) if unsupported(&e) => return Ok(None),
        Err(e) => return Err(lt_err("cublasLtMatmulAlgoGetHeuristic(int8)", e)),
    }
    if found < 1 || result.state != sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS || result.workspaceSize > ws {
        return Ok(None);
    }
    Ok(Some(PlanI8 { desc, a, b, d, algo: result.algo }))
}

/// Enqueue `g` on the current stream. `Ok(false)`: cuBLASLt has no IMMA kernel for this problem
/// (a leading dimension or pointer not a multiple of 4, say); nothing was launched.
pub(crate) fn gemm_i8(dev: &Arc<CudaDevice>, g: &GemmI8) -> Result<bool> {
    if g.m == 0 || g.n == 0 || g.k == 0 || g.lda < g.k || g.ldb < g.k || g.ldd < g.m {
        return Err(Error::InvalidArgument(format!(
            "cublasLt int8 matmul {g:?}: empty or leading dimension too small"
        )));
    }
    let lt = lt_device(dev)?;
    let (ws_ptr, ws_bytes) = workspace(dev, &lt)?;
    let key = Key {
        ordinal: dev.ordinal,
        m: g.m,
        n: g.n,
        k: g.k,
        lda: g.lda,
        ldb: g.ldb,
        ldd: g.ldd,
        align: [alignment(g.a), alignment(g.b), alignment(g.d)],
    };
    dev.ctx.bind_to_thread().map_err(|e| driver_err("cuCtxSetCurrent", e))?;
    let mut plans = lock(PLANS.get_or_init(Default::default));
    let plan = match plans.entry(key) {
        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
        std::collections::hash_map::Entry::Vacant(e) => e.insert(new_plan(lt.handle, g, &key, ws_bytes)?),
    };
    let Some(plan) = plan.as_ref() else {
        count(|c| c.no_kernel += 1);
        return Ok(false);
    };
    let (alpha, beta) = (1i32, 0i32);
    // SAFETY: the plan was built for exactly this key (shapes, leading dims, alignments); the
    // caller guarantees the pointers address live device buffers of those shapes; the workspace
    // is this stream's own and within the size the heuristic was capped at; alpha and beta are
    // int32 (the scale type of the descriptor) and outlive the call.
    unsafe {
        lt::matmul(
            lt.handle,
            plan.desc.0,
            &alpha as *const i32 as *const c_void,
            &beta as *const i32 as *const c_void,
            g.a as *const c_void,
            plan.a.0,
            g.b as *const c_void,
            plan.b.0,
            g.d as *const c_void,
            plan.d.0,
            g.d as *mut c_void,
            plan.d.0,
            &plan.algo,
            ws_ptr as *mut c_void,
            ws_bytes,
            dev.stream().cu_stream() as sys::cudaStream_t,
        )
    }
    .map_err(|e| lt_err("cublasLtMatmul(int8)", e))?;
    count(|c| c.launches += 1);
    Ok(true)
}
