//! The CPU reference: `h = x + residual` in f64, rounded to x's dtype, then layer norm's own CPU
//! reference on that `h`, `y` in the residual's dtype (the twin of `add_layer_norm.cu`).

use crate::backend::BackendStorage;
use crate::cpu::CpuStorage;
use crate::fused::layer_norm::cpu::layer_norm;
use crate::{Layout, Result};

type Arg<'a> = (&'a CpuStorage, &'a Layout);

/// (y, h, mean, rstd).
pub(super) fn add_layer_norm(
    (x, xl): Arg<'_>,
    (r, rl): Arg<'_>,
    w: Option<Arg<'_>>,
    b: Option<Arg<'_>>,
    eps: f64,
) -> Result<(CpuStorage, CpuStorage, CpuStorage, CpuStorage)> {
    x.dtype().check_float("add_layer_norm")?;
    let (xs, rs) = (x.to_f64_vec(xl)?, r.to_f64_vec(rl)?);
    let h = CpuStorage::from_f64_iter(xs.iter().zip(&rs).map(|(a, b)| a + b), x.dtype())?;
    let hl = Layout::contiguous(xl.shape().clone());
    let (y, mean, rstd) = layer_norm(&h, &hl, w, b, eps, r.dtype())?;
    Ok((y, h, mean, rstd))
}
