//! The CUDA launches of `conv1d_causal.cu`, on `CudaDevice::stream()`; strided inputs are copied to
//! contiguous rows first.

use super::{Dims, MODULE};
use crate::cuda::launch::{cfg_1d, launch};
use crate::cuda::CudaStorage;
use crate::Result;
use cudarc::driver::LaunchConfig;

type Arg<'a> = (&'a CudaStorage, &'a crate::Layout);

/// `y`, contiguous, in x's dtype.
pub(super) fn forward(d: &Dims, (x, xl): Arg<'_>, (w, wl): Arg<'_>, b: Option<Arg<'_>>) -> Result<CudaStorage> {
    let dev = x.dev();
    let n = xl.elem_count();
    let y = CudaStorage::uninit(dev, n, x.dtype())?;
    if n == 0 {
        return Ok(y);
    }
    let (xp, _kx) = x.contiguous_ptr(xl)?;
    let (wp, _kw) = w.contiguous_ptr(wl)?;
    let bk = b.map(|(b, bl)| b.contiguous_ptr(bl)).transpose()?;
    let bp = bk.as_ref().map_or(0, |(p, _)| *p);
    launch!(dev, MODULE, format!("conv1d_causal_fwd_{}", x.dtype()), cfg_1d(dev, n);
        xp, wp, bp, y.buf.ptr(), (d.batch * d.channels) as u64, d.channels as u32, d.len as u32, d.k as u32,
        d.has_bias as u32);
    Ok(y)
}

/// `(dx, dw, db)`: `dx` elementwise; `dw` and `db` one block a channel (no atomics).
pub(super) fn backward(
    d: &Dims,
    (dy, dyl): Arg<'_>,
    (x, xl): Arg<'_>,
    (w, wl): Arg<'_>,
    b: Option<Arg<'_>>,
) -> Result<(CudaStorage, CudaStorage, Option<CudaStorage>)> {
    let dev = x.dev();
    let dtype = x.dtype();
    let n = xl.elem_count();
    let dx = CudaStorage::uninit(dev, n, dtype)?;
    let nb = if d.has_bias { d.channels } else { 0 };
    if n == 0 {
        // No steps: every sum is empty.
        let dw = CudaStorage::full(dev, 0.0, d.channels * d.k, w.dtype())?;
        let db = b.map(|(b, _)| CudaStorage::full(dev, 0.0, nb, b.dtype())).transpose()?;
        return Ok((dx, dw, db));
    }
    let dw = CudaStorage::uninit(dev, d.channels * d.k, w.dtype())?;
    let db = b.map(|(b, _)| CudaStorage::uninit(dev, nb, b.dtype())).transpose()?;
    let (gp, _kg) = dy.contiguous_ptr(dyl)?;
    let (xp, _kx) = x.contiguous_ptr(xl)?;
    let (wp, _kw) = w.contiguous_ptr(wl)?;
    let rows = (d.batch * d.channels) as u64;
    let (ch, len, k) = (d.channels as u32, d.len as u32, d.k as u32);
    launch!(dev, MODULE, format!("conv1d_causal_bwd_dx_{dtype}"), cfg_1d(dev, n);
        gp, wp, dx.buf.ptr(), rows, ch, len, k);
    // One block a channel: 256 threads for long (batch x len) sums, fewer for short ones.
    let per_channel = d.batch * d.len;
    let threads = per_channel.next_power_of_two().clamp(32, 256) as u32;
    let blocks = d.channels.min(65_535) as u32;
    let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
    let dbp = db.as_ref().map_or(0, |s| s.buf.ptr());
    launch!(dev, MODULE, format!("conv1d_causal_bwd_dw_{dtype}"), cfg;
        gp, xp, dw.buf.ptr(), dbp, d.batch as u32, ch, len, k, d.has_bias as u32);
    Ok((dx, dw, db))
}
