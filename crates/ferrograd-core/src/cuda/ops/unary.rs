//! Launches of `kernels/unary.cu`: elementwise maps.

use crate::cuda::klayout::KLayout;
use crate::cuda::launch::{cfg_map, launch};
use crate::cuda::modules;
use crate::cuda::storage::CudaStorage;
use crate::op::UnaryOp;
use crate::{DType, Error, Layout, Result};

pub(super) fn unary(s: &CudaStorage, l: &Layout, op: UnaryOp) -> Result<CudaStorage> {
    if !s.dtype().is_float() && !op.int_ok() {
        return Err(Error::UnsupportedDType { op: op.name(), dtype: s.dtype() });
    }
    let n = l.elem_count();
    let dev = s.dev();
    let out = CudaStorage::uninit(dev, n, s.dtype())?;
    if n > 0 {
        let (code, p0, p1) = op.code();
        // f64 has no vector path in unary.cu (`FgVecUnary<double>`): it keeps the element grid.
        let vector = s.dtype() != DType::F64 && super::vector_ok(s, l);
        launch!(dev, modules::UNARY, format!("unary_{}", s.dtype()), cfg_map(dev, n, s.dtype(), vector, 4);
            KLayout::new(l)?, s.buf.ptr(), out.buf.ptr(), n as u64, code as i32, p0, p1);
    }
    Ok(out)
}
