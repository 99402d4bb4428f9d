//! The CPU reference (the twin of `conv1d_causal.cu`): every sum in f64, each output rounded once
//! to the dtype. Rows (batch, channel) in parallel.

use super::Dims;
use crate::backend::BackendStorage;
use crate::cpu::CpuStorage;
use crate::Result;
use rayon::prelude::*;

type Arg<'a> = (&'a CpuStorage, &'a crate::Layout);

/// `y`, contiguous, in x's dtype.
pub(super) fn forward(d: &Dims, (x, xl): Arg<'_>, (w, wl): Arg<'_>, b: Option<Arg<'_>>) -> Result<CpuStorage> {
    let (xs, ws) = (x.to_f64_vec(xl)?, w.to_f64_vec(wl)?);
    let bs = b.map(|(b, bl)| b.to_f64_vec(bl)).transpose()?;
    let (len, k) = (d.len, d.k);
    let mut y = vec![0.0f64; xs.len()];
    if len > 0 {
        y.par_chunks_mut(len).zip(xs.par_chunks(len)).enumerate().for_each(|(r, (yr, xr))| {
            let c = r % d.channels;
            let wc = &ws[c * k..(c + 1) * k];
            let bias = bs.as_ref().map_or(0.0, |b| b[c]);
            for (l, out) in yr.iter_mut().enumerate() {
                let mut acc = bias;
                for (j, wv) in wc.iter().enumerate() {
                    // step l - (k - 1) + j, skipped before 0
                    if let Some(s) = (l + j).checked_sub(k - 1) {
                        acc += wv * xr[s];
                    }
                }
                *out = acc;
            }
        });
    }
    CpuStorage::from_f64_iter(y.into_iter(), x.dtype())
}

/// `(dx, dw, db)`: each in its input's dtype; `db` when there is a bias.
pub(super) fn backward(
    d: &Dims,
    (dy, dyl): Arg<'_>,
    (x, xl): Arg<'_>,
    (w, wl): Arg<'_>,
) -> Result<(CpuStorage, CpuStorage, Option<CpuStorage>)> {
    let (gs, xs, ws) = (dy.to_f64_vec(dyl)?, x.to_f64_vec(xl)?, w.to_f64_vec(wl)?);
    let (len, k, ch) = (d.len, d.k, d.channels);
    let mut dx = vec![0.0f64; xs.len()];
    if len > 0 {
        dx.par_chunks_mut(len).zip(gs.par_chunks(len)).enumerate().for_each(|(r, (dxr, gr))| {
            let wc = &ws[(r % ch) * k..(r % ch + 1) * k];
            for (l, out) in dxr.iter_mut().enumerate() {
                let mut acc = 0.0;
                for (j, wv) in wc.iter().enumerate() {
                    let s = l + (k - 1 - j);
                    if s < len {
                        acc += wv * gr[s];
                    }
                }
                *out = acc;
            }
        });
    }
    // Per channel: [dw_0 .. dw_{k-1}, db], summed over batch then steps in a fixed order.
    let sums: Vec<Vec<f64>> = (0..ch)
        .into_par_iter()
        .map(|c| {
            let mut s = vec![0.0f64; k + 1];
            for n in 0..d.batch {
                let r = (n * ch + c) * len;
                let (gr, xr) = (&gs[r..r + len], &xs[r..r + len]);
                for (l, &g) in gr.iter().enumerate() {
                    s[k] += g;
                    for (j, sj) in s[..k].iter_mut().enumerate() {
                        if let Some(t) = (l + j).checked_sub(k - 1) {
                            *sj += g * xr[t];
                        }
                    }
                }
            }
            s
        })
        .collect();
    let dw = sums.iter().flat_map(|s| s[..k].iter().copied()).collect::<Vec<_>>();
    let db = sums.iter().map(|s| s[k]).collect::<Vec<_>>();
    Ok((
        CpuStorage::from_f64_iter(dx.into_iter(), x.dtype())?,
        CpuStorage::from_f64_iter(dw.into_iter(), w.dtype())?,
        d.has_bias.then(|| CpuStorage::from_f64_iter(db.into_iter(), w.dtype())).transpose()?,
    ))
}
