//! The selective scan on the CPU: the forward (rayon over (batch, channel) rows, the recurrence
//! step by step) and the backward (rayon over (batch, group) so that each task owns its slice of
//! dB and dC; per row it recomputes the states, then walks the sequence in reverse). f64 inputs
//! compute in f64 (the reference of the gradcheck and of the CUDA parity tests); the other float
//! dtypes in f32, like the CUDA kernels. Per-channel parameter gradients (dA, dD, d delta_bias)
//! are summed over the batch in a fixed order, so the result is deterministic.

use super::{Inputs, Problem, CHUNK};
use crate::backend::BackendStorage;
use crate::cpu::{alloc, strided, CpuStorage};
use crate::fused::acc::Acc;
use crate::fused::FusedOutputs;
use crate::{DType, Error, Layout, Result, Shape, WithDType};
use rayon::prelude::*;

type Operand<'a> = (&'a CpuStorage, &'a Layout);

/// Every input gathered into a contiguous vector of the accumulation type.
struct Data<A> {
    u: Vec<A>,
    delta: Vec<A>,
    a: Vec<A>,
    b: Vec<A>,
    c: Vec<A>,
    d: Option<Vec<A>>,
    z: Option<Vec<A>>,
    bias: Option<Vec<A>>,
}

fn gather<A: Acc>((s, l): Operand) -> Result<Vec<A>> {
    crate::cpu_dispatch!(s, v => strided::map(v, l, |x| A::of(x.to_f64())))
}

impl<A: Acc> Data<A> {
    fn new(x: &Inputs<Operand>) -> Result<Data<A>> {
        Ok(Data {
            u: gather(x.u)?,
            delta: gather(x.delta)?,
            a: gather(x.a)?,
            b: gather(x.b)?,
            c: gather(x.c)?,
            d: x.d.map(gather).transpose()?,
            z: x.z.map(gather).transpose()?,
            bias: x.bias.map(gather).transpose()?,
        })
    }
}

/// One (batch, channel) row: its slices of the inputs.
struct Row<'a, A> {
    u: &'a [A],
    delta: &'a [A],
    z: Option<&'a [A]>,
    a: &'a [A],
    /// B and C of the row's group, `[state, len]`.
    b: &'a [A],
    c: &'a [A],
    d: A,
    bias: A,
}

impl<A: Acc> Data<A> {
    fn row(&self, pb: &Problem, bb: usize, d: usize) -> Row<'_, A> {
        let (len, st) = (pb.len, pb.state);
        let r = (bb * pb.dim + d) * len;
        let g = bb * pb.groups + d / pb.dim_per_group();
        Row {
            u: &self.u[r..r + len],
            delta: &self.delta[r..r + len],
            z: self.z.as_ref().map(|z| &z[r..r + len]),
            a: &self.a[d * st..(d + 1) * st],
            b: &self.b[g * st * len..(g + 1) * st * len],
            c: &self.c[g * st * len..(g + 1) * st * len],
            d: self.d.as_ref().map_or(A::zero(), |v| v[d]),
            bias: self.bias.as_ref().map_or(A::zero(), |v| v[d]),
        }
    }
}

/// `softplus` as PyTorch's (threshold 20), or the identity.
fn dt_of<A: Acc>(raw: A, softplus: bool) -> A {
    if softplus && raw <= A::of(20.0) {
        raw.exp().ln_1p()
    } else {
        raw
    }
}

fn sigmoid<A: Acc>(x: A) -> A {
    A::one() / (A::one() + (-x).exp())
}

fn acc_dtype(dtype: DType) -> Result<bool> {
    match dtype {
        DType::F64 => Ok(true),
        DType::F32 | DType::F16 | DType::BF16 => Ok(false),
        _ => Err(Error::UnsupportedDType { op: super::OP, dtype }),
    }
}

fn out<A: Acc>(x: &[A], dims: Vec<usize>, dtype: DType) -> Result<(CpuStorage, Shape)> {
    Ok((CpuStorage::from_f64_iter(x.iter().map(|v| v.f64()), dtype)?, Shape::from(dims)))
}

/// Outputs: out `[batch, dim, len]` in u's dtype, the chunk-end states `[batch, dim, chunks,
/// state]` (f64 for f64 inputs, else f32).
pub(super) fn forward(pb: &Problem, x: &Inputs<Operand>) -> Result<FusedOutputs<CpuStorage>> {
    let dtype = x.u.0.dtype();
    if acc_dtype(dtype)? {
        forward_as::<f64>(pb, x, dtype, DType::F64)
    } else {
        forward_as::<f32>(pb, x, dtype, DType::F32)
    }
}

fn forward_as<A: Acc>(pb: &Problem, x: &Inputs<Operand>, dtype: DType, sdt: DType) -> Result<FusedOutputs<CpuStorage>> {
    let data = Data::<A>::new(x)?;
    let (len, st, nc) = (pb.len, pb.state, pb.chunks());
    let rows = pb.batch * pb.dim;
    let mut o = alloc::zeroed::<A>(rows * len)?;
    let mut states = alloc::zeroed::<A>(rows * nc * st)?;
    if len > 0 {
        let rows = o.par_chunks_mut(len).zip(states.par_chunks_mut((nc * st).max(1))).enumerate();
        rows.try_for_each(|(r, (orow, srow))| -> Result<()> {
            let row = data.row(pb, r / pb.dim, r % pb.dim);
            let mut h = alloc::zeroed::<A>(st)?;
            for l in 0..len {
                let dt = dt_of(row.delta[l] + row.bias, pb.softplus);
                let du = dt * row.u[l];
                let mut y = A::zero();
                for (n, hn) in h.iter_mut().enumerate() {
                    *hn = (dt * row.a[n]).exp() * *hn + du * row.b[n * len + l];
                    y += row.c[n * len + l] * *hn;
                }
                y += row.d * row.u[l];
                if let Some(z) = row.z {
                    y = y * z[l] * sigmoid(z[l]);
                }
                orow[l] = y;
                if (l + 1) % CHUNK == 0 || l + 1 == len {
                    srow[(l / CHUNK) * st..][..st].copy_from_slice(&h);
                }
            }
            Ok(())
        })?;
    }
    Ok(vec![out(&o, vec![pb.batch, pb.dim, len], dtype)?, out(&states, vec![pb.batch, pb.dim, nc, st], sdt)?])
}

/// Outputs: the gradients of the forward's inputs in their order (du, ddelta, dA, dB, dC, then
/// dD, dz, d delta_bias where present), each in its input's dtype. The CPU recomputes every state
/// from the inputs, so the saved states are only checked for their shape.
pub(super) fn backward(
    pb: &Problem,
    x: &Inputs<Operand>,
    states: Operand,
    dout: Operand,
) -> Result<FusedOutputs<CpuStorage>> {
    let want = [pb.batch, pb.dim, pb.chunks(), pb.state];
    if states.1.dims() != want {
        return Err(Error::ShapeMismatch {
            op: "selective_scan_backward",
            lhs: want.to_vec(),
            rhs: states.1.dims().to_vec(),
        });
    }
    if acc_dtype(x.u.0.dtype())? {
        backward_as::<f64>(pb, x, dout)
    } else {
        backward_as::<f32>(pb, x, dout)
    }
}

/// One task's share of the per-channel parameter gradients: dA `[dpg, state]`, dD and
/// d delta_bias `[dpg]`, for the channels of one group of one batch row.
struct ParamGrads<A> {
    da: Vec<A>,
    dd: Vec<A>,
    dbias: Vec<A>,
}

fn backward_as<A: Acc>(pb: &Problem, x: &Inputs<Operand>, dout: Operand) -> Result<FusedOutputs<CpuStorage>> {
    let data = Data::<A>::new(x)?;
    let dout = gather::<A>(dout)?;
    let (len, st, dpg) = (pb.len, pb.state, pb.dim_per_group());
    let n_x = pb.batch * pb.dim * len;
    let n_bc = pb.batch * pb.groups * st * len;
    let (mut du, mut ddelta, mut dz) = (alloc::zeroed::<A>(n_x)?, alloc::zeroed::<A>(n_x)?, alloc::zeroed::<A>(n_x)?);
    let (mut db, mut dc) = (alloc::zeroed::<A>(n_bc)?, alloc::zeroed::<A>(n_bc)?);
    let tasks = pb.batch * pb.groups;
    let mut parts: Vec<ParamGrads<A>> = Vec::new();
    if len > 0 && st > 0 && dpg > 0 && tasks > 0 {
        parts = du
            .par_chunks_mut(dpg * len)
            .zip(ddelta.par_chunks_mut(dpg * len))
            .zip(dz.par_chunks_mut(dpg * len))
            .zip(db.par_chunks_mut(st * len).zip(dc.par_chunks_mut(st * len)))
            .enumerate()
            .map(|(t, (((du, ddelta), dz), (db, dc)))| {
                let (bb, g) = (t / pb.groups, t % pb.groups);
                let mut p = ParamGrads {
                    da: alloc::zeroed::<A>(dpg * st)?,
                    dd: alloc::zeroed::<A>(dpg)?,
                    dbias: alloc::zeroed::<A>(dpg)?,
                };
                let mut hs = alloc::zeroed::<A>(len * st)?;
                for k in 0..dpg {
                    let d = g * dpg + k;
                    let row = data.row(pb, bb, d);
                    let r = (bb * pb.dim + d) * len;
                    let rows = RowGrads {
                        du: &mut du[k * len..(k + 1) * len],
                        ddelta: &mut ddelta[k * len..(k + 1) * len],
                        dz: &mut dz[k * len..(k + 1) * len],
                        db: &mut *db,
                        dc: &mut *dc,
                        da: &mut p.da[k * st..(k + 1) * st],
                        dd: &mut p.dd[k],
                        dbias: &mut p.dbias[k],
                    };
                    row_backward(pb, &row, &dout[r..r + len], &mut hs, rows)?;
                }
                Ok(p)
            })
            .collect::<Result<_>>()?;
    }
    // The parameter gradients: the tasks' shares summed over the batch, in batch order.
    let (mut da, mut dd, mut dbias) =
        (alloc::zeroed::<A>(pb.dim * st)?, alloc::zeroed::<A>(pb.dim)?, alloc::zeroed::<A>(pb.dim)?);
    for (t, p) in parts.iter().enumerate() {
        let g = t % pb.groups;
        for k in 0..dpg {
            let d = g * dpg + k;
            for n in 0..st {
                da[d * st + n] += p.da[k * st + n];
            }
            dd[d] += p.dd[k];
            dbias[d] += p.dbias[k];
        }
    }
    let xd = |s: &(&CpuStorage, &Layout)| s.0.dtype();
    let xdims = vec![pb.batch, pb.dim, len];
    let bcdims = vec![pb.batch, pb.groups, st, len];
    let mut res = vec![
        out(&du, xdims.clone(), xd(&x.u))?,
        out(&ddelta, xdims.clone(), xd(&x.delta))?,
        out(&da, vec![pb.dim, st], xd(&x.a))?,
        out(&db, bcdims.clone(), xd(&x.b))?,
        out(&dc, bcdims, xd(&x.c))?,
    ];
    if let Some(d) = &x.d {
        res.push(out(&dd, vec![pb.dim], xd(d))?);
    }
    if let Some(z) = &x.z {
        res.push(out(&dz, xdims, xd(z))?);
    }
    if let Some(b) = &x.bias {
        res.push(out(&dbias, vec![pb.dim], xd(b))?);
    }
    Ok(res)
}

/// Where one row's gradients go: its rows of du, d delta, dz; its group's dB and dC `[state,
/// len]` (added to); its channel's dA `[state]`, dD and d delta_bias (added to).
struct RowGrads<'a, A> {
    du: &'a mut [A],
    ddelta: &'a mut [A],
    dz: &'a mut [A],
    db: &'a mut [A],
    dc: &'a mut [A],
    da: &'a mut [A],
    dd: &'a mut A,
    dbias: &'a mut A,
}

/// One row's backward: the states `hs` (`[len, state]`, scratch) recomputed forward, then the
/// reverse walk with `s[n]` = a_{l+1} * dL/dh_{l+1}[n] carried.
fn row_backward<A: Acc>(pb: &Problem, row: &Row<A>, dout: &[A], hs: &mut [A], g: RowGrads<A>) -> Result<()> {
    let (len, st) = (pb.len, pb.state);
    let dts = alloc::collect((0..len).map(|l| dt_of(row.delta[l] + row.bias, pb.softplus)))?;
    let mut h = alloc::zeroed::<A>(st)?;
    for l in 0..len {
        let du = dts[l] * row.u[l];
        for n in 0..st {
            h[n] = (dts[l] * row.a[n]).exp() * h[n] + du * row.b[n * len + l];
            hs[l * st + n] = h[n];
        }
    }
    let mut s = alloc::zeroed::<A>(st)?;
    for l in (0..len).rev() {
        let (u, dt) = (row.u[l], dts[l]);
        let dy = match row.z {
            Some(z) => {
                let (zl, sg) = (z[l], sigmoid(z[l]));
                let y = (0..st).fold(row.d * u, |acc, n| acc + row.c[n * len + l] * hs[l * st + n]);
                g.dz[l] = dout[l] * y * sg * (A::one() + zl * (A::one() - sg));
                dout[l] * zl * sg
            }
            None => dout[l],
        };
        *g.dd += dy * u;
        let (mut du, mut ddt) = (dy * row.d, A::zero());
        for n in 0..st {
            let (an, bn, cn) = (row.a[n], row.b[n * len + l], row.c[n * len + l]);
            let a = (dt * an).exp();
            let prev = if l > 0 { hs[(l - 1) * st + n] } else { A::zero() };
            let dh = dy * cn + s[n];
            ddt += dh * (prev * a * an + bn * u);
            g.da[n] += dh * prev * a * dt;
            du += dh * dt * bn;
            g.db[n * len + l] += dh * dt * u;
            g.dc[n * len + l] += dy * hs[l * st + n];
            s[n] = a * dh;
        }
        g.du[l] = du;
        let raw = row.delta[l] + row.bias;
        if pb.softplus && raw <= A::of(20.0) {
            ddt = ddt * sigmoid(raw);
        }
        g.ddelta[l] = ddt;
        *g.dbias += ddt;
    }
    Ok(())
}
