//! Launches of `kernels/cast.cu`: dtype conversions, read through any layout.

use crate::cuda::klayout::KLayout;
use crate::cuda::launch::{cfg_1d, launch};
use crate::cuda::modules;
use crate::cuda::storage::CudaStorage;
use crate::{DType, Layout, Result};

pub(super) fn to_dtype(s: &CudaStorage, l: &Layout, dtype: DType) -> Result<CudaStorage> {
    if dtype == s.dtype() {
        return super::copy::copy_strided(s, l);
    }
    let n = l.elem_count();
    let dev = s.dev();
    let out = CudaStorage::uninit(dev, n, dtype)?;
    if n > 0 {
        launch!(dev, modules::CAST, format!("cast_{}_{}", s.dtype(), dtype), cfg_1d(dev, n);
            KLayout::new(l)?, s.buf.ptr(), out.buf.ptr(), n as u64);
    }
    Ok(out)
}

impl CudaStorage {
    /// The whole buffer converted to `dtype`.
    pub(crate) fn cast_to(&self, dtype: DType) -> Result<CudaStorage> {
        to_dtype(self, &Layout::contiguous(self.len()), dtype)
    }
}
