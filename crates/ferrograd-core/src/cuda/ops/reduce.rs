//! Launches of `kernels/reduce.cu`: folds and arg-folds over rows.

use crate::cuda::launch::{cfg_rows, launch};
use crate::cuda::modules;
use crate::cuda::storage::CudaStorage;
use crate::op::{ArgReduceOp, ReduceOp};
use crate::{DType, Layout, Result};

/// Fold each row of a contiguous `[rows, cols]` matrix at `x` into `out` (ACC dtype).
#[allow(clippy::too_many_arguments)]
fn reduce_rows(
    s: &CudaStorage,
    x: u64,
    dtype: DType,
    out: &CudaStorage,
    rows: usize,
    cols: usize,
    op: i32,
    arg: bool,
) -> Result<()> {
    let dev = s.dev();
    let kind = if arg { "argreduce" } else { "reduce" };
    const CHUNK: usize = 8192;
    if !arg && rows < 32 && cols >= 8 * CHUNK {
        // Few long rows: split each row across many blocks, then fold the partials.
        let acc = out.dtype();
        let esz = dtype.size_in_bytes() as u64;
        let q = cols / CHUNK;
        let rem = cols % CHUNK;
        let parts = q + (rem > 0) as usize;
        let partial = CudaStorage::uninit(dev, parts, acc)?;
        for r in 0..rows {
            let row = x + (r * cols) as u64 * esz;
            launch!(dev, modules::REDUCE, format!("{kind}_{dtype}"), cfg_rows(dev, q, CHUNK, 0);
                row, partial.buf.ptr(), q as u64, CHUNK as u64, op);
            if rem > 0 {
                launch!(dev, modules::REDUCE, format!("{kind}_{dtype}"), cfg_rows(dev, 1, rem, 0);
                    row + (q * CHUNK) as u64 * esz, partial.buf.ptr_at(q), 1u64, rem as u64, op);
            }
            launch!(dev, modules::REDUCE, format!("{kind}_{acc}"), cfg_rows(dev, 1, parts, 0);
                partial.buf.ptr(), out.buf.ptr_at(r), 1u64, parts as u64, op);
        }
        return Ok(());
    }
    if rows > 0 {
        launch!(dev, modules::REDUCE, format!("{kind}_{dtype}"), cfg_rows(dev, rows, cols, 0);
            x, out.buf.ptr(), rows as u64, cols as u64, op);
    }
    Ok(())
}

/// Move `dims` last and return (rows, cols, pointer, owned copy) of the row-major result.
fn rows_over(s: &CudaStorage, l: &Layout, dims: &[usize]) -> Result<(usize, usize, u64, Option<CudaStorage>)> {
    let rank = l.dims().len();
    let mut perm: Vec<usize> = (0..rank).filter(|d| !dims.contains(d)).collect();
    let rows = perm.iter().map(|&d| l.dims()[d]).product();
    perm.extend_from_slice(dims);
    let cols = dims.iter().map(|&d| l.dims()[d]).product();
    let pl = l.permute(&perm)?;
    let (ptr, owned) = s.contiguous_ptr(&pl)?;
    Ok((rows, cols, ptr, owned))
}

pub(super) fn reduce(s: &CudaStorage, l: &Layout, op: ReduceOp, dims: &[usize]) -> Result<CudaStorage> {
    let (rows, cols, ptr, _keep) = rows_over(s, l, dims)?;
    let acc = s.dtype().acc();
    let out = CudaStorage::uninit(s.dev(), rows, acc)?;
    reduce_rows(s, ptr, s.dtype(), &out, rows, cols, op as i32, false)?;
    if acc == s.dtype() {
        Ok(out)
    } else {
        out.cast_to(s.dtype())
    }
}

pub(super) fn arg_reduce(s: &CudaStorage, l: &Layout, op: ArgReduceOp, dim: usize) -> Result<CudaStorage> {
    let (rows, cols, ptr, _keep) = rows_over(s, l, &[dim])?;
    let out = CudaStorage::uninit(s.dev(), rows, DType::U32)?;
    reduce_rows(s, ptr, s.dtype(), &out, rows, cols, op as i32, true)?;
    Ok(out)
}
