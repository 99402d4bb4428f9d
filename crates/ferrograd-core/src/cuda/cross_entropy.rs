//! Fused cross entropy on CUDA: `kernels/cross_entropy.cu` (docs/kernel-abi.md), one launch forward
//! and one backward. Targets are checked and encoded on the host first (see
//! `src/cpu/cross_entropy.rs`), which reads them back, as `checked_ids` does for the index ops.

use super::device::CudaDevice;
use super::launch::{cfg_rows, cfg_warp_rows, launch};
use super::modules;
use super::storage::CudaStorage;
use crate::backend::BackendStorage;
use crate::cpu::cross_entropy::{acc_dtype, encode_targets};
use crate::{shape_err, DType, Error, Layout, Result, WithDType};
use cudarc::driver::LaunchConfig;

/// Rows up to this many columns go one warp per row (`FG_CE_WARP_COLS` in the kernel file).
const WARP_COLS: usize = 1024;

/// Launch shape for the kernels' path: 8 warps a block for warp-per-row, else `cfg_rows`.
fn ce_cfg(dev: &CudaDevice, rows: usize, cols: usize) -> LaunchConfig {
    if cols <= WARP_COLS {
        cfg_warp_rows(dev, rows)
    } else {
        cfg_rows(dev, rows, cols, 0)
    }
}

/// The device address of a layout's first element, copying a non-contiguous view first (the copy
/// is returned so that it lives until the launch has been enqueued).
fn contiguous_ptr(s: &CudaStorage, l: &Layout) -> Result<(u64, Option<CudaStorage>)> {
    if l.is_contiguous() {
        Ok((s.buf.ptr_at(l.offset()), None))
    } else {
        let c = s.copy_strided(l)?;
        Ok((c.buf.ptr(), Some(c)))
    }
}

fn rows_of(l: &Layout, op: &'static str) -> Result<(usize, usize)> {
    match l.dims() {
        [n, c] => Ok((*n, *c)),
        d => Err(shape_err!(op, "logits must be [N, C], got {d:?}")),
    }
}

fn check_float(op: &'static str, s: &CudaStorage) -> Result<()> {
    if s.dtype().is_float() {
        Ok(())
    } else {
        Err(Error::UnsupportedDType { op, dtype: s.dtype() })
    }
}

fn check_encoded(op: &'static str, t: &CudaStorage, tl: &Layout, rows: usize) -> Result<()> {
    if t.dtype() != DType::U32 {
        return Err(Error::UnsupportedDType { op, dtype: t.dtype() });
    }
    if tl.elem_count() != rows {
        return Err(shape_err!(op, "{} encoded targets for {rows} rows", tl.elem_count()));
    }
    Ok(())
}

impl CudaStorage {
    /// Integer targets read back (synchronises), checked against `classes` and encoded as u32 with
    /// `u32::MAX` for the ignored rows, then uploaded.
    pub(crate) fn cross_entropy_targets(
        &self,
        l: &Layout,
        classes: usize,
        ignore_index: Option<i64>,
    ) -> Result<CudaStorage> {
        if self.dtype().is_float() {
            return Err(Error::UnsupportedDType { op: "cross_entropy targets", dtype: self.dtype() });
        }
        let host = self.to_cpu_view(l)?.to_f64_vec(&Layout::contiguous(l.elem_count()));
        let ids = encode_targets(&host, classes, ignore_index)?;
        Self::from_cpu(self.dev(), &u32::to_cpu_storage(ids))
    }

    /// Forward over `[N, C]` logits with encoded targets: `(loss_rows, lse, kept)`, `[N]` in ACC.
    pub(crate) fn cross_entropy_fwd(
        &self,
        l: &Layout,
        t: &CudaStorage,
        tl: &Layout,
    ) -> Result<(CudaStorage, CudaStorage, CudaStorage)> {
        check_float("cross_entropy", self)?;
        let (rows, cols) = rows_of(l, "cross_entropy")?;
        check_encoded("cross_entropy", t, tl, rows)?;
        if t.dev().ordinal != self.dev().ordinal {
            return Err(Error::DeviceMismatch { op: "cross_entropy", lhs: self.device(), rhs: t.device() });
        }
        let acc = acc_dtype(self.dtype());
        let loss = CudaStorage::uninit(self.dev(), rows, acc)?;
        let lse = CudaStorage::uninit(self.dev(), rows, acc)?;
        let kept = CudaStorage::uninit(self.dev(), rows, acc)?;
        if rows > 0 {
            let (x, _kx) = contiguous_ptr(self, l)?;
            let (tp, _kt) = contiguous_ptr(t, tl)?;
            launch!(self.dev(), modules::CROSS_ENTROPY, format!("cross_entropy_fwd_{}", self.dtype()),
                ce_cfg(self.dev(), rows, cols); x, tp, loss.buf.ptr(), lse.buf.ptr(), kept.buf.ptr(), rows as u64, cols as u64);
        }
        Ok((loss, lse, kept))
    }

    /// Backward: `dx` in the logits' dtype, contiguous `[N, C]`; `scale` is one ACC element.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn cross_entropy_bwd(
        &self,
        l: &Layout,
        t: &CudaStorage,
        tl: &Layout,
        lse: &CudaStorage,
        lsel: &Layout,
        scale: &CudaStorage,
        scalel: &Layout,
    ) -> Result<CudaStorage> {
        const OP: &str = "cross_entropy_backward";
        check_float(OP, self)?;
        let (rows, cols) = rows_of(l, OP)?;
        check_encoded(OP, t, tl, rows)?;
        let acc = acc_dtype(self.dtype());
        if lsel.elem_count() != rows || scalel.elem_count() != 1 || lse.dtype() != acc || scale.dtype() != acc {
            return Err(shape_err!(OP, "saved lse / scale do not match {rows} rows of {acc}"));
        }
        for o in [t, lse, scale] {
            if o.dev().ordinal != self.dev().ordinal {
                return Err(Error::DeviceMismatch { op: OP, lhs: self.device(), rhs: o.device() });
            }
        }
        let dx = CudaStorage::uninit(self.dev(), rows * cols, self.dtype())?;
        if rows > 0 && cols > 0 {
            let (x, _kx) = contiguous_ptr(self, l)?;
            let (tp, _kt) = contiguous_ptr(t, tl)?;
            let (lp, _kl) = contiguous_ptr(lse, lsel)?;
            let sp = scale.buf.ptr_at(scalel.offset());
            launch!(self.dev(), modules::CROSS_ENTROPY, format!("cross_entropy_bwd_{}", self.dtype()),
                ce_cfg(self.dev(), rows, cols); x, tp, lp, sp, dx.buf.ptr(), rows as u64, cols as u64);
        }
        Ok(dx)
    }
}
