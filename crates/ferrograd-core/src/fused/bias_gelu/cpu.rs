//! The CPU reference, in f64 (the twin of `bias_gelu.cu`): `z = x + b` rounded to the dtype, then
//! `op.rs`'s tanh-GELU and its derivative on `z`.

use crate::backend::BackendStorage;
use crate::cpu::CpuStorage;
use crate::op::UnaryOp;
use crate::{Error, Layout, Result};

type Arg<'a> = (&'a CpuStorage, &'a Layout);

/// `x + b` per element of `x` (b over the last dim), rounded to the dtype, as f64.
fn pre_activation((x, xl): Arg<'_>, (b, bl): Arg<'_>) -> Result<Vec<f64>> {
    x.dtype().check_float("bias_gelu")?;
    let (xs, bs) = (x.to_f64_vec(xl)?, b.to_f64_vec(bl)?);
    let c = bs.len().max(1);
    let z = CpuStorage::from_f64_iter(xs.iter().enumerate().map(|(i, v)| v + bs[i % c]), x.dtype())?;
    z.to_f64_vec(&Layout::contiguous(xl.shape().clone()))
}

/// `y = gelu_tanh(x + b)`, contiguous.
pub(super) fn forward(x: Arg<'_>, b: Arg<'_>) -> Result<CpuStorage> {
    let z = pre_activation(x, b)?;
    CpuStorage::from_f64_iter(z.into_iter().map(|v| UnaryOp::GeluTanh.eval_f64(v)), x.0.dtype())
}

/// `(dx, db)`: `dx = dy * gelu_tanh'(x + b)` rounded to the dtype, `db` the column sums of `dx` as
/// rounded (what the kernel sums), in f64, rounded once.
pub(super) fn backward((dy, dyl): Arg<'_>, x: Arg<'_>, b: Arg<'_>) -> Result<(CpuStorage, CpuStorage)> {
    if dyl.dims() != x.1.dims() {
        return Err(Error::ShapeMismatch {
            op: "bias_gelu_backward",
            lhs: dyl.dims().to_vec(),
            rhs: x.1.dims().to_vec(),
        });
    }
    let dtype = x.0.dtype();
    let z = pre_activation(x, b)?;
    let g = dy.to_f64_vec(dyl)?;
    let dx = CpuStorage::from_f64_iter(z.iter().zip(&g).map(|(z, g)| g * UnaryOp::GeluTanhGrad.eval_f64(*z)), dtype)?;
    let dxs = dx.to_f64_vec(&Layout::contiguous(x.1.shape().clone()))?;
    let c = b.1.elem_count();
    let mut db = vec![0.0f64; c];
    if c > 0 {
        for row in dxs.chunks(c) {
            db.iter_mut().zip(row).for_each(|(s, v)| *s += v);
        }
    }
    Ok((dx, CpuStorage::from_f64_iter(db.into_iter(), dtype)?))
}
