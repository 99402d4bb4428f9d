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
        // f64 has no vector kernel in unary.cu: it keeps the element grid.
        let vector = s.dtype() != DType::F64 && super::vector_ok(s, l);
        // Contiguous, aligned f32 / f16 / bf16: `unary_vec_*` or `unary_vec_math_*`, kernels of
        // their own with PyTorch's traversal (unary.cu says why; on an H200 they moved relu /
        // sigmoid / x * 2 from 97% to 99-100% of a device copy, 0.98x -> 1.00-1.02x PyTorch's GB/s).
        if let Some(kernel) = vec_kernel(op).filter(|_| vector && s.dtype().is_float()) {
            let nv = n / (16 / s.dtype().size_in_bytes());
            let blocks = nv.div_ceil(VEC_THREADS * VEC_PER).clamp(1, i32::MAX as usize) as u32;
            let cfg =
                LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (VEC_THREADS as u32, 1, 1), shared_mem_bytes: 0 };
            launch!(dev, modules::UNARY, format!("{kernel}_{}", s.dtype()), cfg;
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

/// The vector kernel whose switch runs `op`: `unary_vec_*` for the activations that carry most
/// elementwise traffic, `unary_vec_math_*` for the other float ops but sin, cos and powf (which
/// stay in `unary_*`, as every strided or misaligned call does).
fn vec_kernel(op: UnaryOp) -> Option<&'static str> {
    use UnaryOp as U;
    match op {
        U::Relu | U::Sigmoid | U::Silu | U::Affine { .. } => Some("unary_vec"),
        // Listed one by one: an op added to UnaryOp runs in `unary_*` until its case is in a switch.
        U::Neg
        | U::Abs
        | U::Sqr
        | U::Sign
        | U::Exp
        | U::Log
        | U::Sqrt
        | U::Rsqrt
        | U::Recip
        | U::Tanh
        | U::GeluTanh
        | U::GeluErf
        | U::Clamp { .. }
        | U::GeluTanhGrad
        | U::GeluErfGrad
        | U::SiluGrad => Some("unary_vec_math"),
        _ => None,
    }
}
