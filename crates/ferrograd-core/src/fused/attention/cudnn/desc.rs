//! Owned cuDNN backend descriptors with typed attribute setters, and tensor descriptors.
//! Host-side bookkeeping only: nothing here touches the GPU. A tensor gets the attributes
//! cudnn-frontend sets (`cudnn_frontend_Tensor.h`), no more.

use super::lib::{CudnnLib, Descriptor};
use crate::Result;
use cudarc::cudnn::sys::{
    cudnnBackendAttributeName_t as A, cudnnBackendAttributeType_t as T, cudnnBackendDescriptorType_t as D,
    cudnnDataType_t,
};
use std::ffi::c_void;

/// A backend descriptor, destroyed with its owner.
pub(super) struct Desc {
    lib: &'static CudnnLib,
    pub(super) raw: Descriptor,
    what: &'static str,
}

// SAFETY: a descriptor is plain host memory owned by this value; cuDNN allows using descriptors
// from any thread, and every mutation goes through `&mut`-free calls made under the plan cache's
// lock or on finalized, read-only descriptors (execution).
unsafe impl Send for Desc {}
unsafe impl Sync for Desc {}

impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: created by `Desc::new`, destroyed once, here.
        unsafe { self.lib.destroy_descriptor(self.raw) }
    }
}

impl Desc {
    pub(super) fn new(lib: &'static CudnnLib, ty: D, what: &'static str) -> Result<Desc> {
        Ok(Desc { lib, raw: lib.create_descriptor(ty)?, what })
    }

    fn set_raw(&self, name: A, ty: T, count: usize, data: *const c_void) -> Result<()> {
        // SAFETY: every caller below passes `count` elements of the C type `ty` names, alive for
        // the call (cuDNN copies attribute values).
        unsafe { self.lib.set_attribute(self.raw, name, ty, count as i64, data) }
    }

    pub(super) fn i64s(&self, name: A, v: &[i64]) -> Result<()> {
        self.set_raw(name, T::CUDNN_TYPE_INT64, v.len(), v.as_ptr() as *const c_void)
    }

    pub(super) fn i64(&self, name: A, v: i64) -> Result<()> {
        self.i64s(name, &[v])
    }

    pub(super) fn boolean(&self, name: A, v: bool) -> Result<()> {
        // CUDNN_TYPE_BOOLEAN is C's `bool` (one byte), as Rust's.
        self.set_raw(name, T::CUDNN_TYPE_BOOLEAN, 1, &v as *const bool as *const c_void)
    }

    pub(super) fn f64(&self, name: A, v: f64) -> Result<()> {
        self.set_raw(name, T::CUDNN_TYPE_DOUBLE, 1, &v as *const f64 as *const c_void)
    }

    pub(super) fn f32(&self, name: A, v: f32) -> Result<()> {
        self.set_raw(name, T::CUDNN_TYPE_FLOAT, 1, &v as *const f32 as *const c_void)
    }

    pub(super) fn dtype(&self, name: A, v: cudnnDataType_t) -> Result<()> {
        let v = v as u32;
        self.set_raw(name, T::CUDNN_TYPE_DATA_TYPE, 1, &v as *const u32 as *const c_void)
    }

    /// An enum-valued attribute (`ty` names the enum; C enums are 32-bit).
    pub(super) fn enum32(&self, name: A, ty: T, v: u32) -> Result<()> {
        self.set_raw(name, ty, 1, &v as *const u32 as *const c_void)
    }

    pub(super) fn descs(&self, name: A, v: &[&Desc]) -> Result<()> {
        let raw: Vec<Descriptor> = v.iter().map(|d| d.raw).collect();
        self.set_raw(name, T::CUDNN_TYPE_BACKEND_DESCRIPTOR, raw.len(), raw.as_ptr() as *const c_void)
    }

    pub(super) fn desc(&self, name: A, v: &Desc) -> Result<()> {
        self.descs(name, &[v])
    }

    pub(super) fn handle(&self, name: A, h: super::lib::Handle) -> Result<()> {
        self.set_raw(name, T::CUDNN_TYPE_HANDLE, 1, &h as *const super::lib::Handle as *const c_void)
    }

    /// A char-array attribute (a plan's JSON: `count` bytes, no terminator needed).
    pub(super) fn chars(&self, name: A, v: &[u8]) -> Result<()> {
        self.set_raw(name, T::CUDNN_TYPE_CHAR, v.len(), v.as_ptr() as *const c_void)
    }

    pub(super) fn void_ptrs(&self, name: A, v: &[*mut c_void]) -> Result<()> {
        self.set_raw(name, T::CUDNN_TYPE_VOID_PTR, v.len(), v.as_ptr() as *const c_void)
    }

    pub(super) fn finalize(self) -> Result<Desc> {
        self.lib.finalize(self.raw, self.what)?;
        Ok(self)
    }
}

/// A tensor of the graph: its uid, dtype, dims and strides (elements), and whether it lives only
/// inside the fused kernel (virtual) or is a host scalar passed by value.
#[derive(Clone, Debug)]
pub(super) struct TensorSpec {
    pub uid: i64,
    pub dtype: cudnnDataType_t,
    pub dims: Vec<i64>,
    pub strides: Vec<i64>,
    pub is_virtual: bool,
    pub by_value: bool,
}

impl TensorSpec {
    pub(super) fn build(&self, lib: &'static CudnnLib) -> Result<Desc> {
        let t = Desc::new(lib, D::CUDNN_BACKEND_TENSOR_DESCRIPTOR, "tensor")?;
        t.dtype(A::CUDNN_ATTR_TENSOR_DATA_TYPE, self.dtype)?;
        t.i64s(A::CUDNN_ATTR_TENSOR_DIMENSIONS, &self.dims)?;
        t.i64s(A::CUDNN_ATTR_TENSOR_STRIDES, &self.strides)?;
        t.i64(A::CUDNN_ATTR_TENSOR_UNIQUE_ID, self.uid)?;
        t.i64(A::CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, 16)?;
        if self.is_virtual {
            t.boolean(A::CUDNN_ATTR_TENSOR_IS_VIRTUAL, true)?;
        }
        if self.by_value {
            t.boolean(A::CUDNN_ATTR_TENSOR_IS_BY_VALUE, true)?;
        }
        t.finalize()
    }
}
