//! The reference linear, composed from the backend's own ops (matmul, broadcast add, unary maps,
//! reductions). It is the CPU implementation (gemm crate matmul; f16/bf16 computed in f32 and
//! rounded once, as cuBLASLt does) and, without the widening, the CUDA fallback where cuBLASLt
//! has no kernel (cuBLAS matmul and our elementwise kernels).

use super::{out_dims, sizes, Activation, Need, WGrad};
use crate::backend::{BackendStorage, MatmulDims};
use crate::fused::FusedOutputs;
use crate::op::{BinaryOp, ReduceOp, UnaryOp};
use crate::{DType, Layout, Result, Shape};

/// `l` (dims `[..., cols]`) as a `[rows, cols]` layout, when its leading dims merge into one
/// strided dim (always for contiguous views, transposed matrices, narrowed rows); `None` when a
/// copy is needed.
pub(super) fn as_matrix(l: &Layout) -> Option<Layout> {
    let (d, s) = (l.dims(), l.strides());
    let r = d.len();
    let cols = d[r - 1];
    let rows: usize = d[..r - 1].iter().product();
    // (size, stride) of the merged leading dims, innermost first.
    let mut merged: Option<(usize, usize)> = None;
    for i in (0..r - 1).rev() {
        if d[i] == 1 {
            continue;
        }
        merged = match merged {
            None => Some((d[i], s[i])),
            Some((size, stride)) if s[i] == stride * size => Some((size * d[i], stride)),
            Some(_) => return None,
        };
    }
    let row_stride = merged.map_or(cols.max(1), |(_, st)| st);
    Some(Layout::new(Shape::from((rows, cols)), vec![row_stride, s[r - 1]], l.offset()))
}

/// A storage and layout owned or borrowed: the operand as given, or its widened / contiguous copy.
struct Arg<'a, S> {
    own: Option<S>,
    s: &'a S,
    l: Layout,
}

impl<'a, S: BackendStorage> Arg<'a, S> {
    /// `(s, l)` as a `[rows, cols]` matrix in `dtype` (copied only when needed).
    fn matrix(s: &'a S, l: &Layout, dtype: DType) -> Result<Arg<'a, S>> {
        let d = l.dims();
        let contiguous = Layout::contiguous((d[..d.len() - 1].iter().product::<usize>(), d[d.len() - 1]));
        if s.dtype() != dtype {
            return Ok(Arg { own: Some(s.to_dtype(l, dtype)?), s, l: contiguous });
        }
        match as_matrix(l) {
            Some(m) => Ok(Arg { own: None, s, l: m }),
            None => Ok(Arg { own: Some(s.copy_strided(l)?), s, l: contiguous }),
        }
    }

    fn get(&self) -> (&S, &Layout) {
        (self.own.as_ref().unwrap_or(self.s), &self.l)
    }
}

/// The dtype the reference computes in: f32 for f16/bf16 when `widen` (the CPU), else the input's.
fn compute_dtype(dtype: DType, widen: bool) -> DType {
    if widen && matches!(dtype, DType::F16 | DType::BF16) {
        DType::F32
    } else {
        dtype
    }
}

fn act_op(act: Activation) -> Option<UnaryOp> {
    match act {
        Activation::None => None,
        Activation::GeluTanh => Some(UnaryOp::GeluTanh),
        Activation::Relu => Some(UnaryOp::Relu),
    }
}

/// `[y]` or `[y, z]` (z = the pre-activation, `[rows, out]`).
pub(super) fn forward<S: BackendStorage>(
    x: (&S, &Layout),
    w: (&S, &Layout),
    b: Option<(&S, &Layout)>,
    act: Activation,
    save_pre: bool,
    widen: bool,
) -> Result<FusedOutputs<S>> {
    let dtype = x.0.dtype();
    let ct = compute_dtype(dtype, widen);
    let (m, k, n) = sizes(x.1, w.1);
    let xa = Arg::matrix(x.0, x.1, ct)?;
    let wa = Arg::matrix(w.0, w.1, ct)?;
    let (xs, xl) = xa.get();
    let (ws, wl) = wa.get();
    let mut z = xs.matmul(xl, ws, &wl.transpose(0, 1)?, MatmulDims { batch: 1, m, n, k })?;
    let zl = Layout::contiguous((m, n));
    if let Some((bs, bl)) = b {
        let ba = Arg::matrix(bs, &Layout::new(Shape::from((1, n)), vec![n, bl.strides()[0]], bl.offset()), ct)?;
        let (bs, bl) = ba.get();
        z = z.binary(&zl, bs, &bl.broadcast_as(zl.shape())?, BinaryOp::Add)?;
    }
    // y = act(z), or z itself without an activation (then nothing is saved: only GELU saves z).
    let (y, z) = match act_op(act) {
        Some(op) => (z.unary(&zl, op)?, Some(z)),
        None => (z, None),
    };
    let narrow = |s: S| if ct != dtype { s.to_dtype(&zl, dtype) } else { Ok(s) };
    let mut out = vec![(narrow(y)?, Shape::from(out_dims(x.1, n)))];
    if let (true, Some(z)) = (save_pre, z) {
        out.push((narrow(z)?, Shape::from((m, n))));
    }
    Ok(out)
}

/// `[dz]` or `[dz, db]`: `dz = dy * act'(s)` with `s` the pre-activation (GELU) or the output
/// (ReLU), as `[rows, out]`; `db` (when `db` names its dtype) the column sums of dz as stored
/// (summed in f32 at least, rounded to that dtype).
pub(super) fn act_backward<S: BackendStorage>(
    dy: (&S, &Layout),
    s: (&S, &Layout),
    act: Activation,
    db: Option<DType>,
    widen: bool,
) -> Result<FusedOutputs<S>> {
    let dtype = dy.0.dtype();
    let ct = compute_dtype(dtype, widen);
    let da = Arg::matrix(dy.0, dy.1, ct)?;
    let sa = Arg::matrix(s.0, s.1, ct)?;
    let ((ds, dl), (ss, sl)) = (da.get(), sa.get());
    let dz = match act {
        Activation::None => ds.copy_strided(dl)?,
        Activation::GeluTanh => {
            let g = ss.unary(sl, UnaryOp::GeluTanhGrad)?;
            ds.binary(dl, &g, &Layout::contiguous(sl.shape().clone()), BinaryOp::Mul)?
        }
        Activation::Relu => ds.binary(dl, ss, sl, BinaryOp::MaskPositive)?,
    };
    let zl = Layout::contiguous(dl.shape().clone());
    let dz = if ct != dtype { dz.to_dtype(&zl, dtype)? } else { dz };
    let mut out = vec![];
    if let Some(db_dtype) = db {
        // An f32 bias gradient (master weights) is summed in f32 on every backend.
        let acc = compute_dtype(dtype, widen || db_dtype != dtype);
        let wide = if acc != dtype { Some(dz.to_dtype(&zl, acc)?) } else { None };
        let db = wide.as_ref().unwrap_or(&dz).reduce(&zl, ReduceOp::Sum, &[0])?;
        let db = if acc != db_dtype { db.to_dtype(&Layout::contiguous((1, zl.dims()[1])), db_dtype)? } else { db };
        out.push((db, Shape::from(zl.dims()[1])));
    }
    out.insert(0, (dz, dy.1.shape().clone()));
    Ok(out)
}

/// The gradients `need` asks for, in the order dx (x's shape), dw (`[out, in]`, or `[in, out]`
/// when `wg.transposed`), db (`[out]`); dw and db in `wg.dtype` (computed in f32 at least when
/// that is f32).
pub(super) fn grads<S: BackendStorage>(
    dz: (&S, &Layout),
    x: (&S, &Layout),
    w: (&S, &Layout),
    need: Need,
    wg: WGrad,
    widen: bool,
) -> Result<FusedOutputs<S>> {
    let dtype = dz.0.dtype();
    let ct = compute_dtype(dtype, widen || wg.dtype != dtype);
    let (m, k, n) = sizes(x.1, w.1);
    let za = Arg::matrix(dz.0, dz.1, ct)?;
    let (zs, zl) = za.get();
    let back = |s: S, shape: Shape, to: DType| -> Result<(S, Shape)> {
        let s = if ct != to { s.to_dtype(&Layout::contiguous(shape.clone()), to)? } else { s };
        Ok((s, shape))
    };
    let mut out = vec![];
    if need.dx {
        let wa = Arg::matrix(w.0, w.1, ct)?;
        let (ws, wl) = wa.get();
        let dx = zs.matmul(zl, ws, wl, MatmulDims { batch: 1, m, n: k, k: n })?;
        out.push(back(dx, x.1.shape().clone(), dtype)?);
    }
    if need.dw {
        let xa = Arg::matrix(x.0, x.1, ct)?;
        let (xs, xl) = xa.get();
        let (dw, shape) = if wg.transposed {
            // dW^T = x^T dz, `[in, out]`: the layout of a weight stored transposed.
            (xs.matmul(&xl.transpose(0, 1)?, zs, zl, MatmulDims { batch: 1, m: k, n, k: m })?, Shape::from((k, n)))
        } else {
            (zs.matmul(&zl.transpose(0, 1)?, xs, xl, MatmulDims { batch: 1, m: n, n: k, k: m })?, Shape::from((n, k)))
        };
        out.push(back(dw, shape, wg.dtype)?);
    }
    if need.db {
        let db = zs.reduce(zl, ReduceOp::Sum, &[0])?;
        out.push(back(db, Shape::from(n), wg.dtype)?);
    }
    Ok(out)
}
