//! Matmul through cuBLAS (`cublasGemmStridedBatchedEx`). Row-major `C = A B` is computed as the
//! column-major `C^T = B^T A^T`, so a row-major operand is passed untransposed and a transposed
//! view (unit row stride) is passed with `OP_T`: neither is copied. f16/bf16 accumulate in f32;
//! f32 is exact (no TF32) unless the device allows TF32.
//!
//! Each device has one cuBLAS handle ([`Blas`]), bound at each call to the thread's current
//! stream, with a workspace of our own per stream (`cublasSetWorkspace`): cuBLAS then never
//! allocates by itself, which a CUDA-graph capture would forbid, and work on two streams never
//! shares scratch memory.

use super::alloc::{Allocation, StreamId};
use super::device::{driver_err, CudaDevice};
use super::storage::CudaStorage;
use super::stream::{current_slot, StreamTable, COMPUTE_SLOT};
use crate::backend::{BackendStorage, MatmulDims};
use crate::{DType, Error, Layout, Result};
use cudarc::cublas::{result as blas, sys, CudaBlas};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};

/// f32 matmul precision, as PyTorch's `set_float32_matmul_precision`: `Highest` is exact f32,
/// `High` lets the tensor cores use TF32 (10-bit mantissa inputs, f32 accumulation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MatmulPrecision {
    /// Exact f32 (`"highest"`).
    Highest,
    /// TF32 tensor cores (`"high"`).
    High,
}

/// The process-wide default that devices take when they open.
static TF32: AtomicBool = AtomicBool::new(false);

pub(crate) fn default_tf32() -> bool {
    TF32.load(Ordering::Relaxed)
}

/// Sets the process default and the policy of every device opened so far (what
/// `torch.set_float32_matmul_precision` does); `CudaDevice::set_matmul_precision` sets one device.
pub fn set_matmul_precision(p: MatmulPrecision) {
    TF32.store(p == MatmulPrecision::High, Ordering::Relaxed);
    for d in super::device::opened_devices() {
        d.set_matmul_precision(p);
    }
}

/// The process default (devices may differ; see `CudaDevice::matmul_precision`).
pub fn matmul_precision() -> MatmulPrecision {
    precision(TF32.load(Ordering::Relaxed))
}

fn precision(tf32: bool) -> MatmulPrecision {
    if tf32 {
        MatmulPrecision::High
    } else {
        MatmulPrecision::Highest
    }
}

impl CudaDevice {
    /// This device's f32 matmul precision.
    pub fn matmul_precision(&self) -> MatmulPrecision {
        precision(self.tf32.load(Ordering::Relaxed))
    }

    /// Sets this device's f32 matmul precision (other devices keep theirs).
    pub fn set_matmul_precision(&self, p: MatmulPrecision) {
        self.tf32.store(p == MatmulPrecision::High, Ordering::Relaxed)
    }
}

/// A device's cuBLAS handle, the stream slot it is bound to, and a workspace per stream.
pub(crate) struct Blas {
    handle: CudaBlas,
    bound: Option<usize>,
    workspace_bytes: usize,
    /// Never freed: a stream's workspace lives as long as the device, like the stream itself.
    workspaces: HashMap<usize, Allocation>,
}

impl Blas {
    pub(crate) fn new(streams: &StreamTable, compute_capability: (i32, i32)) -> Result<Blas> {
        // SAFETY: cuBLAS needs its library; check before cudarc would panic on a missing one.
        if !unsafe { sys::is_culib_present() } {
            return Err(Error::CudaUnavailable { reason: "libcublas was not found".into() });
        }
        let compute = streams.get(COMPUTE_SLOT).ok_or_else(|| Error::Cuda("no compute stream".into()))?;
        let handle = CudaBlas::new(compute.clone()).map_err(|e| driver_err("cublasCreate", e))?;
        // cuBLAS's own default sizes (32 MiB from Hopper on, 4 MiB before), so that it picks the
        // same kernels as with its internal workspace.
        let workspace_bytes = if compute_capability.0 >= 9 { 32 << 20 } else { 4 << 20 };
        Ok(Blas { handle, bound: None, workspace_bytes, workspaces: HashMap::new() })
    }

    /// The handle, bound to `dev`'s current stream with that stream's workspace.
    fn bind(&mut self, dev: &CudaDevice) -> Result<sys::cublasHandle_t> {
        let slot = current_slot(dev.ordinal);
        let handle = *self.handle.handle();
        if self.bound == Some(slot) {
            return Ok(handle);
        }
        if !self.workspaces.contains_key(&slot) {
            let a = dev.allocator().allocate_shared(self.workspace_bytes, StreamId(slot as u64))?;
            self.workspaces.insert(slot, a);
        }
        let ws = self.workspaces.get(&slot).map_or(0, |a| a.ptr());
        // SAFETY: the stream and the workspace live as long as the device; setting the stream
        // resets cuBLAS to its internal workspace, so ours is set again right after.
        unsafe {
            blas::set_stream(handle, dev.stream().cu_stream() as _).map_err(|e| driver_err("cublasSetStream", e))?;
            sys::cublasSetWorkspace_v2(handle, ws as *mut c_void, self.workspace_bytes)
                .result()
                .map_err(|e| driver_err("cublasSetWorkspace", e))?;
        }
        self.bound = Some(slot);
        Ok(handle)
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
            if dev.matmul_precision() == MatmulPrecision::High {
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
    let mut blas_state = dev.blas.lock().unwrap_or_else(|e| e.into_inner());
    let handle = blas_state.bind(dev)?;
    let _nvtx = super::nvtx::range_with(|| format!("cublas_gemm {dtype} b{batch} {m}x{n}x{k}"));
    let span = super::profile::begin(dev, || format!("cublas_gemm {dtype} b{batch} {m}x{n}x{k}"));
    // SAFETY: pointers address live buffers holding `batch` matrices at the given strides and
    // leading dims (checked by `operand`); alpha/beta live until the call returns.
    unsafe {
        blas::gemm_strided_batched_ex(
            handle,
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
    if let Some(span) = span {
        span.end(dev);
    }
    Ok(out)
}
