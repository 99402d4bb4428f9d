//! The CUDA launch of `add_layer_norm.cu`: one block per row (grid-stride), the row of `h` cached
//! in shared memory where it fits. Strided inputs are copied to contiguous rows first.

use super::MODULE;
use crate::cuda::launch::{cfg_rows, launch};
use crate::cuda::ops::same_dtype;
use crate::cuda::CudaStorage;
use crate::fused::rows::{last_dim_rows, row_cache_bytes};
use crate::{Layout, Result};

type Arg<'a> = (&'a CudaStorage, &'a Layout);

/// (y, h, mean, rstd).
pub(super) fn add_layer_norm(
    (s, l): Arg<'_>,
    (r, rl): Arg<'_>,
    weight: Option<Arg<'_>>,
    bias: Option<Arg<'_>>,
    eps: f64,
) -> Result<(CudaStorage, CudaStorage, CudaStorage, CudaStorage)> {
    s.dtype().check_float("add_layer_norm")?;
    same_dtype("add_layer_norm", s, r)?;
    let (rows, cols) = last_dim_rows(l);
    let n = l.elem_count();
    let (x, _kx) = s.contiguous_ptr(l)?;
    let (res, _kr) = r.contiguous_ptr(rl)?;
    let param = |p: Option<Arg<'_>>| -> Result<(u64, Option<CudaStorage>)> {
        match p {
            None => Ok((0, None)),
            Some((p, pl)) => {
                same_dtype("add_layer_norm", s, p)?;
                p.contiguous_ptr(pl)
            }
        }
    };
    let ((w, _kw), (b, _kb)) = (param(weight)?, param(bias)?);
    let acc = s.dtype().acc();
    let h = CudaStorage::uninit(s.dev(), n, s.dtype())?;
    let y = CudaStorage::uninit(s.dev(), n, s.dtype())?;
    let mean = CudaStorage::uninit(s.dev(), rows, acc)?;
    let rstd = CudaStorage::uninit(s.dev(), rows, acc)?;
    if rows > 0 {
        let smem = row_cache_bytes(cols, acc.size_in_bytes());
        launch!(s.dev(), MODULE, format!("add_layer_norm_fwd_{}", s.dtype()), cfg_rows(s.dev(), rows, cols, smem);
            x, res, w, b, h.buf.ptr(), y.buf.ptr(), mean.buf.ptr(), rstd.buf.ptr(), rows as u64, cols as u64,
            eps, weight.is_some() as i32, bias.is_some() as i32);
    }
    Ok((y, h, mean, rstd))
}
