//! The CUDA launches of `fake_quantize.cu`. Strided inputs are copied to contiguous rows first.

use super::{geometry, FakeQuant, MODULE};
use crate::backend::BackendStorage;
use crate::cuda::launch::{cfg_1d, launch};
use crate::cuda::ops::same_dtype;
use crate::cuda::CudaStorage;
use crate::{DType, Error, Layout, Result};
use cudarc::driver::LaunchConfig;

type Arg<'a> = (&'a CudaStorage, &'a Layout);

fn check(q: &FakeQuant, (x, xl): Arg<'_>, (s, sl): Arg<'_>, (z, zl): Arg<'_>) -> Result<(usize, usize)> {
    x.dtype().check_float("fake_quantize")?;
    for t in [s, z] {
        if t.dtype() != DType::F32 {
            return Err(Error::UnsupportedDType { op: "fake_quantize", dtype: t.dtype() });
        }
        if t.dev().ordinal != x.dev().ordinal {
            return Err(Error::DeviceMismatch { op: "fake_quantize", lhs: x.device(), rhs: t.device() });
        }
    }
    let (c, inner) = geometry(xl.dims(), q.axis);
    if sl.elem_count() != c || zl.elem_count() != c {
        return Err(Error::InvalidArgument(format!(
            "fake_quantize: {c} channels, scale {} zero_point {}",
            sl.elem_count(),
            zl.elem_count()
        )));
    }
    Ok((c, inner))
}

/// `y`, contiguous.
pub(super) fn forward(q: &FakeQuant, x: Arg<'_>, s: Arg<'_>, z: Arg<'_>) -> Result<CudaStorage> {
    let (c, inner) = check(q, x, s, z)?;
    let (dev, n) = (x.0.dev(), x.1.elem_count());
    let y = CudaStorage::uninit(dev, n, x.0.dtype())?;
    if n > 0 {
        let (xp, _kx) = x.0.contiguous_ptr(x.1)?;
        let (sp, _ks) = s.0.contiguous_ptr(s.1)?;
        let (zp, _kz) = z.0.contiguous_ptr(z.1)?;
        launch!(dev, MODULE, format!("fake_quant_fwd_{}", x.0.dtype()), cfg_1d(dev, n);
            xp, sp, zp, y.buf.ptr(), n as u64, c as u64, inner as u64, q.qmin, q.qmax);
    }
    Ok(y)
}

fn check_dy((dy, dyl): Arg<'_>, (x, xl): Arg<'_>) -> Result<()> {
    if dyl.dims() != xl.dims() {
        return Err(Error::ShapeMismatch {
            op: "fake_quantize_backward",
            lhs: dyl.dims().to_vec(),
            rhs: xl.dims().to_vec(),
        });
    }
    same_dtype("fake_quantize_backward", dy, x)
}

/// `dx = dy` where `raw` is inside the range, else 0.
pub(super) fn backward_ste(q: &FakeQuant, dy: Arg<'_>, x: Arg<'_>, s: Arg<'_>, z: Arg<'_>) -> Result<CudaStorage> {
    check_dy(dy, x)?;
    let (c, inner) = check(q, x, s, z)?;
    let (dev, n) = (x.0.dev(), x.1.elem_count());
    let dx = CudaStorage::uninit(dev, n, x.0.dtype())?;
    if n > 0 {
        let (dyp, _kd) = dy.0.contiguous_ptr(dy.1)?;
        let (xp, _kx) = x.0.contiguous_ptr(x.1)?;
        let (sp, _ks) = s.0.contiguous_ptr(s.1)?;
        let (zp, _kz) = z.0.contiguous_ptr(z.1)?;
        launch!(dev, MODULE, format!("fake_quant_bwd_{}", x.0.dtype()), cfg_1d(dev, n);
            dyp, xp, sp, zp, dx.buf.ptr(), n as u64, c as u64, inner as u64, q.qmin, q.qmax);
    }
    Ok(dx)
}

/// `(dx, dscale, dzero_point)`: one kernel writes dx and per-block partial sums of the scale and
/// zero-point terms per channel (grid: channels x splits), a second adds the splits.
pub(super) fn backward_lsq(
    q: &FakeQuant,
    dy: Arg<'_>,
    x: Arg<'_>,
    s: Arg<'_>,
    z: Arg<'_>,
) -> Result<(CudaStorage, CudaStorage, CudaStorage)> {
    check_dy(dy, x)?;
    let (c, inner) = check(q, x, s, z)?;
    let (dev, n, dtype) = (x.0.dev(), x.1.elem_count(), x.0.dtype());
    let dx = CudaStorage::uninit(dev, n, dtype)?;
    if n == 0 {
        return Ok((dx, CudaStorage::full(dev, 0.0, c, DType::F32)?, CudaStorage::full(dev, 0.0, c, DType::F32)?));
    }
    let count = n / c; // elements per channel: outer * inner
    let outer = count / inner.max(1);
    // About 8 blocks per SM in all, each with at least 1024 elements.
    let splits = (dev.sm_count() * 8).div_ceil(c).min(count.div_ceil(1024)).clamp(1, 65535);
    let per = count.div_ceil(splits);
    let splits = count.div_ceil(per);
    let (dyp, _kd) = dy.0.contiguous_ptr(dy.1)?;
    let (xp, _kx) = x.0.contiguous_ptr(x.1)?;
    let (sp, _ks) = s.0.contiguous_ptr(s.1)?;
    let (zp, _kz) = z.0.contiguous_ptr(z.1)?;
    let acc = dtype.acc();
    let (ps, pz) = (CudaStorage::uninit(dev, splits * c, acc)?, CudaStorage::uninit(dev, splits * c, acc)?);
    let threads = if per >= 256 { 256 } else { per.next_multiple_of(32) as u32 };
    let cfg = LaunchConfig { grid_dim: (c as u32, splits as u32, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
    let gf = q.grad_factor.unwrap_or(1.0);
    launch!(dev, MODULE, format!("fake_quant_bwd_lsq_{dtype}"), cfg;
        dyp, xp, sp, zp, dx.buf.ptr(), ps.buf.ptr(), pz.buf.ptr(), outer as u64, c as u64, inner as u64,
        per as u64, q.qmin, q.qmax, gf);
    let (ds, dz) = (CudaStorage::uninit(dev, c, DType::F32)?, CudaStorage::uninit(dev, c, DType::F32)?);
    for (part, out) in [(&ps, &ds), (&pz, &dz)] {
        launch!(dev, MODULE, format!("fake_quant_sum_parts_{acc}"), cfg_1d(dev, c);
            part.buf.ptr(), out.buf.ptr(), splits as u64, c as u64);
    }
    Ok((dx, ds, dz))
}
