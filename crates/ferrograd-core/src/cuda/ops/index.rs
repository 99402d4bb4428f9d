//! Launches of `kernels/index.cu`: the index check, index_select, gather and their adjoints
//! index_add, scatter_add, and the in-place index_copy_.

use super::same_dtype;
use crate::cpu::index::check_gather;
use crate::cuda::error_flag::{reported_op, IndexOp};
use crate::cuda::klayout::KLayout;
use crate::cuda::launch::{cfg_1d, launch, width_suffix};
use crate::cuda::modules;
use crate::cuda::storage::CudaStorage;
use crate::{DType, Error, Layout, Result};

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
    let idx = checked_ids(ids, il, size, None, IndexOp::IndexSelect)?;
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

/// `dst[.., ids[j], ..] = src[.., j, ..]` along `dim`, in place: `dst` is viewed contiguously
/// through `dl` (its offset honoured), `src` has `dl`'s dims with `ids.len()` at `dim`. The ids are
/// checked on the device (a bad one writes nothing and is reported at the next host read), so a
/// CUDA graph may capture it with ids that change between replays.
pub(super) fn index_copy_into(
    src: &CudaStorage,
    sl: &Layout,
    ids: &CudaStorage,
    il: &Layout,
    dst: &mut CudaStorage,
    dl: &Layout,
    dim: usize,
) -> Result<()> {
    same_dtype("index_copy_", src, dst)?;
    let (outer, size, inner) = split_at(dl.dims(), dim);
    let idx = checked_ids(ids, il, size, None, IndexOp::IndexCopy)?;
    let mut want = dl.dims().to_vec();
    want[dim] = idx.len();
    if sl.dims() != want.as_slice() {
        return Err(Error::ShapeMismatch { op: "index_copy_", lhs: want, rhs: sl.dims().to_vec() });
    }
    if dl.offset() + dl.elem_count() > dst.len() {
        return Err(Error::Shape { op: "index_copy_", msg: "the destination view overflows its storage".into() });
    }
    let (sp, _k) = src.contiguous_ptr(sl)?;
    let n = sl.elem_count();
    let dev = src.dev();
    if n > 0 {
        launch!(dev, modules::INDEX, format!("index_copy_{}", width_suffix(src.dtype())), cfg_1d(dev, n);
            sp, idx.buf.ptr(), dst.buf.ptr_at(dl.offset()), outer as u64, size as u64, inner as u64,
            idx.len() as u64);
    }
    Ok(())
}

pub(super) fn gather(s: &CudaStorage, l: &Layout, ids: &CudaStorage, il: &Layout, dim: usize) -> Result<CudaStorage> {
    check_gather("gather", l.dims(), il.dims(), dim)?;
    let idx = checked_ids(ids, il, l.dims()[dim], None, IndexOp::Gather)?;
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
    let idx = checked_ids(ids, il, size, None, IndexOp::IndexAdd)?;
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
    let idx = checked_ids(ids, il, l.dims()[dim], None, IndexOp::ScatterAdd)?;
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

/// The encoded id of an index that is out of range (reported through the error flag) or ignored
/// (cross entropy's ignore index): `FG_ID_NONE` in kernels/index.cu, passed as a define. The index
/// kernels write 0 for it (select, gather) or add nothing (index_add, scatter_add).
pub(crate) const NO_ID: u32 = u32::MAX;

/// Integer ids of any dtype, read through `l`, checked on the device against `size` and written
/// as the u32 ids the kernels take. An id outside `[0, size)` becomes [`NO_ID`] and is reported
/// through the device's error flag as `op` at the next host read; `ignore` (cross entropy's ignore
/// index) becomes [`NO_ID`] silently. Nothing here waits for the device.
pub(crate) fn checked_ids(
    ids: &CudaStorage,
    l: &Layout,
    size: usize,
    ignore: Option<i64>,
    op: IndexOp,
) -> Result<CudaStorage> {
    let op = reported_op(op);
    if ids.dtype().is_float() {
        return Err(Error::UnsupportedDType { op: op.name(), dtype: ids.dtype() });
    }
    let n = l.elem_count();
    let dev = ids.dev();
    let out = CudaStorage::uninit(dev, n, DType::U32)?;
    if n > 0 {
        let (claim, record) = dev.error_flag.args();
        launch!(dev, modules::INDEX, format!("ids_{}", ids.dtype()), cfg_1d(dev, n);
            KLayout::new(l)?, ids.buf.ptr(), out.buf.ptr(), n as u64, size as u64, ignore.is_some() as i32,
            ignore.unwrap_or(0), op as i32, claim, record);
    }
    Ok(out)
}
