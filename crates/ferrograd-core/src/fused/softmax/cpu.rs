//! The CPU reference: rows in parallel, each computed in f64 (the twin of `softmax.cu`).

use crate::backend::BackendStorage;
use crate::cpu::CpuStorage;
use crate::fused::rows::last_dim_rows;
use crate::{Layout, Result};
use rayon::prelude::*;

/// Softmax (or log-softmax) of each row of `l`'s last dim; the output is contiguous.
pub(super) fn softmax_last(s: &CpuStorage, l: &Layout, log: bool) -> Result<CpuStorage> {
    s.dtype().check_float("softmax")?;
    let (_, c) = last_dim_rows(l);
    let mut x = s.to_f64_vec(l)?;
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
    CpuStorage::from_f64_iter(x.into_iter(), s.dtype())
}
