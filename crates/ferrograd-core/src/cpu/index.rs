//! Indexing: index_select/embedding, gather, their adjoints index_add and scatter_add, and the
//! in-place index_copy_.
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

/// `dst[o, ids[j], k] = src[o, j, k]` in place, `dst` viewed contiguously through `dl`: the CPU
/// twin of `index_copy_` in kernels/index.cu. The ids are all checked before anything is written.
pub fn index_copy_into(
    src: &CpuStorage,
    sl: &Layout,
    ids: &CpuStorage,
    il: &Layout,
    dst: &mut CpuStorage,
    dl: &Layout,
    dim: usize,
) -> Result<()> {
    let (outer, size, inner) = split(dl.dims(), dim);
    let idx = indices(ids, il, size, "index_copy_")?;
    let mut want = dl.dims().to_vec();
    want[dim] = idx.len();
    if sl.dims() != want.as_slice() {
        return Err(Error::ShapeMismatch { op: "index_copy_", lhs: want, rhs: sl.dims().to_vec() });
    }
    let off = dl.offset();
    dispatch2!("index_copy_", src, dst, (x, d) => {
        if off + dl.elem_count() > d.len() {
            return Err(shape_err!("index_copy_", "the destination view overflows its storage"));
        }
        let x = strided::gather_contiguous(x, sl)?;
        for o in 0..outer {
            for (j, &i) in idx.iter().enumerate() {
                let to = off + (o * size + i) * inner;
                let from = (o * idx.len() + j) * inner;
                d[to..to + inner].copy_from_slice(&x[from..from + inner]);
            }
        }
    });
    Ok(())
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

#[cfg(test)]
mod tests {
    use crate::{DType, Device, Result, Tensor};

    #[test]
    fn index_copy_writes_the_selected_slices_of_a_view_in_place() -> Result<()> {
        // A [4, 2, 3] buffer viewed from row 1 (offset 6); rows 2 and 0 of the view overwritten.
        let buf = Tensor::arange(0.0, 24.0, 1.0, DType::F32, Device::Cpu)?.reshape((4, 2, 3))?;
        let view = buf.narrow(0, 1, 3)?;
        let src = Tensor::arange(100.0, 112.0, 1.0, DType::F32, Device::Cpu)?.reshape((2, 2, 3))?;
        view.index_copy_(0, &Tensor::from_vec(vec![2i32, 0], 2, Device::Cpu)?, &src)?;
        let mut want: Vec<f32> = (0..24).map(|v| v as f32).collect();
        want[18..24].copy_from_slice(&[100.0, 101.0, 102.0, 103.0, 104.0, 105.0]);
        want[6..12].copy_from_slice(&[106.0, 107.0, 108.0, 109.0, 110.0, 111.0]);
        assert_eq!(buf.to_vec::<f32>()?, want);
        // Along an inner dim: column 1 of every row of a [2, 3] matrix.
        let m = Tensor::zeros((2, 3), DType::BF16, Device::Cpu)?.add_scalar(7.0)?;
        let col = Tensor::from_vec(vec![1.0f32, 2.0], (2, 1), Device::Cpu)?.to_dtype(DType::BF16)?;
        m.index_copy_(1, &Tensor::from_vec(vec![1u8], 1, Device::Cpu)?, &col)?;
        assert_eq!(m.to_dtype(DType::F32)?.to_vec::<f32>()?, vec![7.0, 1.0, 7.0, 7.0, 2.0, 7.0]);
        Ok(())
    }
}
