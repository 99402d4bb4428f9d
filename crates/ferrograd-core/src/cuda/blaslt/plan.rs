//! A cached matmul plan: the descriptors of one problem and the algorithm the heuristic chose for
//! it. Built once per [`PlanKey`]; every later call with the same key only points the descriptor
//! at the call's bias/aux buffers and launches.

use super::desc::{lt_err, unsupported, MatmulDesc, MatrixLayout, Preference};
use super::{Epilogue, Gemm};
use crate::cuda::{matmul_precision, MatmulPrecision};
use crate::{DType, Error, Result};
use cudarc::cublaslt::sys::{self, cublasLtMatmulDescAttributes_t as D, cublasLtMatmulPreferenceAttributes_t as P};

/// Everything the heuristic's answer may depend on. Pointers are not part of it, their alignment
/// is: the heuristic assumes the alignment it is told, and a kernel chosen for 16-byte aligned rows
/// must not be launched on a 2-byte aligned view.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct PlanKey {
    dtype: DType,
    d_dtype: DType,
    tf32: bool,
    epilogue: Epilogue,
    m: usize,
    n: usize,
    k: usize,
    trans_a: bool,
    trans_b: bool,
    lda: usize,
    ldb: usize,
    ldd: usize,
    ld_aux: usize,
    /// Alignments (bytes, a power of two up to 256) of A, B, D, the bias and the aux buffer.
    align: [u16; 5],
}

/// The largest power of two (at most 256) that divides `ptr`.
pub(super) fn alignment(ptr: u64) -> u16 {
    if ptr == 0 {
        256
    } else {
        1u16 << ptr.trailing_zeros().min(8)
    }
}

impl PlanKey {
    pub(super) fn of(g: &Gemm) -> PlanKey {
        PlanKey {
            dtype: g.dtype,
            d_dtype: g.d_dtype,
            tf32: g.dtype == DType::F32 && matmul_precision() == MatmulPrecision::High,
            epilogue: g.epilogue,
            m: g.m,
            n: g.n,
            k: g.k,
            trans_a: g.a.trans,
            trans_b: g.b.trans,
            lda: g.a.ld,
            ldb: g.b.ld,
            ldd: g.d.ld,
            ld_aux: g.aux.map_or(0, |a| a.ld),
            align: [
                alignment(g.a.ptr),
                alignment(g.b.ptr),
                alignment(g.d.ptr),
                alignment(g.bias.unwrap_or(0)),
                alignment(g.aux.map_or(0, |a| a.ptr)),
            ],
        }
    }
}

/// How many algorithms the heuristic is asked for (best first); autotuning times them all.
pub(super) const CANDIDATES: usize = 8;

/// One problem's descriptors and algorithm.
pub(super) struct Plan {
    pub(super) desc: MatmulDesc,
    pub(super) a: MatrixLayout,
    pub(super) b: MatrixLayout,
    pub(super) d: MatrixLayout,
    /// The algorithm every launch uses: the heuristic's first, or the fastest once tuned.
    pub(super) algo: sys::cublasLtMatmulAlgo_t,
    /// The heuristic's answers, best first (`algo` is one of them).
    pub(super) candidates: Vec<sys::cublasLtMatmulAlgo_t>,
}

// SAFETY: the descriptors are host-side objects that cuBLASLt never touches concurrently on its
// own; every use goes through the per-device mutex that owns the plan.
unsafe impl Send for Plan {}

fn data_type(dtype: DType) -> Result<(sys::cudaDataType, sys::cublasComputeType_t)> {
    use sys::cublasComputeType_t as C;
    use sys::cudaDataType as T;
    Ok(match dtype {
        DType::F32 if matmul_precision() == MatmulPrecision::High => (T::CUDA_R_32F, C::CUBLAS_COMPUTE_32F_FAST_TF32),
        DType::F32 => (T::CUDA_R_32F, C::CUBLAS_COMPUTE_32F),
        DType::F16 => (T::CUDA_R_16F, C::CUBLAS_COMPUTE_32F),
        DType::BF16 => (T::CUDA_R_16BF, C::CUBLAS_COMPUTE_32F),
        other => return Err(Error::UnsupportedDType { op: "cublasLt matmul", dtype: other }),
    })
}

fn epilogue(e: Epilogue) -> sys::cublasLtEpilogue_t {
    use sys::cublasLtEpilogue_t as E;
    match e {
        Epilogue::Default => E::CUBLASLT_EPILOGUE_DEFAULT,
        Epilogue::Bias => E::CUBLASLT_EPILOGUE_BIAS,
        Epilogue::Relu => E::CUBLASLT_EPILOGUE_RELU,
        Epilogue::ReluBias => E::CUBLASLT_EPILOGUE_RELU_BIAS,
        Epilogue::Gelu => E::CUBLASLT_EPILOGUE_GELU,
        Epilogue::GeluBias => E::CUBLASLT_EPILOGUE_GELU_BIAS,
        Epilogue::GeluAux => E::CUBLASLT_EPILOGUE_GELU_AUX,
        Epilogue::GeluAuxBias => E::CUBLASLT_EPILOGUE_GELU_AUX_BIAS,
        Epilogue::DGelu => E::CUBLASLT_EPILOGUE_DGELU,
        Epilogue::DGeluBGrad => E::CUBLASLT_EPILOGUE_DGELU_BGRAD,
        Epilogue::BGradB => E::CUBLASLT_EPILOGUE_BGRADB,
        Epilogue::BGradA => E::CUBLASLT_EPILOGUE_BGRADA,
    }
}

/// cublasOperation_t as the descriptor stores it (an int: CUBLAS_OP_N = 0, CUBLAS_OP_T = 1).
fn op(trans: bool) -> i32 {
    trans as i32
}

impl Plan {
    /// Point the descriptor at this call's bias and aux buffers (host-side; the algorithm stays).
    pub(super) fn bind(&self, g: &Gemm) -> Result<()> {
        if let Some(bias) = g.bias {
            self.desc.set(D::CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias)?;
        }
        if let Some(aux) = g.aux {
            self.desc.set(D::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, aux.ptr)?;
        }
        Ok(())
    }

    /// Build the descriptors for `g` and ask the heuristic for its best algorithm within
    /// `workspace` bytes. `Ok(None)`: cuBLASLt has no kernel for this problem.
    pub(super) fn new(
        handle: sys::cublasLtHandle_t,
        g: &Gemm,
        key: &PlanKey,
        workspace: usize,
    ) -> Result<Option<Plan>> {
        let (ty, compute) = data_type(g.dtype)?;
        // D (and the bias, whose type defaults to D's) in f32 under the same f32 compute type.
        let (d_ty, _) = if g.d_dtype == g.dtype { (ty, compute) } else { data_type(g.d_dtype)? };
        let desc = MatmulDesc::new(compute)?;
        desc.set(D::CUBLASLT_MATMUL_DESC_TRANSA, op(g.a.trans))?;
        desc.set(D::CUBLASLT_MATMUL_DESC_TRANSB, op(g.b.trans))?;
        desc.set(D::CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue(g.epilogue))?;
        if let Some(aux) = g.aux {
            desc.set(D::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, aux.ld as i64)?;
        }
        let plan = Plan {
            a: if g.a.trans {
                MatrixLayout::new(ty, g.k, g.m, g.a.ld)?
            } else {
                MatrixLayout::new(ty, g.m, g.k, g.a.ld)?
            },
            b: if g.b.trans {
                MatrixLayout::new(ty, g.n, g.k, g.b.ld)?
            } else {
                MatrixLayout::new(ty, g.k, g.n, g.b.ld)?
            },
            d: MatrixLayout::new(d_ty, g.m, g.n, g.d.ld)?,
            desc,
            algo: sys::cublasLtMatmulAlgo_t { data: [0; 8] },
            candidates: vec![],
        };
        plan.bind(g)?;
        let pref = Preference::new()?;
        pref.set(P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, workspace as u64)?;
        let [aa, ab, ad, _, _] = key.align;
        pref.set(P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, aa as u32)?;
        pref.set(P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, ab as u32)?;
        pref.set(P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, ad as u32)?;
        pref.set(P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, ad as u32)?;
        if matches!(g.d_dtype, DType::F16 | DType::BF16) {
            // Split-K partial sums of a half-precision product are reduced in f32 (COMPUTE_TYPE)
            // or in place, never in the output type, which would round every partial to the
            // output's 8 or 11 bits (PyTorch's allow_bf16_reduced_precision_reduction = False).
            // f32 outputs (f32 products, and f16/bf16 products written in f32) are their own compute
            // type: every scheme stays allowed there (the skinny weight gradients of small MLPs
            // need split-K to fill the chip).
            let schemes = sys::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_NONE as u32
                | sys::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_INPLACE as u32
                | sys::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE as u32;
            pref.set(P::CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, schemes)?;
        }
        super::count(|c| c.heuristic_calls += 1);
        let mut results = [sys::cublasLtMatmulHeuristicResult_t {
            algo: sys::cublasLtMatmulAlgo_t { data: [0; 8] },
            workspaceSize: 0,
            state: sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS,
            wavesCount: 0.0,
            reserved: [0; 4],
        }; CANDIDATES];
        let mut found = 0i32;
        // SAFETY: every descriptor is alive for the call; C is D (beta = 0, C unread); the result
        // array holds CANDIDATES entries and `found` receives how many were written.
        let status = unsafe {
            sys::cublasLtMatmulAlgoGetHeuristic(
                handle,
                plan.desc.0,
                plan.a.0,
                plan.b.0,
                plan.d.0,
                plan.d.0,
                pref.0,
                CANDIDATES as i32,
                results.as_mut_ptr(),
                &mut found,
            )
        }
        .result();
        match status {
            Ok(()) => {}
            Err(e) if unsupported(&e) => return Ok(None),
            Err(e) => return Err(lt_err("cublasLtMatmulAlgoGetHeuristic", e)),
        }
        let candidates: Vec<_> = results[..found.clamp(0, CANDIDATES as i32) as usize]
            .iter()
            .filter(|r| r.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS && r.workspaceSize <= workspace)
            .map(|r| r.algo)
            .collect();
        match candidates.first() {
            Some(&algo) => Ok(Some(Plan { algo, candidates, ..plan })),
            None => Ok(None),
        }
    }
}
