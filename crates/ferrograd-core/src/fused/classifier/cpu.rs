//! The CPU reference (the twin of `classifier.cu`): each row in f64, the loss rows stored in the
//! accumulation dtype and the gradient in the logits' dtype, as the kernel stores them.

use super::IGNORED;
use crate::backend::BackendStorage;
use crate::cpu::CpuStorage;
use crate::{shape_err, Error, Result};
use rayon::prelude::*;

/// `(loss_rows, dlogits)` of `x` (`rows x cols` values, row-major, contiguous) with `valid` real
/// classes per row: `loss = lse - x[t]` (0 on an ignored row), `dx = scale / kept * (softmax - onehot)`
/// over the valid columns, 0 past them and on ignored rows (`kept`: the rows not ignored).
/// `lse` is `max + ln(sum(exp(x - max)))`, the max taken as 0 when not finite, as cross entropy does.
pub(super) fn classifier(
    x: &[f64],
    tids: &[u32],
    (rows, cols, valid): (usize, usize, usize),
    scale: f64,
) -> Result<(Vec<f64>, Vec<f64>)> {
    if tids.len() != rows || x.len() != rows * cols || valid > cols {
        return Err(shape_err!("fused_classifier", "{} targets for {rows} rows of {valid}/{cols} columns", tids.len()));
    }
    if let Some(&t) = tids.iter().find(|&&t| t != IGNORED && t as usize >= valid) {
        return Err(Error::IndexOutOfRange { op: "fused_classifier target", index: t as i64, size: valid });
    }
    let kept = tids.iter().filter(|&&t| t != IGNORED).count() as f64;
    let g = scale / kept;
    let mut loss = vec![0f64; rows];
    let mut dx = vec![0f64; rows * cols];
    if cols > 0 {
        dx.par_chunks_mut(cols).zip(loss.par_iter_mut()).enumerate().for_each(|(r, (d, l))| {
            let row = &x[r * cols..r * cols + valid];
            let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let max = if max.is_finite() { max } else { 0.0 };
            let lse = max + row.iter().map(|&v| (v - max).exp()).sum::<f64>().ln();
            let c = tids[r];
            if c == IGNORED {
                return;
            }
            *l = lse - row[c as usize];
            for (j, (o, &v)) in d.iter_mut().zip(row).enumerate() {
                let p = (v - lse).exp();
                *o = g * if j == c as usize { p - 1.0 } else { p };
            }
        });
    }
    Ok((loss, dx))
}

/// The encoded targets as a u32 slice.
pub(super) fn tids(t: &CpuStorage) -> Result<&[u32]> {
    t.as_slice::<u32>().map_err(|_| Error::UnsupportedDType { op: "fused_classifier targets", dtype: t.dtype() })
}
