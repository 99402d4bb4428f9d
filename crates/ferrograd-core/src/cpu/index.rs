//! Indexing: index_select/embedding, gather, and their adjoints index_add and scatter_add.
//! Indices of any integer dtype are checked against the indexed dim; a bad one is a typed error.

use super::{cpu_dispatch, dispatch2, strided, CpuStorage};
use crate::backend::BackendStorage;
use crate::{shape_err, Error, Layout, Result, WithDType};

/// The viewed indices as usize, each checked to lie in `0..size`.
fn indices(ids: &CpuStorage, il: &Layout, size: usize, op: &'static str) -> Result<Vec<usize>> {
    if ids.dtype().is_float() {
        return Err(Error::UnsupportedDType { op, dtype: ids.dtype() });
    }
    let v = ids.to_f64_vec(il)?;
    v.into_iter()
        .map(|x| {
            if x < 0.0 || x as usize >= size {
                Err(Error::IndexOutOfRange { op, index: x as i64, size })
            } else {
                Ok(x as usize)
            }
        })
        .collect()
}

/// (outer, size of dim, inner) for a contiguous tensor of `dims` split at `dim`.
fn split(dims: &[usize], dim: usize) -> (usize, usize, usize) {
    (dims[..dim].iter().product(), dims[dim], dims[dim + 1..].iter().product())
}

pub fn index_select(s: &CpuStorage, l: &Layout, ids: &CpuStorage, il: &Layout, dim: usize) -> Result<CpuStorage> {
    let (outer, size, inner) = split(l.dims(), dim);
    let idx = indices(ids, il, size, "index_select")?;
    Ok(cpu_dispatch!(s, v => {
        let src = strided::gather_contiguous(v, l)?;
        // The output shape was checked by `Tensor::index_select`, so the product is exact.
        let mut out = super::alloc::with_capacity(outer * idx.len() * inner)?;
        for o in 0..outer {
            for &i in &idx {
                let start = (o * size + i) * inner;
                out.extend_from_slice(&src[start..start + inner]);
            }
        }
        WithDType::to_cpu_storage(out)
    }))
}

/// For every element of an index tensor of shape `idims`, the flat position it addresses in a
/// contiguous tensor of shape `dims` once the `dim` coordinate is replaced by the index value.
fn gather_positions(dims: &[usize], idims: &[usize], idx: &[usize], dim: usize) -> Result<Vec<usize>> {
    let strides = crate::Shape::from(dims).contiguous_strides();
    let mut coord = vec![0usize; idims.len()];
    let mut out = super::alloc::with_capacity(idx.len())?;
    for &ix in idx {
        let pos: usize =
            coord.iter().enumerate().map(|(d, &c)| if d == dim { ix * strides[d] } else { c * strides[d] }).sum();
        out.push(pos);
        for d in (0..idims.len()).rev() {
            coord[d] += 1;
            if coord[d] < idims[d] {
                break;
            }
            coord[d] = 0;
        }
    }
    Ok(out)
}

/// The index tensor of gather/scatter_add has the data's rank and fits inside it off `dim`
/// (shared with the CUDA backend).
pub(crate) fn check_gather(op: &'static str, dims: &[usize], idims: &[usize], dim: usize) -> Result<()> {
    let ok = dims.len() == idims.len() && dims.iter().zip(idims).enumerate().all(|(d, (&a, &b))| d == dim || b <= a);
    if ok {
        Ok(())
    } else {
        Err(shape_err!(op, "index shape {idims:?} does not fit tensor shape {dims:?} outside dim {dim}"))
    }
}

pub fn gather(s: &CpuStorage, l: &Layout, ids: &CpuStorage, il: &Layout, dim: usize) -> Result<CpuStorage> {
    check_gather("gather", l.dims(), il.dims(), dim)?;
    let idx = indices(ids, il, l.dims()[dim], "gather")?;
    let pos = gather_positions(l.dims(), il.dims(), &idx, dim)?;
    Ok(cpu_dispatch!(s, v => {
        let src = strided::gather_contiguous(v, l)?;
        WithDType::to_cpu_storage(super::alloc::collect(pos.iter().map(|&p| src[p]))?)
    }))
}

fn add_at<T: WithDType>(dst: &mut [T], pos: usize, x: T) {
    dst[pos] = T::from_f64(dst[pos].to_f64() + x.to_f64());
}

#[allow(clippy::too_many_arguments)]
pub fn index_add(
    s: &CpuStorage,
    l: &Layout,
    ids: &CpuStorage,
    il: &Layout,
    src: &CpuStorage,
    sl: &Layout,
    dim: usize,
) -> Result<CpuStorage> {
    let (outer, size, inner) = split(l.dims(), dim);
    let idx = indices(ids, il, size, "index_add")?;
    let mut want = l.dims().to_vec();
    want[dim] = idx.len();
    if sl.dims() != want.as_slice() {
        return Err(Error::ShapeMismatch { op: "index_add", lhs: want, rhs: sl.dims().to_vec() });
    }
    Ok(dispatch2!("index_add", s, src, (d, x) => {
        let mut out = strided::gather_contiguous(d, l)?;
        let x = strided::gather_contiguous(x, sl)?;
        for o in 0..outer {
            for (j, &i) in idx.iter().enumerate() {
                for k in 0..inner {
                    add_at(&mut out, (o * size + i) * inner + k, x[(o * idx.len() + j) * inner + k]);
                }
            }
        }
        WithDType::to_cpu_storage(out)
    }))
}

#[allow(clippy::too_many_arguments)]
pub fn scatter_add(
    s: &CpuStorage,
    l: &Layout,
    ids: &CpuStorage,
    il: &Layout,
    src: &CpuStorage,
    sl: &Layout,
    dim: usize,
) -> Result<CpuStorage> {
    check_gather("scatter_add", l.dims(), il.dims(), dim)?;
    if sl.dims() != il.dims() {
        return Err(Error::ShapeMismatch { op: "scatter_add", lhs: il.dims().to_vec(), rhs: sl.dims().to_vec() });
    }
    let idx = indices(ids, il, l.dims()[dim], "scatter_add")?;
    let pos = gather_positions(l.dims(), il.dims(), &idx, dim)?;
    Ok(dispatch2!("scatter_add", s, src, (d, x) => {
        let mut out = strided::gather_contiguous(d, l)?;
        let x = strided::gather_contiguous(x, sl)?;
        for (&p, &v) in pos.iter().zip(&x) {
            add_at(&mut out, p, v);
        }
        WithDType::to_cpu_storage(out)
    }))
}
