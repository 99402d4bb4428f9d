//! Launches of `kernels/copy.cu`: strided copies (or a driver memcpy when the view is contiguous)
//! and fills.

use super::same_dtype;
use crate::cpu::CpuStorage;
use crate::cuda::device::{driver_err, CudaDevice};
use crate::cuda::klayout::KLayout;
use crate::cuda::launch::{cfg_1d, launch, width_suffix};
use crate::cuda::modules;
use crate::cuda::storage::CudaStorage;
use crate::{shape_err, DType, Layout, Result};
use cudarc::driver::result;
use std::sync::Arc;

/// Copy the viewed elements to the device address `dst`, contiguous.
fn copy_to_ptr(s: &CudaStorage, l: &Layout, dst: u64) -> Result<()> {
    let n = l.elem_count();
    if n == 0 {
        return Ok(());
    }
    let dev = s.dev();
    if l.is_contiguous() {
        dev.ctx.bind_to_thread().map_err(|e| driver_err("cuCtxSetCurrent", e))?;
        let bytes = n * s.dtype().size_in_bytes();
        // SAFETY: both ranges lie inside live buffers of at least `bytes` bytes.
        unsafe { result::memcpy_dtod_async(dst, s.buf.ptr_at(l.offset()), bytes, dev.stream().cu_stream()) }
            .map_err(|e| driver_err("cuMemcpyDtoDAsync", e))?;
        return Ok(());
    }
    let name = format!("copy_strided_{}", width_suffix(s.dtype()));
    launch!(dev, modules::COPY, name, cfg_1d(dev, n); KLayout::new(l)?, s.buf.ptr(), dst, n as u64);
    Ok(())
}

pub(super) fn copy_strided(s: &CudaStorage, l: &Layout) -> Result<CudaStorage> {
    let out = CudaStorage::uninit(s.dev(), l.elem_count(), s.dtype())?;
    copy_to_ptr(s, l, out.buf.ptr())?;
    Ok(out)
}

pub(super) fn copy_strided_into(s: &CudaStorage, l: &Layout, dst: &mut CudaStorage, dst_offset: usize) -> Result<()> {
    same_dtype("copy_strided_into", s, dst)?;
    let n = l.elem_count();
    if dst_offset + n > dst.len() {
        return Err(shape_err!("copy_strided_into", "{n} elements at {dst_offset} overflow {}", dst.len()));
    }
    copy_to_ptr(s, l, dst.buf.ptr_at(dst_offset))
}

impl CudaStorage {
    /// `n` copies of `v` (converted to `dtype` exactly as the CPU backend does).
    pub fn full(dev: &Arc<CudaDevice>, v: f64, n: usize, dtype: DType) -> Result<CudaStorage> {
        let s = Self::uninit(dev, n, dtype)?;
        if n == 0 {
            return Ok(s);
        }
        let one = CpuStorage::full(v, 1, dtype)?;
        let mut bits = [0u8; 8];
        bits[..dtype.size_in_bytes()].copy_from_slice(one.as_bytes());
        let bits = u64::from_le_bytes(bits);
        launch!(dev, modules::COPY, format!("fill_{}", width_suffix(dtype)), cfg_1d(dev, n); s.buf.ptr(), bits, n as u64);
        Ok(s)
    }

    /// A scalar zero viewed with `l`'s shape (stride 0 everywhere).
    pub(super) fn zeros_broadcast(&self, l: &Layout) -> Result<(CudaStorage, Layout)> {
        let z = CudaStorage::full(self.dev(), 0.0, 1, self.dtype())?;
        let zl = Layout::new(l.shape().clone(), vec![0; l.dims().len()], 0);
        Ok((z, zl))
    }
}
