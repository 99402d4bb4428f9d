//! The CPU reference, in f64 (the twin of `mse_loss.cu`): the difference and its square rounded
//! to the dtype as the composite `sub`, `sqr` would, summed in f64, divided by n, rounded once.

use crate::backend::BackendStorage;
use crate::cpu::CpuStorage;
use crate::{Layout, Result};

type Arg<'a> = (&'a CpuStorage, &'a Layout);

/// `(pred - target)` per element, rounded to the dtype, as f64.
fn diffs((p, pl): Arg<'_>, (t, tl): Arg<'_>) -> Result<Vec<f64>> {
    super::check(pl, tl)?;
    p.dtype().check_float("mse_loss")?;
    let (ps, ts) = (p.to_f64_vec(pl)?, t.to_f64_vec(tl)?);
    let d = CpuStorage::from_f64_iter(ps.iter().zip(&ts).map(|(a, b)| a - b), p.dtype())?;
    d.to_f64_vec(&Layout::contiguous(pl.shape().clone()))
}

/// The loss, a one-element storage.
pub(super) fn forward(pred: Arg<'_>, target: Arg<'_>) -> Result<CpuStorage> {
    let dtype = pred.0.dtype();
    let d = diffs(pred, target)?;
    let sq = CpuStorage::from_f64_iter(d.iter().map(|v| v * v), dtype)?.to_f64_vec(&Layout::contiguous(d.len()))?;
    let sum: f64 = sq.iter().sum();
    CpuStorage::from_f64_iter(std::iter::once(sum / d.len() as f64), dtype)
}

/// `dpred = g * 2/n * (pred - target)` rounded once, and `-dpred` when `with_target`.
pub(super) fn backward((g, gl): Arg<'_>, pred: Arg<'_>, target: Arg<'_>, with_target: bool) -> Result<Vec<CpuStorage>> {
    let dtype = pred.0.dtype();
    let d = diffs(pred, target)?;
    let g = g.to_f64_vec(gl)?.first().copied().unwrap_or(f64::NAN);
    let scale = g * 2.0 / d.len() as f64;
    let dp = CpuStorage::from_f64_iter(d.iter().map(|v| scale * v), dtype)?;
    let mut out = vec![];
    if with_target {
        out.push(CpuStorage::from_f64_iter(
            dp.to_f64_vec(&Layout::contiguous(d.len()))?.into_iter().map(|v| -v),
            dtype,
        )?);
    }
    out.insert(0, dp);
    Ok(out)
}
