//! The CUDA launches of `bias_gelu.cu`. Strided inputs are copied to contiguous rows first.

use super::MODULE;
use crate::cuda::launch::{cfg_1d, cfg_col_sums, launch};
use crate::cuda::ops::same_dtype;
use crate::cuda::CudaStorage;
use crate::fused::rows::last_dim_rows;
use crate::{Error, Layout, Result};

type Arg<'a> = (&'a CudaStorage, &'a Layout);

/// `y = gelu_tanh(x + b)`, contiguous.
pub(super) fn forward((x, xl): Arg<'_>, (b, bl): Arg<'_>) -> Result<CudaStorage> {
    x.dtype().check_float("bias_gelu")?;
    same_dtype("bias_gelu", x, b)?;
    let (rows, cols) = last_dim_rows(xl);
    let dev = x.dev();
    let (xp, _kx) = x.contiguous_ptr(xl)?;
    let (bp, _kb) = b.contiguous_ptr(bl)?;
    let y = CudaStorage::uninit(dev, xl.elem_count(), x.dtype())?;
    if xl.elem_count() > 0 {
        launch!(dev, MODULE, format!("bias_gelu_fwd_{}", x.dtype()), cfg_1d(dev, xl.elem_count());
            xp, bp, y.buf.ptr(), rows as u64, cols as u64);
    }
    Ok(y)
}

/// `(dx, db)`: one kernel writes `dx` and a row of partial column sums per block, a second adds
/// those rows into `db` (deterministic: no atomics).
pub(super) fn backward((dy, dyl): Arg<'_>, (x, xl): Arg<'_>, (b, bl): Arg<'_>) -> Result<(CudaStorage, CudaStorage)> {
    if dyl.dims() != xl.dims() {
        return Err(Error::ShapeMismatch {
            op: "bias_gelu_backward",
            lhs: dyl.dims().to_vec(),
            rhs: xl.dims().to_vec(),
        });
    }
    same_dtype("bias_gelu_backward", dy, x)?;
    same_dtype("bias_gelu_backward", x, b)?;
    let dtype = x.dtype();
    let (rows, cols) = last_dim_rows(xl);
    let dev = x.dev();
    let dx = CudaStorage::uninit(dev, xl.elem_count(), dtype)?;
    if xl.elem_count() == 0 {
        return Ok((dx, CudaStorage::full(dev, 0.0, cols, dtype)?));
    }
    let (dyp, _kdy) = dy.contiguous_ptr(dyl)?;
    let (xp, _kx) = x.contiguous_ptr(xl)?;
    let (bp, _kb) = b.contiguous_ptr(bl)?;
    let (cfg, rps, splits) = cfg_col_sums(dev, rows, cols);
    let part = CudaStorage::uninit(dev, splits * cols, dtype.acc())?;
    launch!(dev, MODULE, format!("bias_gelu_bwd_{dtype}"), cfg;
        dyp, xp, bp, dx.buf.ptr(), part.buf.ptr(), rows as u64, cols as u64, rps as u64);
    let db = CudaStorage::uninit(dev, cols, dtype)?;
    launch!(dev, MODULE, format!("bias_gelu_colsum_{dtype}"), cfg_1d(dev, cols);
        part.buf.ptr(), db.buf.ptr(), splits as u64, cols as u64);
    Ok((dx, db))
}
