//! Launches of `kernels/unary.cu`: elementwise maps.

use crate::cuda::klayout::KLayout;
use crate::cuda::launch::{cfg_1d, launch};
use crate::cuda::modules;
use crate::cuda::storage::CudaStorage;
use crate::op::UnaryOp;
use crate::{Error, Layout, Result};

fn unary_code(op: UnaryOp) -> (i32, f64, f64) {
    match op {
        UnaryOp::Neg => (0, 0., 0.),
        UnaryOp::Abs => (1, 0., 0.),
        UnaryOp::Sqr => (2, 0., 0.),
        UnaryOp::Sign => (3, 0., 0.),
        UnaryOp::Relu => (4, 0., 0.),
        UnaryOp::Exp => (5, 0., 0.),
        UnaryOp::Log => (6, 0., 0.),
        UnaryOp::Sqrt => (7, 0., 0.),
        UnaryOp::Rsqrt => (8, 0., 0.),
        UnaryOp::Recip => (9, 0., 0.),
        UnaryOp::Tanh => (10, 0., 0.),
        UnaryOp::Sigmoid => (11, 0., 0.),
        UnaryOp::GeluTanh => (12, 0., 0.),
        UnaryOp::GeluErf => (13, 0., 0.),
        UnaryOp::Silu => (14, 0., 0.),
        UnaryOp::Sin => (15, 0., 0.),
        UnaryOp::Cos => (16, 0., 0.),
        UnaryOp::Affine { mul, add } => (17, mul, add),
        UnaryOp::Powf(e) => (18, e, 0.),
        UnaryOp::Clamp { min, max } => (19, min, max),
        UnaryOp::GeluTanhGrad => (20, 0., 0.),
        UnaryOp::GeluErfGrad => (21, 0., 0.),
        UnaryOp::SiluGrad => (22, 0., 0.),
    }
}

pub(super) fn unary(s: &CudaStorage, l: &Layout, op: UnaryOp) -> Result<CudaStorage> {
    if !s.dtype().is_float() && !op.int_ok() {
        return Err(Error::UnsupportedDType { op: op.name(), dtype: s.dtype() });
    }
    let n = l.elem_count();
    let dev = s.dev();
    let out = CudaStorage::uninit(dev, n, s.dtype())?;
    if n > 0 {
        let (code, p0, p1) = unary_code(op);
        launch!(dev, modules::UNARY, format!("unary_{}", s.dtype()), cfg_1d(dev, n);
            KLayout::new(l)?, s.buf.ptr(), out.buf.ptr(), n as u64, code, p0, p1);
    }
    Ok(out)
}
