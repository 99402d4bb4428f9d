//! The CUDA launches of `cross_entropy.cu`: one kernel forward, one backward; rows of up to
//! [`WARP_COLS`] columns one warp each, longer rows one block each.

use super::{MODULE, WARP_COLS};
use crate::cuda::device::CudaDevice;
use crate::cuda::error_flag::IndexOp;
use crate::cuda::launch::{cfg_rows, cfg_warp_rows, launch};
use crate::cuda::ops::index::checked_ids;
use crate::cuda::CudaStorage;
use crate::fused::rows::last_dim_rows;
use crate::{shape_err, DType, Error, Layout, Result};
use cudarc::driver::LaunchConfig;

/// Launch shape for the kernels' path: 8 warps a block for warp-per-row, else `cfg_rows`.
fn ce_cfg(dev: &CudaDevice, rows: usize, cols: usize) -> LaunchConfig {
    if cols <= WARP_COLS {
        cfg_warp_rows(dev, rows)
    } else {
        cfg_rows(dev, rows, cols, 0)
    }
}

fn check_encoded(op: &'static str, t: &CudaStorage, tl: &Layout, rows: usize) -> Result<()> {
    if t.dtype() != DType::U32 {
        return Err(Error::UnsupportedDType { op, dtype: t.dtype() });
    }
    if tl.elem_count() != rows {
        return Err(shape_err!(op, "{} encoded targets for {rows} rows", tl.elem_count()));
    }
    Ok(())
}

/// Integer targets checked on the device against `classes` and encoded as u32 ids, `IGNORED` for
/// an ignored row. A bad target is reported through the device's error flag at the next host read
/// (its row is then treated as ignored); nothing here waits for the device.
pub(super) fn encode_targets(
    t: &CudaStorage,
    l: &Layout,
    classes: usize,
    ignore_index: Option<i64>,
) -> Result<CudaStorage> {
    checked_ids(t, l, classes, ignore_index, IndexOp::CrossEntropyTarget)
}

/// Forward over `[N, C]` logits with encoded targets: `(loss_rows, lse, kept)`, `[N]` in ACC.
pub(super) fn cross_entropy_fwd(
    x: &CudaStorage,
    l: &Layout,
    t: &CudaStorage,
    tl: &Layout,
) -> Result<(CudaStorage, CudaStorage, CudaStorage)> {
    x.dtype().check_float("cross_entropy")?;
    let (rows, cols) = last_dim_rows(l);
    check_encoded("cross_entropy", t, tl, rows)?;
    let acc = x.dtype().acc();
    let loss = CudaStorage::uninit(x.dev(), rows, acc)?;
    let lse = CudaStorage::uninit(x.dev(), rows, acc)?;
    let kept = CudaStorage::uninit(x.dev(), rows, acc)?;
    if rows > 0 {
        let (xp, _kx) = x.contiguous_ptr(l)?;
        let (tp, _kt) = t.contiguous_ptr(tl)?;
        launch!(x.dev(), MODULE, format!("cross_entropy_fwd_{}", x.dtype()),
            ce_cfg(x.dev(), rows, cols); xp, tp, loss.buf.ptr(), lse.buf.ptr(), kept.buf.ptr(), rows as u64, cols as u64);
    }
    Ok((loss, lse, kept))
}

/// Backward: `dx` in the logits' dtype, contiguous `[N, C]`; `scale` is one ACC element.
#[allow(clippy::too_many_arguments)]
pub(super) fn cross_entropy_bwd(
    x: &CudaStorage,
    l: &Layout,
    t: &CudaStorage,
    tl: &Layout,
    lse: &CudaStorage,
    lsel: &Layout,
    scale: &CudaStorage,
    scalel: &Layout,
) -> Result<CudaStorage> {
    const OP: &str = "cross_entropy_backward";
    x.dtype().check_float(OP)?;
    let (rows, cols) = last_dim_rows(l);
    check_encoded(OP, t, tl, rows)?;
    let acc = x.dtype().acc();
    if lsel.elem_count() != rows || scalel.elem_count() != 1 || lse.dtype() != acc || scale.dtype() != acc {
        return Err(shape_err!(OP, "saved lse / scale do not match {rows} rows of {acc}"));
    }
    let dx = CudaStorage::uninit(x.dev(), rows * cols, x.dtype())?;
    if rows > 0 && cols > 0 {
        let (xp, _kx) = x.contiguous_ptr(l)?;
        let (tp, _kt) = t.contiguous_ptr(tl)?;
        let (lp, _kl) = lse.contiguous_ptr(lsel)?;
        let sp = scale.buf.ptr_at(scalel.offset());
        launch!(x.dev(), MODULE, format!("cross_entropy_bwd_{}", x.dtype()),
            ce_cfg(x.dev(), rows, cols); xp, tp, lp, sp, dx.buf.ptr(), rows as u64, cols as u64);
    }
    Ok(dx)
}
