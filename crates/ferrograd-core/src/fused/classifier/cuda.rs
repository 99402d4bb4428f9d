//! The CUDA launches of `classifier.cu`: the kept-row count, then one block per row computing the
//! loss row and writing the gradient (optionally over the logits themselves).

use super::MODULE;
use crate::cuda::device::CudaDevice;
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

/// `(threads, dynamic shared memory bytes, blocks per SM)` of the launch. With 16-byte vectors and a
/// row whose vectors fit in shared memory, the kernel keeps the row there between its two passes
/// (`cache`: the logits leave DRAM once; two 100 KB bf16 rows of GPT-2 per SM), with 1024 threads
/// where the shared memory leaves room for one block per SM only. Otherwise no shared memory and the
/// second pass rereads the row (from L2 while it is still there).
fn launch_shape(dev: &CudaDevice, name: &str, cols: usize, es: usize, vec: bool) -> Result<(u32, u32, usize)> {
    let threads = block_threads(cols);
    let bytes = cols / (16 / es) * 16;
    if vec && bytes > 0 && bytes <= dev.max_shared_memory_per_block()? {
        let smem = bytes as u32;
        let per = dev.max_active_blocks_per_sm(&MODULE, name, threads, smem)?;
        if per == 1 && threads < 1024 && dev.max_active_blocks_per_sm(&MODULE, name, 1024, smem)? == 1 {
            return Ok((1024, smem, 1));
        }
        if per >= 1 {
            return Ok((threads, smem, per as usize));
        }
    }
    Ok((threads, 0, 2048 / threads as usize))
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
    let es = dt.size_in_bytes() as u64;
    // Every row of dx shares its row of x's alignment mod 16 bytes: then each row goes in 16-byte
    // vectors between a scalar head and tail (GPT-2's 50257 columns included).
    let vec = xp % 16 == dp % 16 && (xv.ld as u64 * es) % 16 == (dxv.ld as u64 * es) % 16;
    let name = format!("classifier_{dt}");
    let (threads, smem, per_sm) = launch_shape(dev, &name, cols, dt.size_in_bytes(), vec)?;
    let cfg = LaunchConfig {
        grid_dim: (rows.min(dev.sm_count() * per_sm) as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: smem,
    };
    let (vec, cache) = (vec as i32, (smem > 0) as i32);
    if acc == DType::F64 {
        launch!(dev, MODULE, name, cfg; xp, dp, tp, count.buf.ptr(), loss.buf.ptr(), rows as u64, cols as u64,
            valid as u64, xv.ld as u64, dxv.ld as u64, scale, vec, cache);
    } else {
        launch!(dev, MODULE, name, cfg; xp, dp, tp, count.buf.ptr(), loss.buf.ptr(), rows as u64, cols as u64,
            valid as u64, xv.ld as u64, dxv.ld as u64, scale as f32, vec, cache);
    }
    Ok((loss, count))
}
