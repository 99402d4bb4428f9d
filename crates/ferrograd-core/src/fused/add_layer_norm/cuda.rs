//! The CUDA launch of `add_layer_norm.cu`: f32 rows of up to 1024 columns in a warp's registers
//! (`add_layer_norm_fwd_rows_*`), else one block per row (grid-stride), the row of `h` cached in
//! shared memory where it fits. Strided inputs are copied to contiguous rows first.

use super::MODULE;
use crate::cuda::launch::{cfg_row_regs, cfg_rows, launch, ROW_CAP_FLOAT};
use crate::cuda::ops::same_dtype;
use crate::cuda::CudaStorage;
use crate::fused::layer_norm::mixed_suffix;
use crate::fused::rows::{last_dim_rows, row_cache_bytes};
use crate::{DType, Layout, Result};

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
    // The residual and y share a dtype: x's, or bf16 with an f32 x (`add_layer_norm_mixed`).
    let suffix = mixed_suffix("add_layer_norm", s.dtype(), r.dtype())?;
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
    let y = CudaStorage::uninit(s.dev(), n, r.dtype())?;
    let mean = CudaStorage::uninit(s.dev(), rows, acc)?;
    let rstd = CudaStorage::uninit(s.dev(), rows, acc)?;
    if rows > 0 {
        // f32 rows of up to 32 * ROW_CAP_FLOAT columns: the row in a warp's registers (128-thread
        // blocks); else a block per row.
        let aligned = [x, res, h.buf.ptr(), y.buf.ptr(), w, b].iter().all(|p| p % 16 == 0); // w, b: 0 when absent
        let regs = (s.dtype() == DType::F32 && cols <= 32 * ROW_CAP_FLOAT)
            .then(|| cfg_row_regs(rows, cols, 4, 4, aligned))
            .flatten();
        let (name, cfg) = match regs {
            Some(cfg) => (format!("add_layer_norm_fwd_rows_{suffix}"), cfg),
            None => {
                let smem = row_cache_bytes(cols, acc.size_in_bytes());
                (format!("add_layer_norm_fwd_{suffix}"), cfg_rows(s.dev(), rows, cols, smem))
            }
        };
        launch!(s.dev(), MODULE, name, cfg;
            x, res, w, b, h.buf.ptr(), y.buf.ptr(), mean.buf.ptr(), rstd.buf.ptr(), rows as u64, cols as u64,
            eps, weight.is_some() as i32, bias.is_some() as i32);
    }
    Ok((y, h, mean, rstd))
}
