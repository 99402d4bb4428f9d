//! The CUDA launches of `mse_loss.cu`. Strided inputs are copied to contiguous buffers first.

use super::MODULE;
use crate::cuda::launch::{cfg_1d, launch};
use crate::cuda::ops::same_dtype;
use crate::cuda::CudaStorage;
use crate::{Layout, Result};
use cudarc::driver::LaunchConfig;

type Arg<'a> = (&'a CudaStorage, &'a Layout);

/// Threads of a partial-sum block, and of the final one (a power of two, at most 1024).
const THREADS: u32 = 256;

/// The loss: `mse_part` leaves one partial sum per block, `mse_final` adds them in order and
/// divides by n (an empty input gives 0 / 0 = NaN there, as PyTorch's).
pub(super) fn forward((p, pl): Arg<'_>, (t, tl): Arg<'_>) -> Result<CudaStorage> {
    super::check(pl, tl)?;
    p.dtype().check_float("mse_loss")?;
    same_dtype("mse_loss", p, t)?;
    let dtype = p.dtype();
    let dev = p.dev();
    let n = pl.elem_count();
    let (pp, _kp) = p.contiguous_ptr(pl)?;
    let (tp, _kt) = t.contiguous_ptr(tl)?;
    // One resident wave of blocks at most: few enough partial sums for one final block.
    let blocks = n.div_ceil(THREADS as usize * 4).clamp(1, dev.sm_count() * 2);
    let part = CudaStorage::uninit(dev, blocks, dtype.acc())?;
    let cfg = LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
    launch!(dev, MODULE, format!("mse_part_{dtype}"), cfg; pp, tp, part.buf.ptr(), n as u64);
    let y = CudaStorage::uninit(dev, 1, dtype)?;
    let one = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
    launch!(dev, MODULE, format!("mse_final_{dtype}"), one; part.buf.ptr(), y.buf.ptr(), blocks as u64, n as u64);
    Ok(y)
}

/// `dpred` (and `dtarget = -dpred` when `with_target`) in one kernel; `g` is read on the device.
pub(super) fn backward(
    (g, gl): Arg<'_>,
    (p, pl): Arg<'_>,
    (t, tl): Arg<'_>,
    with_target: bool,
) -> Result<Vec<CudaStorage>> {
    super::check(pl, tl)?;
    same_dtype("mse_loss_backward", p, t)?;
    same_dtype("mse_loss_backward", g, p)?;
    let dtype = p.dtype();
    let dev = p.dev();
    let n = pl.elem_count();
    let dp = CudaStorage::uninit(dev, n, dtype)?;
    let dt = if with_target { Some(CudaStorage::uninit(dev, n, dtype)?) } else { None };
    if n > 0 {
        let (gp, _kg) = g.contiguous_ptr(gl)?;
        let (pp, _kp) = p.contiguous_ptr(pl)?;
        let (tp, _kt) = t.contiguous_ptr(tl)?;
        let dtp = dt.as_ref().map_or(0u64, |s| s.buf.ptr());
        launch!(dev, MODULE, format!("mse_bwd_{dtype}"), cfg_1d(dev, n);
            gp, pp, tp, dp.buf.ptr(), dtp, n as u64, 2.0f64 / n as f64);
    }
    Ok(std::iter::once(dp).chain(dt).collect())
}
