//! The CUDA launches of `classifier.cu`: the kept-row count, then one block per row computing the
//! loss row and writing the gradient (optionally over the logits themselves).

use super::MODULE;
use crate::cuda::launch::launch;
use crate::cuda::CudaStorage;
use crate::{shape_err, DType, Error, Result};
use cudarc::driver::LaunchConfig;

/// A `[rows, cols]` matrix on the device: base address (elements counted from the buffer's start)
/// and row stride, unit column stride.
pub(super) struct RowsView {
    pub offset: usize,
    pub ld: usize,
}

/// Threads per row block: enough for a few 16-byte vectors each on GPT-2's 50304 columns, fewer on
/// short rows.
fn block_threads(cols: usize) -> u32 {
    match cols {
        0..=1024 => 32,
        1025..=8192 => 128,
        8193..=32768 => 256,
        _ => 512,
    }
}

/// `(loss_rows [rows] in ACC, count [1] in ACC)`, writing the gradient into `dx` (which may be
/// `x`'s own buffer: then `dxv` must equal `xv`). `t`: encoded targets, contiguous u32 `[rows]`.
#[allow(clippy::too_many_arguments)]
pub(super) fn classifier(
    x: &CudaStorage,
    xv: &RowsView,
    dx: &CudaStorage,
    dxv: &RowsView,
    t: &CudaStorage,
    t_offset: usize,
    (rows, cols, valid): (usize, usize, usize),
    scale: f64,
) -> Result<(CudaStorage, CudaStorage)> {
    const OP: &str = "fused_classifier";
    let dt = x.dtype();
    dt.check_float(OP)?;
    if t.dtype() != DType::U32 {
        return Err(Error::UnsupportedDType { op: OP, dtype: t.dtype() });
    }
    if dx.dtype() != dt {
        return Err(Error::DTypeMismatch { op: OP, lhs: dt, rhs: dx.dtype() });
    }
    if valid > cols || (rows > 1 && (xv.ld < cols || dxv.ld < cols)) {
        return Err(shape_err!(OP, "{valid} classes of {cols} columns at row strides {} / {}", xv.ld, dxv.ld));
    }
    let dev = x.dev();
    let acc = dt.acc();
    let loss = CudaStorage::uninit(dev, rows, acc)?;
    let count = CudaStorage::uninit(dev, 1, acc)?;
    let tp = t.buf.ptr_at(t_offset);
    let one = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
    launch!(dev, MODULE, format!("classifier_count_{dt}"), one; tp, count.buf.ptr(), rows as u64);
    if rows == 0 || cols == 0 {
        return Ok((loss, count));
    }
    let (xp, dp) = (x.buf.ptr_at(xv.offset), dx.buf.ptr_at(dxv.offset));
    let v = 16 / dt.size_in_bytes();
    let vec = xp.is_multiple_of(16) && dp.is_multiple_of(16) && xv.ld.is_multiple_of(v) && dxv.ld.is_multiple_of(v);
    let threads = block_threads(cols);
    let resident = dev.sm_count() * (2048 / threads as usize);
    let cfg =
        LaunchConfig { grid_dim: (rows.min(resident) as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
    let name = format!("classifier_{dt}");
    if acc == DType::F64 {
        launch!(dev, MODULE, name, cfg; xp, dp, tp, count.buf.ptr(), loss.buf.ptr(), rows as u64, cols as u64,
            valid as u64, xv.ld as u64, dxv.ld as u64, scale, vec as i32);
    } else {
        launch!(dev, MODULE, name, cfg; xp, dp, tp, count.buf.ptr(), loss.buf.ptr(), rows as u64, cols as u64,
            valid as u64, xv.ld as u64, dxv.ld as u64, scale as f32, vec as i32);
    }
    Ok((loss, count))
}
