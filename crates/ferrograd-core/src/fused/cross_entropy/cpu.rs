//! The CPU reference (the twin of `cross_entropy.cu`): each row in f64, the per-row outputs
//! stored in the accumulation dtype (f32 for f32 / f16 / bf16 logits, f64 for f64), as the CUDA
//! kernels store them; and the targets' encoding, checked at once.

use super::IGNORED;
use crate::backend::BackendStorage;
use crate::cpu::CpuStorage;
use crate::fused::rows::last_dim_rows;
use crate::{shape_err, Error, Layout, Result};
use rayon::prelude::*;

/// Integer targets (any integer dtype, read through `l`) checked and encoded as u32 ids.
pub(super) fn encode_targets(
    t: &CpuStorage,
    l: &Layout,
    classes: usize,
    ignore_index: Option<i64>,
) -> Result<CpuStorage> {
    if t.dtype().is_float() {
        return Err(Error::UnsupportedDType { op: "cross_entropy targets", dtype: t.dtype() });
    }
    Ok(CpuStorage::U32(encode(&t.to_f64_vec(l)?, classes, ignore_index)?))
}

/// Check integer targets (as f64, exact for every index dtype) against `c` classes and encode them:
/// the ignore index becomes `IGNORED`, anything else outside `[0, c)` is `IndexOutOfRange`.
fn encode(t: &[f64], c: usize, ignore_index: Option<i64>) -> Result<Vec<u32>> {
    t.iter()
        .map(|&x| {
            if ignore_index.is_some_and(|ix| x == ix as f64) {
                Ok(IGNORED)
            } else if x < 0.0 || x >= c as f64 || x >= IGNORED as f64 {
                Err(Error::IndexOutOfRange { op: "cross_entropy target", index: x as i64, size: c })
            } else {
                Ok(x as u32)
            }
        })
        .collect()
}

fn encoded(t: &CpuStorage, tl: &Layout, rows: usize, op: &'static str) -> Result<Vec<u32>> {
    let v = t.as_slice::<u32>().map_err(|_| Error::UnsupportedDType { op, dtype: t.dtype() })?;
    if tl.elem_count() != rows {
        return Err(shape_err!(op, "{} encoded targets for {rows} rows", tl.elem_count()));
    }
    crate::cpu::strided::map(v, tl, |x| x)
}

/// Forward: `(loss_rows, lse, kept)`, each `[N]` in ACC. `lse = max + ln(sum(exp(x - max)))` (an
/// infinite or all -inf row subtracts 0 instead of its max, as softmax does, so an all -inf ignored
/// row gives no NaN), `loss_row = ln(sum) - (x[t] - max)` (exactly how `-log_softmax(x)[t]` rounds)
/// or 0 for an ignored row, `kept` 1 or 0.
pub(super) fn cross_entropy_fwd(
    s: &CpuStorage,
    l: &Layout,
    t: &CpuStorage,
    tl: &Layout,
) -> Result<(CpuStorage, CpuStorage, CpuStorage)> {
    let (rows, c) = last_dim_rows(l);
    let tids = encoded(t, tl, rows, "cross_entropy")?;
    let x = s.to_f64_vec(l)?;
    let mut out = crate::cpu::alloc::filled((0f64, 0f64, 0f64), rows)?;
    out.par_iter_mut().enumerate().for_each(|(r, o)| {
        let row = &x[r * c..(r + 1) * c];
        let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let max = if max.is_finite() { max } else { 0.0 };
        let ln_sum = row.iter().map(|&v| (v - max).exp()).sum::<f64>().ln();
        let lse = max + ln_sum;
        *o = match tids[r] {
            IGNORED => (0.0, lse, 0.0),
            k => (ln_sum - (row[k as usize] - max), lse, 1.0),
        };
    });
    let acc = s.dtype().acc();
    Ok((
        CpuStorage::from_f64_iter(out.iter().map(|o| o.0), acc)?,
        CpuStorage::from_f64_iter(out.iter().map(|o| o.1), acc)?,
        CpuStorage::from_f64_iter(out.iter().map(|o| o.2), acc)?,
    ))
}

/// Backward: `dx[r][j] = scale * (exp(x[r][j] - lse[r]) - [j == t[r]])`, 0 on ignored rows, in the
/// logits' dtype. `scale` is one element (the upstream gradient over the kept count).
#[allow(clippy::too_many_arguments)]
pub(super) fn cross_entropy_bwd(
    s: &CpuStorage,
    l: &Layout,
    t: &CpuStorage,
    tl: &Layout,
    lse: &CpuStorage,
    lsel: &Layout,
    scale: &CpuStorage,
    scalel: &Layout,
) -> Result<CpuStorage> {
    let (rows, c) = last_dim_rows(l);
    let tids = encoded(t, tl, rows, "cross_entropy_backward")?;
    if lsel.elem_count() != rows || scalel.elem_count() != 1 {
        return Err(shape_err!("cross_entropy_backward", "saved lse / scale do not match {rows} rows"));
    }
    let lse = lse.to_f64_vec(lsel)?;
    let scale = scale.to_f64_vec(scalel)?[0];
    let mut dx = s.to_f64_vec(l)?;
    if c > 0 {
        dx.par_chunks_mut(c).enumerate().for_each(|(r, row)| match tids[r] {
            IGNORED => row.iter_mut().for_each(|v| *v = 0.0),
            k => {
                for (j, v) in row.iter_mut().enumerate() {
                    let p = (*v - lse[r]).exp();
                    *v = scale * if j == k as usize { p - 1.0 } else { p };
                }
            }
        });
    }
    CpuStorage::from_f64_iter(dx.into_iter(), s.dtype())
}
