//! Launches of `kernels/index.cu`: index_select, gather and their adjoints index_add, scatter_add.

use super::same_dtype;
use crate::cpu::index::check_gather;
use crate::cuda::klayout::KLayout;
use crate::cuda::launch::{cfg_1d, launch, width_suffix};
use crate::cuda::modules;
use crate::cuda::storage::CudaStorage;
use crate::{DType, Error, Layout, Result, WithDType};

/// (outer, size, inner) of `dims` around `dim`.
fn split_at(dims: &[usize], dim: usize) -> (usize, usize, usize) {
    (dims[..dim].iter().product(), dims[dim], dims[dim + 1..].iter().product())
}

pub(super) fn index_select(
    s: &CudaStorage,
    l: &Layout,
    ids: &CudaStorage,
    il: &Layout,
    dim: usize,
) -> Result<CudaStorage> {
    let (outer, size, inner) = split_at(l.dims(), dim);
    let idx = checked_ids(ids, il, size, "index_select")?;
    let (x, _k) = s.contiguous_ptr(l)?;
    let n = outer * idx.len() * inner;
    let dev = s.dev();
    let out = CudaStorage::uninit(dev, n, s.dtype())?;
    if n > 0 {
        launch!(dev, modules::INDEX, format!("index_select_{}", width_suffix(s.dtype())), cfg_1d(dev, n);
            x, idx.buf.ptr(), out.buf.ptr(), outer as u64, size as u64, inner as u64, idx.len() as u64);
    }
    Ok(out)
}

pub(super) fn gather(s: &CudaStorage, l: &Layout, ids: &CudaStorage, il: &Layout, dim: usize) -> Result<CudaStorage> {
    check_gather("gather", l.dims(), il.dims(), dim)?;
    let idx = checked_ids(ids, il, l.dims()[dim], "gather")?;
    let n = il.elem_count();
    let dev = s.dev();
    let out = CudaStorage::uninit(dev, n, s.dtype())?;
    if n > 0 {
        launch!(dev, modules::INDEX, format!("gather_{}", width_suffix(s.dtype())), cfg_1d(dev, n);
            KLayout::exact(l)?, s.buf.ptr(), KLayout::exact(&Layout::contiguous(il.shape().clone()))?,
            idx.buf.ptr(), out.buf.ptr(), n as u64, dim as u32);
    }
    Ok(out)
}

pub(super) fn index_add(
    s: &CudaStorage,
    l: &Layout,
    ids: &CudaStorage,
    il: &Layout,
    src: &CudaStorage,
    sl: &Layout,
    dim: usize,
) -> Result<CudaStorage> {
    same_dtype("index_add", s, src)?;
    atomic_dtype("index_add", s.dtype())?;
    let (outer, size, inner) = split_at(l.dims(), dim);
    let idx = checked_ids(ids, il, size, "index_add")?;
    let mut want = l.dims().to_vec();
    want[dim] = idx.len();
    if sl.dims() != want.as_slice() {
        return Err(Error::ShapeMismatch { op: "index_add", lhs: want, rhs: sl.dims().to_vec() });
    }
    let out = super::copy::copy_strided(s, l)?;
    let (sp, _k) = src.contiguous_ptr(sl)?;
    let n = sl.elem_count();
    let dev = s.dev();
    if n > 0 {
        launch!(dev, modules::INDEX, format!("index_add_{}", s.dtype()), cfg_1d(dev, n);
            out.buf.ptr(), idx.buf.ptr(), sp, outer as u64, size as u64, inner as u64, idx.len() as u64);
    }
    Ok(out)
}

pub(super) fn scatter_add(
    s: &CudaStorage,
    l: &Layout,
    ids: &CudaStorage,
    il: &Layout,
    src: &CudaStorage,
    sl: &Layout,
    dim: usize,
) -> Result<CudaStorage> {
    same_dtype("scatter_add", s, src)?;
    atomic_dtype("scatter_add", s.dtype())?;
    check_gather("scatter_add", l.dims(), il.dims(), dim)?;
    if sl.dims() != il.dims() {
        return Err(Error::ShapeMismatch { op: "scatter_add", lhs: il.dims().to_vec(), rhs: sl.dims().to_vec() });
    }
    let idx = checked_ids(ids, il, l.dims()[dim], "scatter_add")?;
    let out = super::copy::copy_strided(s, l)?;
    let (sp, _k) = src.contiguous_ptr(sl)?;
    let n = sl.elem_count();
    let dev = s.dev();
    if n > 0 {
        launch!(dev, modules::INDEX, format!("scatter_add_{}", s.dtype()), cfg_1d(dev, n);
            out.buf.ptr(), KLayout::exact(&Layout::contiguous(l.shape().clone()))?,
            KLayout::exact(&Layout::contiguous(il.shape().clone()))?, idx.buf.ptr(), sp, n as u64, dim as u32);
    }
    Ok(out)
}

/// The atomic adds exist for 32-bit and wider dtypes (and f16 / bf16).
fn atomic_dtype(op: &'static str, d: DType) -> Result<()> {
    match d {
        DType::U8 | DType::I8 => Err(Error::UnsupportedDType { op, dtype: d }),
        _ => Ok(()),
    }
}

/// Indices checked on the host against `size` and uploaded as u32 (the kernels' index type).
fn checked_ids(ids: &CudaStorage, l: &Layout, size: usize, op: &'static str) -> Result<CudaStorage> {
    if ids.dtype().is_float() {
        return Err(Error::UnsupportedDType { op, dtype: ids.dtype() });
    }
    let host = ids.to_cpu_view(l)?.to_f64_vec(&Layout::contiguous(l.elem_count()));
    let v = host
        .into_iter()
        .map(|x| {
            if x < 0.0 || x as usize >= size {
                Err(Error::IndexOutOfRange { op, index: x as i64, size })
            } else {
                Ok(x as u32)
            }
        })
        .collect::<Result<Vec<u32>>>()?;
    CudaStorage::from_cpu(ids.dev(), &u32::to_cpu_storage(v))
}
