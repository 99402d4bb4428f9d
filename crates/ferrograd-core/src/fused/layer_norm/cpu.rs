//! The CPU reference: rows in parallel, each computed in f64 (the twin of `layer_norm.cu`). The
//! output (forward) and `dy` (backward) may be in another dtype than `x`, as the kernels'
//! `f32_bf16` variants: values are read and rounded per element either way.

use crate::backend::BackendStorage;
use crate::cpu::{alloc, cpu_dispatch, CpuStorage};
use crate::fused::rows::last_dim_rows;
use crate::{shape_err, DType, Error, Layout, Result, WithDType};
use rayon::prelude::*;

fn from_f64(like: DType, v: Vec<f64>) -> Result<CpuStorage> {
    CpuStorage::from_f64_iter(v.into_iter(), like)
}

fn param(p: Option<(&CpuStorage, &Layout)>, c: usize, what: &'static str) -> Result<Option<Vec<f64>>> {
    match p {
        None => Ok(None),
        Some((s, l)) if l.elem_count() == c => Ok(Some(s.to_f64_vec(l)?)),
        Some((_, l)) => Err(shape_err!("layer_norm", "{what} has shape {:?}, expected [{c}]", l.dims())),
    }
}

pub(crate) fn layer_norm(
    s: &CpuStorage,
    l: &Layout,
    weight: Option<(&CpuStorage, &Layout)>,
    bias: Option<(&CpuStorage, &Layout)>,
    eps: f64,
    out: DType,
) -> Result<(CpuStorage, CpuStorage, CpuStorage)> {
    s.dtype().check_float("layer_norm")?;
    let (rows, c) = last_dim_rows(l);
    let w = param(weight, c, "weight")?;
    let b = param(bias, c, "bias")?;
    let mut x = s.to_f64_vec(l)?;
    let mut mean = alloc::zeroed::<f64>(rows)?;
    let mut rstd = alloc::zeroed::<f64>(rows)?;
    if c > 0 {
        x.par_chunks_mut(c).zip(mean.par_iter_mut()).zip(rstd.par_iter_mut()).for_each(|((row, m), r)| {
            let mu = row.iter().sum::<f64>() / c as f64;
            let var = row.iter().map(|v| (v - mu) * (v - mu)).sum::<f64>() / c as f64;
            let rs = 1.0 / (var + eps).sqrt();
            for (j, v) in row.iter_mut().enumerate() {
                let mut y = (*v - mu) * rs;
                if let Some(w) = &w {
                    y *= w[j];
                }
                if let Some(b) = &b {
                    y += b[j];
                }
                *v = y;
            }
            *m = mu;
            *r = rs;
        });
    }
    let sd = s.dtype().acc();
    Ok((from_f64(out, x)?, from_f64(sd, mean)?, from_f64(sd, rstd)?))
}

/// `(dx, dweight, dbias)`; `dres`, where given (x's shape and dtype), is added to dx before it is
/// rounded to x's dtype, as the kernels add it in their store.
#[allow(clippy::needless_range_loop)] // three arrays share the index
pub(super) fn layer_norm_backward(
    (s, l): (&CpuStorage, &Layout),
    weight: Option<(&CpuStorage, &Layout)>,
    mean: &CpuStorage,
    rstd: &CpuStorage,
    (dy, dyl): (&CpuStorage, &Layout),
    dres: Option<(&CpuStorage, &Layout)>,
) -> Result<(CpuStorage, CpuStorage, CpuStorage)> {
    s.dtype().check_float("layer_norm_backward")?;
    let (rows, c) = last_dim_rows(l);
    if dyl.dims() != l.dims() {
        return Err(Error::ShapeMismatch {
            op: "layer_norm_backward",
            lhs: l.dims().to_vec(),
            rhs: dyl.dims().to_vec(),
        });
    }
    let w = param(weight, c, "weight")?;
    let x = s.to_f64_vec(l)?;
    let g = dy.to_f64_vec(dyl)?;
    let mean = cpu_dispatch!(mean, v => v.iter().map(|x| x.to_f64()).collect::<Vec<_>>());
    let rstd = cpu_dispatch!(rstd, v => v.iter().map(|x| x.to_f64()).collect::<Vec<_>>());
    if mean.len() != rows || rstd.len() != rows {
        return Err(shape_err!("layer_norm_backward", "saved statistics have {} rows, expected {rows}", mean.len()));
    }
    let res = dres.map(|(r, rl)| r.to_f64_vec(rl)).transpose()?;
    if res.as_ref().is_some_and(|v| v.len() != rows * c) {
        return Err(shape_err!("layer_norm_backward", "the residual gradient is not {rows} rows of {c}"));
    }
    let mut dx = alloc::zeroed::<f64>(rows * c)?;
    if c > 0 {
        // dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)),  dxhat = dy * w
        dx.par_chunks_mut(c).enumerate().for_each(|(r, out)| {
            let (xr, gr) = (&x[r * c..(r + 1) * c], &g[r * c..(r + 1) * c]);
            let (mu, rs) = (mean[r], rstd[r]);
            let dxhat = |j: usize| gr[j] * w.as_ref().map_or(1.0, |w| w[j]);
            let (mut s1, mut s2) = (0.0, 0.0);
            for j in 0..c {
                let xh = (xr[j] - mu) * rs;
                s1 += dxhat(j);
                s2 += dxhat(j) * xh;
            }
            let (m1, m2) = (s1 / c as f64, s2 / c as f64);
            let rr = res.as_ref().map(|v| &v[r * c..(r + 1) * c]);
            for j in 0..c {
                let xh = (xr[j] - mu) * rs;
                let d = rs * (dxhat(j) - m1 - xh * m2);
                out[j] = rr.map_or(d, |v| d + v[j]);
            }
        });
    }
    let dtype = s.dtype();
    let pd = weight.map_or(dtype, |(ws, _)| ws.dtype());
    let mut dw = vec![0f64; c];
    let mut db = vec![0f64; c];
    for r in 0..rows {
        for j in 0..c {
            let xh = (x[r * c + j] - mean[r]) * rstd[r];
            dw[j] += g[r * c + j] * xh;
            db[j] += g[r * c + j];
        }
    }
    Ok((from_f64(dtype, dx)?, from_f64(pd, dw)?, from_f64(pd, db)?))
}
