//! The CUDA launches of `layer_norm.cu` and `layer_norm_bwd.cu`: the forward (the row-in-registers kernel where
//! `cfg_row_regs` applies, else the any-row kernel with a shared-memory row cache) and the
//! backward (one kernel: dx, with a pending gradient of x added where given, and dweight / dbias
//! accumulated in the accumulation dtype; a warp per row for f32 rows of up to 1024 columns, else a
//! block per row).

use super::{mixed_suffix, MODULE, MODULE_BWD};
use crate::cuda::launch::{cfg_row_regs, cfg_rows, launch};
use crate::cuda::ops::same_dtype;
use crate::cuda::CudaStorage;
use crate::fused::rows::{last_dim_rows, row_cache_bytes};
use crate::{shape_err, DType, Error, Layout, Result};
use cudarc::driver::LaunchConfig;

pub(super) fn layer_norm(
    s: &CudaStorage,
    l: &Layout,
    weight: Option<(&CudaStorage, &Layout)>,
    bias: Option<(&CudaStorage, &Layout)>,
    eps: f64,
    out: DType,
) -> Result<(CudaStorage, CudaStorage, CudaStorage)> {
    s.dtype().check_float("layer_norm")?;
    let suffix = mixed_suffix("layer_norm", s.dtype(), out)?;
    let (rows, cols) = last_dim_rows(l);
    let n = l.elem_count();
    let (x, _k) = s.contiguous_ptr(l)?;
    let param = |p: Option<(&CudaStorage, &Layout)>| -> Result<(u64, Option<CudaStorage>)> {
        match p {
            None => Ok((0, None)),
            Some((p, pl)) => {
                same_dtype("layer_norm", s, p)?;
                p.contiguous_ptr(pl)
            }
        }
    };
    let ((w, _kw), (b, _kb)) = (param(weight)?, param(bias)?);
    let acc = s.dtype().acc();
    let y = CudaStorage::uninit(s.dev(), n, out)?;
    let mean = CudaStorage::uninit(s.dev(), rows, acc)?;
    let rstd = CudaStorage::uninit(s.dev(), rows, acc)?;
    if rows > 0 {
        let aligned = [x, y.buf.ptr(), w, b].iter().all(|p| p % 16 == 0); // w, b: 0 when absent
        let (es, accs) = (s.dtype().size_in_bytes(), acc.size_in_bytes());
        // The row in registers, moved 16 bytes at a time, where it fits; else one block per row.
        let (name, cfg) = match cfg_row_regs(rows, cols, es, accs, aligned) {
            Some(cfg) => (format!("layer_norm_fwd_rows_{suffix}"), cfg),
            None => {
                let smem = row_cache_bytes(cols, accs);
                (format!("layer_norm_fwd_{suffix}"), cfg_rows(s.dev(), rows, cols, smem))
            }
        };
        launch!(s.dev(), MODULE, name, cfg;
            x, w, b, y.buf.ptr(), mean.buf.ptr(), rstd.buf.ptr(), rows as u64, cols as u64, eps,
            weight.is_some() as i32, bias.is_some() as i32);
    }
    Ok((y, mean, rstd))
}

/// `layer_norm_bwd_rows_*`'s launch shape (`FG_LN_BWD_THREADS`) and widest row (`32 * 4 *
/// FG_LN_BWD_N` in `layer_norm_bwd.cu`).
const BWD_ROW_THREADS: u32 = 128;
const BWD_ROW_COLS: usize = 32 * 4 * 8;

/// `(dx, dweight, dbias)`; `dres`, where given (x's shape and dtype), is added into dx as the
/// kernel stores it (the kernels' nullable `dres`).
pub(super) fn layer_norm_backward(
    (s, l): (&CudaStorage, &Layout),
    weight: Option<(&CudaStorage, &Layout)>,
    mean: &CudaStorage,
    rstd: &CudaStorage,
    (dy, dyl): (&CudaStorage, &Layout),
    dres: Option<(&CudaStorage, &Layout)>,
) -> Result<(CudaStorage, CudaStorage, CudaStorage)> {
    s.dtype().check_float("layer_norm_backward")?;
    let suffix = mixed_suffix("layer_norm_backward", s.dtype(), dy.dtype())?;
    if dyl.dims() != l.dims() {
        return Err(Error::ShapeMismatch {
            op: "layer_norm_backward",
            lhs: l.dims().to_vec(),
            rhs: dyl.dims().to_vec(),
        });
    }
    let (rows, cols) = last_dim_rows(l);
    let n = l.elem_count();
    let acc = s.dtype().acc();
    if mean.len() != rows || rstd.len() != rows || mean.dtype() != acc || rstd.dtype() != acc {
        return Err(shape_err!("layer_norm_backward", "saved statistics do not match {rows} rows of {acc}"));
    }
    let (x, _k) = s.contiguous_ptr(l)?;
    let (g, _kg) = dy.contiguous_ptr(dyl)?;
    let (w, _kw) = match weight {
        Some((s, wl)) => s.contiguous_ptr(wl)?,
        None => (0, None),
    };
    let (res, _kr) = match dres {
        Some((r, rl)) => {
            if rl.dims() != l.dims() {
                return Err(Error::ShapeMismatch {
                    op: "layer_norm_backward",
                    lhs: l.dims().to_vec(),
                    rhs: rl.dims().to_vec(),
                });
            }
            same_dtype("layer_norm_backward", s, r)?;
            r.contiguous_ptr(rl)?
        }
        None => (0, None),
    };
    let dx = CudaStorage::uninit(s.dev(), n, s.dtype())?;
    let dw = CudaStorage::full(s.dev(), 0.0, cols, acc)?;
    let db = CudaStorage::full(s.dev(), 0.0, cols, acc)?;
    if rows > 0 {
        let aligned = [x, g, res, dx.buf.ptr(), w].iter().all(|p| p % 16 == 0); // w, res: 0 when absent
        let warp_rows = s.dtype() == DType::F32 && aligned && cols % 4 == 0 && cols > 0 && cols <= BWD_ROW_COLS;
        if warp_rows {
            // A warp per row, as many blocks as are resident at once (the warps stride over rows).
            let name = format!("layer_norm_bwd_rows_{suffix}");
            let smem = (2 * cols * 4) as u32;
            let per_sm = s.dev().max_active_blocks_per_sm(&MODULE_BWD, &name, BWD_ROW_THREADS, smem)?.max(1);
            let blocks = rows.div_ceil(BWD_ROW_THREADS as usize / 32).min(s.dev().sm_count() * per_sm as usize);
            let cfg = LaunchConfig {
                grid_dim: (blocks.max(1) as u32, 1, 1),
                block_dim: (BWD_ROW_THREADS, 1, 1),
                shared_mem_bytes: smem,
            };
            launch!(s.dev(), MODULE_BWD, name, cfg;
                x, w, mean.buf.ptr(), rstd.buf.ptr(), g, res, dx.buf.ptr(), dw.buf.ptr(), db.buf.ptr(),
                rows as u64, cols as u64, weight.is_some() as i32);
        } else {
            let smem = row_cache_bytes(cols, acc.size_in_bytes());
            launch!(s.dev(), MODULE_BWD, format!("layer_norm_bwd_{suffix}"), cfg_rows(s.dev(), rows, cols, smem);
                x, w, mean.buf.ptr(), rstd.buf.ptr(), g, res, dx.buf.ptr(), dw.buf.ptr(), db.buf.ptr(),
                rows as u64, cols as u64, weight.is_some() as i32);
        }
    }
    let pd = weight.map_or(s.dtype(), |(w, _)| w.dtype());
    let (dw, db) = if pd == acc { (dw, db) } else { (dw.cast_to(pd)?, db.cast_to(pd)?) };
    Ok((dx, dw, db))
}
