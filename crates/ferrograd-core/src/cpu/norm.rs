//! Row-wise fused ops over the last dim: softmax, log-softmax, layer norm and its backward.
//! Rows are independent, so they run in parallel; each row is computed in f64.

use super::{cpu_dispatch, CpuStorage};
use crate::backend::BackendStorage;
use crate::{shape_err, DType, Error, Layout, Result, WithDType};
use rayon::prelude::*;

fn rows_of(l: &Layout) -> (usize, usize) {
    let c = l.dims().last().copied().unwrap_or(1);
    (l.elem_count().checked_div(c).unwrap_or(0), c)
}

fn to_f64_contig(s: &CpuStorage, l: &Layout) -> Result<Vec<f64>> {
    s.to_f64_vec(l)
}

fn from_f64_like(like: DType, v: Vec<f64>) -> Result<CpuStorage> {
    CpuStorage::from_f64_iter(v.into_iter(), like)
}

fn stats_dtype(x: DType) -> DType {
    if x == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

pub fn softmax_last(s: &CpuStorage, l: &Layout, log: bool) -> Result<CpuStorage> {
    let (_, c) = rows_of(l);
    let mut x = to_f64_contig(s, l)?;
    if c > 0 {
        x.par_chunks_mut(c).for_each(|row| {
            let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            // An all -inf row has no finite max; subtracting 0 keeps the result NaN-free for masks.
            let max = if max.is_finite() { max } else { 0.0 };
            let sum: f64 = row.iter().map(|&v| (v - max).exp()).sum();
            if log {
                let lse = sum.ln();
                row.iter_mut().for_each(|v| *v = *v - max - lse);
            } else {
                row.iter_mut().for_each(|v| *v = (*v - max).exp() / sum);
            }
        });
    }
    from_f64_like(s.dtype(), x)
}

fn param(p: Option<(&CpuStorage, &Layout)>, c: usize, what: &'static str) -> Result<Option<Vec<f64>>> {
    match p {
        None => Ok(None),
        Some((s, l)) if l.elem_count() == c => Ok(Some(to_f64_contig(s, l)?)),
        Some((_, l)) => Err(shape_err!("layer_norm", "{what} has shape {:?}, expected [{c}]", l.dims())),
    }
}

pub fn layer_norm(
    s: &CpuStorage,
    l: &Layout,
    weight: Option<(&CpuStorage, &Layout)>,
    bias: Option<(&CpuStorage, &Layout)>,
    eps: f64,
) -> Result<(CpuStorage, CpuStorage, CpuStorage)> {
    let (rows, c) = rows_of(l);
    let w = param(weight, c, "weight")?;
    let b = param(bias, c, "bias")?;
    let mut x = to_f64_contig(s, l)?;
    let mut mean = super::alloc::zeroed::<f64>(rows)?;
    let mut rstd = super::alloc::zeroed::<f64>(rows)?;
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
    let sd = stats_dtype(s.dtype());
    Ok((from_f64_like(s.dtype(), x)?, from_f64_like(sd, mean)?, from_f64_like(sd, rstd)?))
}

#[allow(clippy::needless_range_loop)] // three arrays share the index
pub fn layer_norm_backward(
    s: &CpuStorage,
    l: &Layout,
    weight: Option<(&CpuStorage, &Layout)>,
    mean: &CpuStorage,
    rstd: &CpuStorage,
    dy: &CpuStorage,
    dyl: &Layout,
) -> Result<(CpuStorage, CpuStorage, CpuStorage)> {
    let (rows, c) = rows_of(l);
    if dyl.dims() != l.dims() {
        return Err(Error::ShapeMismatch {
            op: "layer_norm_backward",
            lhs: l.dims().to_vec(),
            rhs: dyl.dims().to_vec(),
        });
    }
    let w = param(weight, c, "weight")?;
    let x = to_f64_contig(s, l)?;
    let g = to_f64_contig(dy, dyl)?;
    let mean = cpu_dispatch!(mean, v => v.iter().map(|x| x.to_f64()).collect::<Vec<_>>());
    let rstd = cpu_dispatch!(rstd, v => v.iter().map(|x| x.to_f64()).collect::<Vec<_>>());
    if mean.len() != rows || rstd.len() != rows {
        return Err(shape_err!("layer_norm_backward", "saved statistics have {} rows, expected {rows}", mean.len()));
    }
    let mut dx = super::alloc::zeroed::<f64>(rows * c)?;
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
            for j in 0..c {
                let xh = (xr[j] - mu) * rs;
                out[j] = rs * (dxhat(j) - m1 - xh * m2);
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
    Ok((from_f64_like(dtype, dx)?, from_f64_like(pd, dw)?, from_f64_like(pd, db)?))
}
