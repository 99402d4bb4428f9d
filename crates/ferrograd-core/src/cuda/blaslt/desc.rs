//! Owned cuBLASLt descriptors (matmul, matrix layout, preference) that destroy themselves, and the
//! typed setters the plans use. Everything here is host-side bookkeeping: no call in this file
//! touches the GPU or a stream.

use crate::{Error, Result};
use cudarc::cublaslt::result::{self as lt, CublasError};
use cudarc::cublaslt::sys;
use std::ffi::c_void;

pub(super) fn lt_err(what: &str, e: CublasError) -> Error {
    Error::Cuda(format!("{what}: {e:?}"))
}

/// Whether a status means "this problem has no kernel" (the caller falls back) rather than a failure.
pub(super) fn unsupported(e: &CublasError) -> bool {
    matches!(e.0, sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED | sys::cublasStatus_t::CUBLAS_STATUS_INVALID_VALUE)
}

pub(super) struct MatmulDesc(pub(super) sys::cublasLtMatmulDesc_t);

impl MatmulDesc {
    pub(super) fn new(compute: sys::cublasComputeType_t) -> Result<Self> {
        // Scale type f32 for every dtype we send (alpha/beta are f32 host values).
        lt::create_matmul_desc(compute, sys::cudaDataType::CUDA_R_32F)
            .map(MatmulDesc)
            .map_err(|e| lt_err("cublasLtMatmulDescCreate", e))
    }

    /// Set one attribute to a plain value.
    pub(super) fn set<T: Copy>(&self, attr: sys::cublasLtMatmulDescAttributes_t, v: T) -> Result<()> {
        // SAFETY: the descriptor is alive (owned by self); `v` is the attribute's documented type
        // (each call site passes the C type the attribute takes) and lives for the call.
        unsafe {
            lt::set_matmul_desc_attribute(self.0, attr, &v as *const T as *const c_void, std::mem::size_of::<T>())
        }
        .map_err(|e| lt_err(&format!("cublasLtMatmulDescSetAttribute({attr:?})"), e))
    }
}

impl Drop for MatmulDesc {
    fn drop(&mut self) {
        // SAFETY: created by cublasLtMatmulDescCreate and destroyed once, here.
        let _ = unsafe { lt::destroy_matmul_desc(self.0) };
    }
}

pub(super) struct MatrixLayout(pub(super) sys::cublasLtMatrixLayout_t);

impl MatrixLayout {
    /// A column-major `rows x cols` matrix with leading dimension `ld`.
    pub(super) fn new(dtype: sys::cudaDataType, rows: usize, cols: usize, ld: usize) -> Result<Self> {
        lt::create_matrix_layout(dtype, rows as u64, cols as u64, ld as i64)
            .map(MatrixLayout)
            .map_err(|e| lt_err("cublasLtMatrixLayoutCreate", e))
    }
}

impl Drop for MatrixLayout {
    fn drop(&mut self) {
        // SAFETY: created by cublasLtMatrixLayoutCreate and destroyed once, here.
        let _ = unsafe { lt::destroy_matrix_layout(self.0) };
    }
}

pub(super) struct Preference(pub(super) sys::cublasLtMatmulPreference_t);

impl Preference {
    pub(super) fn new() -> Result<Self> {
        lt::create_matmul_pref().map(Preference).map_err(|e| lt_err("cublasLtMatmulPreferenceCreate", e))
    }

    pub(super) fn set<T: Copy>(&self, attr: sys::cublasLtMatmulPreferenceAttributes_t, v: T) -> Result<()> {
        // SAFETY: as MatmulDesc::set.
        unsafe {
            lt::set_matmul_pref_attribute(self.0, attr, &v as *const T as *const c_void, std::mem::size_of::<T>())
        }
        .map_err(|e| lt_err(&format!("cublasLtMatmulPreferenceSetAttribute({attr:?})"), e))
    }
}

impl Drop for Preference {
    fn drop(&mut self) {
        // SAFETY: created by cublasLtMatmulPreferenceCreate and destroyed once, here.
        let _ = unsafe { lt::destroy_matmul_pref(self.0) };
    }
}
