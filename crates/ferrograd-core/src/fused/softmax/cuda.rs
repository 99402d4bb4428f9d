//! The CUDA launch of `softmax.cu`: the row-in-registers kernel where it applies
//! (`cfg_row_regs`), else the any-row kernel with a shared-memory row cache when the row fits.

use super::MODULE;
use crate::cuda::launch::{cfg_row_regs, cfg_rows, launch};
use crate::cuda::CudaStorage;
use crate::fused::rows::{last_dim_rows, row_cache_bytes};
use crate::{Layout, Result};

pub(super) fn softmax_last(s: &CudaStorage, l: &Layout, log: bool) -> Result<CudaStorage> {
    s.dtype().check_float("softmax")?;
    let (rows, cols) = last_dim_rows(l);
    let dev = s.dev();
    let (x, _keep) = s.contiguous_ptr(l)?;
    let out = CudaStorage::uninit(dev, l.elem_count(), s.dtype())?;
    if rows > 0 {
        let (es, acc) = (s.dtype().size_in_bytes(), s.dtype().acc().size_in_bytes());
        let aligned = x % 16 == 0 && out.buf.ptr() % 16 == 0;
        // The row in registers, moved 16 bytes at a time, where it fits; else one block per row.
        let (name, cfg) = match cfg_row_regs(rows, cols, es, acc, aligned) {
            Some(cfg) => (format!("softmax_rows_{}", s.dtype()), cfg),
            None => (format!("softmax_{}", s.dtype()), cfg_rows(dev, rows, cols, row_cache_bytes(cols, acc))),
        };
        launch!(dev, MODULE, name, cfg; x, out.buf.ptr(), rows as u64, cols as u64, log as i32);
    }
    Ok(out)
}
