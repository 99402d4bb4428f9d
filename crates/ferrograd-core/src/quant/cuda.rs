//! The CUDA launches of `quant.cu`, and the int8 matmul: cuBLASLt's IMMA kernels
//! (`cuda/blaslt/int8.rs`) where they take the problem, `int8_gemm_nt` otherwise.

use super::{RescaleArgs, MODULE};
use crate::cuda::blaslt::int8::{gemm_i8, GemmI8};
use crate::cuda::launch::{cfg_1d, cfg_rows, launch};
use crate::cuda::CudaStorage;
use crate::{DType, Layout, Result};
use cudarc::driver::LaunchConfig;

type Arg<'a> = (&'a CudaStorage, &'a Layout);

pub(super) fn quant_rows((x, xl): Arg<'_>, cols: usize) -> Result<(CudaStorage, CudaStorage)> {
    let (dev, n) = (x.dev(), xl.elem_count());
    let rows = n.checked_div(cols).unwrap_or(0);
    let q = CudaStorage::uninit(dev, n, DType::I8)?;
    let s = CudaStorage::uninit(dev, rows, DType::F32)?;
    if n > 0 {
        let (xp, _k) = x.contiguous_ptr(xl)?;
        launch!(dev, MODULE, format!("quant_rows_i8_{}", x.dtype()), cfg_rows(dev, rows, cols, 0);
            xp, q.buf.ptr(), s.buf.ptr(), rows as u64, cols as u64);
    }
    Ok((q, s))
}

pub(super) fn dequant_rows((q, ql): Arg<'_>, (s, sl): Arg<'_>, cols: usize, dtype: DType) -> Result<CudaStorage> {
    let (dev, n) = (q.dev(), ql.elem_count());
    let y = CudaStorage::uninit(dev, n, dtype)?;
    if n > 0 {
        let (qp, _kq) = q.contiguous_ptr(ql)?;
        let (sp, _ks) = s.contiguous_ptr(sl)?;
        launch!(dev, MODULE, format!("dequant_rows_i8_{dtype}"), cfg_1d(dev, n);
            qp, sp, y.buf.ptr(), (n / cols) as u64, cols as u64);
    }
    Ok(y)
}

/// `a [m, k] b [n, k]^T`, int32 `[m, n]`.
pub(super) fn matmul_nt((a, al): Arg<'_>, (b, bl): Arg<'_>, m: usize, n: usize, k: usize) -> Result<CudaStorage> {
    let dev = a.dev();
    let c = CudaStorage::uninit(dev, m * n, DType::I32)?;
    if m * n == 0 {
        return Ok(c);
    }
    if k == 0 {
        return CudaStorage::full(dev, 0.0, m * n, DType::I32);
    }
    let (ap, _ka) = a.contiguous_ptr(al)?;
    let (bp, _kb) = b.contiguous_ptr(bl)?;
    // Row-major C [m, n] is column-major n x m: D = B^T A with B [n, k] and A [m, k] as k-major columns.
    let g = GemmI8 { m: n, n: m, k, a: bp, lda: k, b: ap, ldb: k, d: c.buf.ptr(), ldd: n };
    if crate::cuda::blaslt::available() && gemm_i8(dev, &g)? {
        return Ok(c);
    }
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(16) as u32, m.div_ceil(16) as u32, 1),
        block_dim: (16, 16, 1),
        shared_mem_bytes: 0,
    };
    launch!(dev, MODULE, "int8_gemm_nt", cfg; ap, bp, c.buf.ptr(), m as u64, n as u64, k as u64);
    Ok(c)
}

/// `acc[i, j] * sa[i] * sb[j] (+ bias[j])` in `dtype`.
pub(super) fn scale(a: RescaleArgs<'_, CudaStorage>) -> Result<CudaStorage> {
    let RescaleArgs { acc, sa, sb, bias, n, dtype } = a;
    let dev = acc.0.dev();
    let len = acc.1.elem_count();
    let y = CudaStorage::uninit(dev, len, dtype)?;
    if len == 0 {
        return Ok(y);
    }
    let (accp, _k1) = acc.0.contiguous_ptr(acc.1)?;
    let (sap, _k2) = sa.0.contiguous_ptr(sa.1)?;
    let (sbp, _k3) = sb.0.contiguous_ptr(sb.1)?;
    let (bp, _k4) = match bias {
        Some((b, bl)) => b.contiguous_ptr(bl)?,
        None => (0u64, None),
    };
    launch!(dev, MODULE, format!("int8_scale_{dtype}"), cfg_1d(dev, len);
        accp, sap, sbp, bp, y.buf.ptr(), (len / n) as u64, n as u64, bias.is_some() as i32);
    Ok(y)
}
