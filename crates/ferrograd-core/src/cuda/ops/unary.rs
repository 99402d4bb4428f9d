//! Launches of `kernels/unary.cu`: elementwise maps.

use crate::cuda::klayout::KLayout;
use crate::cuda::launch::{cfg_map, launch};
use crate::cuda::modules;
use crate::cuda::storage::CudaStorage;
use crate::op::UnaryOp;
use crate::{DType, Error, Layout, Result};
use cudarc::driver::LaunchConfig;

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
        // The hot activations of contiguous, aligned float tensors: `unary_vec_*`, a kernel of
        // their own with PyTorch's traversal (unary.cu says why; on an H200 it moved relu /
        // sigmoid / x * 2 from 97% to 99-100% of a device copy, 0.98x -> 1.00-1.01x PyTorch's GB/s).
        if vector && s.dtype().is_float() && vec_kernel_op(op) {
            let nv = n / (16 / s.dtype().size_in_bytes());
            let blocks = nv.div_ceil(VEC_THREADS * VEC_PER).clamp(1, i32::MAX as usize) as u32;
            let cfg =
                LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (VEC_THREADS as u32, 1, 1), shared_mem_bytes: 0 };
            launch!(dev, modules::UNARY, format!("unary_vec_{}", s.dtype()), cfg;
                s.buf.ptr_at(l.offset()), out.buf.ptr(), n as u64, code as i32, p0, p1);
            return Ok(out);
        }
        launch!(dev, modules::UNARY, format!("unary_{}", s.dtype()), cfg_map(dev, n, s.dtype(), vector, 4);
            KLayout::new(l)?, s.buf.ptr(), out.buf.ptr(), n as u64, code as i32, p0, p1);
    }
    Ok(out)
}

/// `unary_vec_*`'s block (`FG_VEC_THREADS`) and its 16-byte vectors a thread (`FG_VEC_PER`).
const VEC_THREADS: usize = 128;
const VEC_PER: usize = 2;

/// The ops `unary_vec_*` runs (its switch): the activations that carry elementwise traffic.
fn vec_kernel_op(op: UnaryOp) -> bool {
    matches!(op, UnaryOp::Relu | UnaryOp::Sigmoid | UnaryOp::Silu | UnaryOp::Affine { .. })
}
