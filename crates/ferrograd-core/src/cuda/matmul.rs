//! Matmul through cuBLAS (`cublasGemmStridedBatchedEx`). Row-major `C = A B` is computed as the
//! column-major `C^T = B^T A^T`, so a row-major operand is passed untransposed and a transposed
//! view (unit row stride) is passed with `OP_T`: neither is copied. f16/bf16 accumulate in f32;
//! f32 is exact (no TF32) unless the device allows TF32.

use super::device::driver_err;
use super::storage::CudaStorage;
use crate::backend::{BackendStorage, MatmulDims};
use crate::{DType, Error, Layout, Result};
use cudarc::cublas::{result as blas, sys};
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};

/// f32 matmul precision, as PyTorch's `set_float32_matmul_precision`: `Highest` is exact f32,
/// `High` lets the tensor cores use TF32 (10-bit mantissa inputs, f32 accumulation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MatmulPrecision {
    Highest,
    High,
}

static TF32: AtomicBool = AtomicBool::new(false);

pub fn set_matmul_precision(p: MatmulPrecision) {
    TF32.store(p == MatmulPrecision::High, Ordering::Relaxed)
}

pub fn matmul_precision() -> MatmulPrecision {
    if TF32.load(Ordering::Relaxed) {
        MatmulPrecision::High
    } else {
        MatmulPrecision::Highest
    }
}

/// How cuBLAS should read one operand: (pointer, transpose?, leading dim, batch stride).
struct Operand {
    ptr: u64,
    trans: bool,
    ld: i64,
    batch_stride: i64,
    _owned: Option<CudaStorage>,
}

/// The single stride between consecutive matrices of the batch, if the batch dims allow one.
fn batch_stride(l: &Layout) -> Option<i64> {
    let r = l.dims().len();
    let mut stride: Option<(usize, usize)> = None; // (dim, stride) of the innermost non-1 batch dim
    for i in (0..r - 2).rev() {
        let (d, s) = (l.dims()[i], l.strides()[i]);
        if d == 1 {
            continue;
        }
        stride = match stride {
            None => Some((d, s)),
            Some((id, is)) if s == is * id => Some((d * id, is)),
            Some(_) => return None,
        };
    }
    Some(stride.map_or(0, |(_, s)| s as i64))
}

/// `rows x cols` matrices of `s`, as cuBLAS wants them for the given role.
fn operand(s: &CudaStorage, l: &Layout, rows: usize, cols: usize) -> Result<Operand> {
    let r = l.dims().len();
    let (rs, cs) = (l.strides()[r - 2], l.strides()[r - 1]);
    if let Some(bs) = batch_stride(l) {
        let ptr = s.buf.ptr_at(l.offset());
        // A zero row (column) stride with several rows (columns) is a broadcast that cuBLAS's
        // leading dimension cannot express; such operands are copied below.
        if (cs == 1 || cols == 1) && (rs >= cols || rows == 1) {
            let ld = if rows == 1 { cols } else { rs };
            return Ok(Operand { ptr, trans: false, ld: ld.max(1) as i64, batch_stride: bs, _owned: None });
        }
        if (rs == 1 || rows == 1) && (cs >= rows || cols == 1) {
            let ld = if cols == 1 { rows } else { cs };
            return Ok(Operand { ptr, trans: true, ld: ld.max(1) as i64, batch_stride: bs, _owned: None });
        }
    }
    let c = s.copy_strided(l)?;
    Ok(Operand {
        ptr: c.buf.ptr(),
        trans: false,
        ld: cols.max(1) as i64,
        batch_stride: (rows * cols) as i64,
        _owned: Some(c),
    })
}

fn op(t: bool) -> sys::cublasOperation_t {
    if t {
        sys::cublasOperation_t::CUBLAS_OP_T
    } else {
        sys::cublasOperation_t::CUBLAS_OP_N
    }
}

pub fn matmul(a: &CudaStorage, al: &Layout, b: &CudaStorage, bl: &Layout, d: MatmulDims) -> Result<CudaStorage> {
    let dev = a.dev();
    let dtype = a.dtype();
    let MatmulDims { batch, m, n, k } = d;
    let out = CudaStorage::uninit(dev, batch * m * n, dtype)?;
    if batch * m * n == 0 {
        return Ok(out);
    }
    if k == 0 {
        return CudaStorage::full(dev, 0.0, batch * m * n, dtype);
    }
    let (data_type, compute) = match dtype {
        DType::F32 => (
            sys::cudaDataType::CUDA_R_32F,
            if matmul_precision() == MatmulPrecision::High {
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32
            } else {
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F
            },
        ),
        DType::F64 => (sys::cudaDataType::CUDA_R_64F, sys::cublasComputeType_t::CUBLAS_COMPUTE_64F),
        DType::F16 => (sys::cudaDataType::CUDA_R_16F, sys::cublasComputeType_t::CUBLAS_COMPUTE_32F),
        DType::BF16 => (sys::cudaDataType::CUDA_R_16BF, sys::cublasComputeType_t::CUBLAS_COMPUTE_32F),
        other => return Err(Error::UnsupportedDType { op: "matmul", dtype: other }),
    };
    // Column-major view: C^T (n x m) = B^T (n x k) * A^T (k x m).
    let opb = operand(b, bl, k, n)?;
    let opa = operand(a, al, m, k)?;
    let too_big = |v: usize| v > i32::MAX as usize;
    if [m, n, k, batch].into_iter().any(too_big) {
        return Err(Error::InvalidArgument(format!("matmul dims {d:?} exceed cuBLAS's 32-bit sizes")));
    }
    let (one32, zero32, one64, zero64) = (1f32, 0f32, 1f64, 0f64);
    let (alpha, beta): (*const c_void, *const c_void) = if dtype == DType::F64 {
        (&one64 as *const f64 as _, &zero64 as *const f64 as _)
    } else {
        (&one32 as *const f32 as _, &zero32 as *const f32 as _)
    };
    dev.ctx.bind_to_thread().map_err(|e| driver_err("cuCtxSetCurrent", e))?;
    let blas_handle = dev.blas.lock().unwrap_or_else(|e| e.into_inner());
    // SAFETY: pointers address live buffers holding `batch` matrices at the given strides and
    // leading dims (checked by `operand`); alpha/beta live until the call returns.
    unsafe {
        blas::gemm_strided_batched_ex(
            *blas_handle.handle(),
            op(opb.trans),
            op(opa.trans),
            n as i32,
            m as i32,
            k as i32,
            alpha,
            opb.ptr as *const c_void,
            data_type,
            opb.ld as i32,
            opb.batch_stride,
            opa.ptr as *const c_void,
            data_type,
            opa.ld as i32,
            opa.batch_stride,
            beta,
            out.buf.ptr() as *mut c_void,
            data_type,
            n as i32,
            (m * n) as i64,
            batch as i32,
            compute,
            sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| driver_err("cublasGemmStridedBatchedEx", e))?;
    Ok(out)
}
