//! Softmax and layer norm launches (`kernels/softmax.cu`, `kernels/layernorm.cu`), on their way
//! to their own folders under `src/fused/`.

use super::same_dtype;
use crate::cuda::device::CudaDevice;
use crate::cuda::launch::{cfg_rows, launch};
use crate::cuda::modules;
use crate::cuda::ops::acc_dtype;
use crate::cuda::storage::CudaStorage;
use crate::{shape_err, Error, Layout, Result};
use cudarc::driver::LaunchConfig;

/// Row caches for softmax/layer norm live in at most 48 KiB of shared memory.
const MAX_ROW_SMEM: usize = 48 * 1024;

fn float_only(op: &'static str, s: &CudaStorage) -> Result<()> {
    if s.dtype().is_float() {
        Ok(())
    } else {
        Err(Error::UnsupportedDType { op, dtype: s.dtype() })
    }
}

/// Launch shape for the row-in-registers kernels `softmax_rows_*` / `layernorm_fwd_rows_*`
/// (kernels/softmax.cu, kernels/layernorm.cu), or `None` where they do not apply and the caller
/// launches the general kernel with `cfg_rows`. `aligned`: every pointer the kernel reads or writes
/// row-wise is 16-byte aligned. They apply when `cols` is a multiple of 16 / `elem_bytes` and at
/// most 1024 * E (E = the kernels' `fg_row_cap`: 32 elements a thread with a float accumulator, 8
/// with a double): rows of up to 32 * E elements go to a power-of-two group of lanes within a warp
/// (several rows a warp when short), 4 warps a block; longer rows to a block of one thread per
/// 32 elements (at least cols / E, a power of two, 64..=1024). One block per row (per 4 warps' rows),
/// no cap: measured on an H200 (f32, % of copy), capping the grid at one resident wave cost 10
/// points at 8192 x 8192 (softmax 87 against 97) and 2..7 at 65536 x 1024.
fn cfg_norm_rows(
    _dev: &CudaDevice,
    rows: usize,
    cols: usize,
    elem_bytes: usize,
    acc_bytes: usize,
    aligned: bool,
) -> Option<LaunchConfig> {
    let e = if acc_bytes == 8 { 8 } else { 32 }; // fg_row_cap
    let v = 16 / elem_bytes.max(1); // elements per 16-byte access
    if !aligned || cols == 0 || !cols.is_multiple_of(v) || cols > 1024 * e {
        return None;
    }
    let (threads, blocks) = if cols <= 32 * e {
        let lanes = (cols / v).div_ceil(e / v).next_power_of_two(); // lanes a row takes: 1..=32
        (128, rows.div_ceil(32 / lanes * 4))
    } else {
        let threads = cols.div_ceil(32).next_power_of_two().clamp(64, 1024);
        (threads.max(cols.div_ceil(e).next_power_of_two()), rows)
    };
    Some(LaunchConfig {
        grid_dim: (blocks.clamp(1, i32::MAX as usize) as u32, 1, 1),
        block_dim: (threads as u32, 1, 1),
        shared_mem_bytes: 0,
    })
}

pub(super) fn softmax_last(s: &CudaStorage, l: &Layout, log: bool) -> Result<CudaStorage> {
    float_only("softmax", s)?;
    let cols = l.dims().last().copied().unwrap_or(1);
    let n = l.elem_count();
    let rows = n.checked_div(cols).unwrap_or(0);
    let (x, _keep) = s.contiguous_ptr(l)?;
    let out = CudaStorage::uninit(s.dev(), n, s.dtype())?;
    if rows > 0 {
        let (es, acc) = (s.dtype().size_in_bytes(), acc_dtype(s.dtype()).size_in_bytes());
        let aligned = x % 16 == 0 && out.buf.ptr() % 16 == 0;
        // The row in registers, moved 16 bytes at a time, where it fits; else one block per row.
        let (name, cfg) = match cfg_norm_rows(s.dev(), rows, cols, es, acc, aligned) {
            Some(cfg) => (format!("softmax_rows_{}", s.dtype()), cfg),
            None => {
                let smem = cols * acc;
                let smem = if smem <= MAX_ROW_SMEM { smem as u32 } else { 0 };
                (format!("softmax_{}", s.dtype()), cfg_rows(s.dev(), rows, cols, smem))
            }
        };
        launch!(s.dev(), modules::SOFTMAX, name, cfg; x, out.buf.ptr(), rows as u64, cols as u64, log as i32);
    }
    Ok(out)
}

pub(super) fn layer_norm(
    s: &CudaStorage,
    l: &Layout,
    weight: Option<(&CudaStorage, &Layout)>,
    bias: Option<(&CudaStorage, &Layout)>,
    eps: f64,
) -> Result<(CudaStorage, CudaStorage, CudaStorage)> {
    float_only("layer_norm", s)?;
    let cols = l.dims().last().copied().unwrap_or(1);
    let n = l.elem_count();
    let rows = n.checked_div(cols).unwrap_or(0);
    let (x, _k) = s.contiguous_ptr(l)?;
    let param = |p: Option<(&CudaStorage, &Layout)>| -> Result<(u64, Option<CudaStorage>)> {
        match p {
            None => Ok((0, None)),
            Some((p, pl)) => {
                same_dtype("layer_norm", s, p)?;
                p.contiguous_ptr(pl)
            }
        }
    };
    let ((w, _kw), (b, _kb)) = (param(weight)?, param(bias)?);
    let acc = acc_dtype(s.dtype());
    let y = CudaStorage::uninit(s.dev(), n, s.dtype())?;
    let mean = CudaStorage::uninit(s.dev(), rows, acc)?;
    let rstd = CudaStorage::uninit(s.dev(), rows, acc)?;
    if rows > 0 {
        let aligned = [x, y.buf.ptr(), w, b].iter().all(|p| p % 16 == 0); // w, b: 0 when absent
        let (es, accs) = (s.dtype().size_in_bytes(), acc.size_in_bytes());
        // The row in registers, moved 16 bytes at a time, where it fits; else one block per row.
        let (name, cfg) = match cfg_norm_rows(s.dev(), rows, cols, es, accs, aligned) {
            Some(cfg) => (format!("layernorm_fwd_rows_{}", s.dtype()), cfg),
            None => {
                let smem = cols * accs;
                let smem = if smem <= MAX_ROW_SMEM { smem as u32 } else { 0 };
                (format!("layernorm_fwd_{}", s.dtype()), cfg_rows(s.dev(), rows, cols, smem))
            }
        };
        launch!(s.dev(), modules::LAYERNORM, name, cfg;
            x, w, b, y.buf.ptr(), mean.buf.ptr(), rstd.buf.ptr(), rows as u64, cols as u64, eps,
            weight.is_some() as i32, bias.is_some() as i32);
    }
    Ok((y, mean, rstd))
}

pub(super) fn layer_norm_backward(
    s: &CudaStorage,
    l: &Layout,
    weight: Option<(&CudaStorage, &Layout)>,
    mean: &CudaStorage,
    rstd: &CudaStorage,
    dy: &CudaStorage,
    dyl: &Layout,
) -> Result<(CudaStorage, CudaStorage, CudaStorage)> {
    float_only("layer_norm_backward", s)?;
    same_dtype("layer_norm_backward", s, dy)?;
    if dyl.dims() != l.dims() {
        return Err(Error::ShapeMismatch {
            op: "layer_norm_backward",
            lhs: l.dims().to_vec(),
            rhs: dyl.dims().to_vec(),
        });
    }
    let cols = l.dims().last().copied().unwrap_or(1);
    let n = l.elem_count();
    let rows = n.checked_div(cols).unwrap_or(0);
    let acc = acc_dtype(s.dtype());
    if mean.len() != rows || rstd.len() != rows || mean.dtype() != acc || rstd.dtype() != acc {
        return Err(shape_err!("layer_norm_backward", "saved statistics do not match {rows} rows of {acc}"));
    }
    let (x, _k) = s.contiguous_ptr(l)?;
    let (g, _kg) = dy.contiguous_ptr(dyl)?;
    let (w, _kw) = match weight {
        Some((s, wl)) => s.contiguous_ptr(wl)?,
        None => (0, None),
    };
    let dx = CudaStorage::uninit(s.dev(), n, s.dtype())?;
    let dw = CudaStorage::full(s.dev(), 0.0, cols, acc)?;
    let db = CudaStorage::full(s.dev(), 0.0, cols, acc)?;
    if rows > 0 {
        let smem = cols * acc.size_in_bytes();
        let smem = if smem <= MAX_ROW_SMEM { smem as u32 } else { 0 };
        launch!(s.dev(), modules::LAYERNORM, format!("layernorm_bwd_{}", s.dtype()), cfg_rows(s.dev(), rows, cols, smem);
            x, w, mean.buf.ptr(), rstd.buf.ptr(), g, dx.buf.ptr(), dw.buf.ptr(), db.buf.ptr(),
            rows as u64, cols as u64, weight.is_some() as i32);
    }
    let pd = weight.map_or(s.dtype(), |(w, _)| w.dtype());
    let (dw, db) = if pd == acc { (dw, db) } else { (dw.cast_to(pd)?, db.cast_to(pd)?) };
    Ok((dx, dw, db))
}
