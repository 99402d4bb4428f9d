//! Scaled dot-product attention on the CPU: the forward (online softmax over blocks of keys) and
//! the backward (recomputing the probabilities from the saved log-sum-exp), rayon-parallel over
//! heads and blocks of rows. f64 inputs compute in f64 (the reference the CUDA parity tests and
//! the gradcheck use); f32 / f16 / bf16 in f32.
//!
//! Each view is gathered once into a contiguous `[B, H, T, D]` vector of the accumulation type;
//! results are written back as `[B, T, H, D]` (the op's output layout, see `mod.rs`). The backward
//! makes two passes so that no two tasks write the same row: dK and dV per block of keys (walking
//! the queries that see them), then dQ per block of queries (walking their keys); the second pass
//! recomputes P, which costs time but no atomics and keeps the result deterministic.

use super::{lse_dtype, Dropout, Problem};
use crate::backend::BackendStorage;
use crate::cpu::{strided, CpuStorage};
use crate::fused::acc::Acc;
use crate::fused::FusedOutputs;
use crate::{DType, Error, Layout, Result, Shape, WithDType};
use rayon::prelude::*;

/// Query rows per parallel task (forward, dQ); keys per block (forward step, dK / dV task).
const QB: usize = 32;
const KB: usize = 64;

/// A view whose dims are `[B, H, T, D]` (or `[B, H, T]`) as a contiguous vector of `A`.
fn gather<A: Acc>(s: &CpuStorage, l: &Layout) -> Result<Vec<A>> {
    crate::cpu_dispatch!(s, v => strided::map(v, l, |x| A::of(x.to_f64())))
}

/// A `[B, T, H, D]` layout (the op's output and its gradient) viewed as `[B, H, T, D]`.
fn bhtd(l: &Layout) -> Result<Layout> {
    l.permute(&[0, 2, 1, 3])
}

/// `[B, H, T, D]` values written out as a `[B, T, H, D]` storage of `dtype`.
fn to_bthd<A: Acc>(x: &[A], (b, h, t, d): (usize, usize, usize, usize), dtype: DType) -> Result<CpuStorage> {
    let it = (0..b * t * h * d).map(|e| {
        let (r, dd) = (e / d, e % d);
        let (r, hh) = (r / h, r % h);
        let (bb, tt) = (r / t, r % t);
        x[((bb * h + hh) * t + tt) * d + dd].f64()
    });
    CpuStorage::from_f64_iter(it, dtype)
}

fn dot<A: Acc>(a: &[A], b: &[A]) -> A {
    let mut s = [A::zero(); 4];
    let (ca, cb) = (a.chunks_exact(4), b.chunks_exact(4));
    let tail: A = ca.remainder().iter().zip(cb.remainder()).fold(A::zero(), |acc, (&x, &y)| acc + x * y);
    for (x, y) in ca.zip(cb) {
        for i in 0..4 {
            s[i] += x[i] * y[i];
        }
    }
    (s[0] + s[1]) + (s[2] + s[3]) + tail
}

/// `y += a x`.
fn axpy<A: Acc>(y: &mut [A], a: A, x: &[A]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

/// Dropout decisions along one query row, one Philox block per 8 keys, drawn as the keys are
/// visited in increasing order.
struct RowMask<'a> {
    drop: &'a Dropout,
    pb: &'a Problem,
    bh: usize,
    i: usize,
    block: Option<(usize, [u32; 4])>,
}

impl<'a> RowMask<'a> {
    fn new(drop: &'a Dropout, pb: &'a Problem, bh: usize, i: usize) -> Self {
        RowMask { drop, pb, bh, i, block: None }
    }

    fn keeps(&mut self, j: usize) -> bool {
        let jb8 = j / 8;
        let words = match self.block {
            Some((b, w)) if b == jb8 => w,
            _ => {
                let w = self.drop.words(self.bh, self.pb.tq, self.pb.tk, self.i, jb8);
                self.block = Some((jb8, w));
                w
            }
        };
        self.drop.keeps(&words, j)
    }
}

fn float_dtype(dtype: DType) -> Result<bool> {
    match dtype {
        DType::F64 => Ok(true),
        DType::F32 | DType::F16 | DType::BF16 => Ok(false),
        _ => Err(Error::UnsupportedDType { op: super::OP, dtype }),
    }
}

type Operand<'a> = (&'a CpuStorage, &'a Layout);

/// Outputs: O `[B, Tq, H, D]` in the inputs' dtype, the log-sum-exp `[B, H, Tq]`.
pub(super) fn forward(pb: &Problem, q: Operand, k: Operand, v: Operand) -> Result<FusedOutputs<CpuStorage>> {
    let dtype = q.0.dtype();
    if float_dtype(dtype)? {
        forward_as::<f64>(pb, q, k, v, dtype)
    } else {
        forward_as::<f32>(pb, q, k, v, dtype)
    }
}

fn forward_as<A: Acc>(
    pb: &Problem,
    q: Operand,
    k: Operand,
    v: Operand,
    dtype: DType,
) -> Result<FusedOutputs<CpuStorage>> {
    let (qv, kv, vv) = (gather::<A>(q.0, q.1)?, gather::<A>(k.0, k.1)?, gather::<A>(v.0, v.1)?);
    let Problem { b, h, tq, tk, d, .. } = *pb;
    let mut o = vec![A::zero(); b * h * tq * d];
    let mut lse = vec![A::zero(); b * h * tq];
    if !o.is_empty() {
        o.par_chunks_mut(tq * d).zip(lse.par_chunks_mut(tq)).enumerate().for_each(|(bh, (oh, lh))| {
            let (qh, kh, vh) = (&qv[bh * tq * d..], &kv[bh * tk * d..(bh + 1) * tk * d], &vv[bh * tk * d..]);
            oh.par_chunks_mut(QB * d)
                .zip(lh.par_chunks_mut(QB))
                .enumerate()
                .for_each(|(qb, (oc, lc))| forward_rows(pb, bh, qb * QB, qh, kh, vh, oc, lc));
        });
    }
    Ok(vec![
        (to_bthd(&o, (b, h, tq, d), dtype)?, Shape::from(vec![b, tq, h, d])),
        (CpuStorage::from_f64_iter(lse.iter().map(|x| x.f64()), lse_dtype(dtype))?, Shape::from(vec![b, h, tq])),
    ])
}

/// Query rows `i0 ..` (as many as `lc` holds) of head `bh`: output rows into `oc`, log-sum-exp
/// into `lc`. Online softmax over blocks of KB keys, as the CUDA kernel does.
#[allow(clippy::too_many_arguments)]
fn forward_rows<A: Acc>(pb: &Problem, bh: usize, i0: usize, qh: &[A], kh: &[A], vh: &[A], oc: &mut [A], lc: &mut [A]) {
    let (d, tk) = (pb.d, pb.tk);
    let scale = A::of(pb.scale);
    let rows = lc.len();
    let mut m = vec![A::neg_infinity(); rows];
    let mut l = vec![A::zero(); rows];
    let mut s = [A::zero(); KB];
    let kv_end = if pb.causal { tk.min(i0 + rows) } else { tk };
    for j0 in (0..kv_end).step_by(KB) {
        let j1 = (j0 + KB).min(kv_end);
        for r in 0..rows {
            let i = i0 + r;
            let jmax = if pb.causal { j1.min(i + 1) } else { j1 };
            if jmax <= j0 {
                continue;
            }
            let qi = &qh[i * d..(i + 1) * d];
            let mut mx = A::neg_infinity();
            for (jj, sj) in s[..jmax - j0].iter_mut().enumerate() {
                let j = j0 + jj;
                *sj = scale * dot(qi, &kh[j * d..(j + 1) * d]);
                mx = mx.max(*sj);
            }
            let mnew = m[r].max(mx);
            let alpha = if m[r] == A::neg_infinity() { A::zero() } else { (m[r] - mnew).exp() };
            let orow = &mut oc[r * d..(r + 1) * d];
            orow.iter_mut().for_each(|x| *x = *x * alpha);
            l[r] = l[r] * alpha;
            let mut mask = pb.dropout.as_ref().map(|dr| RowMask::new(dr, pb, bh, i));
            for (jj, &sj) in s[..jmax - j0].iter().enumerate() {
                let j = j0 + jj;
                let p = (sj - mnew).exp();
                l[r] += p;
                if mask.as_mut().is_none_or(|mk| mk.keeps(j)) {
                    axpy(orow, p, &vh[j * d..(j + 1) * d]);
                }
            }
            m[r] = mnew;
        }
    }
    let rp = A::of(pb.dropout.map_or(1.0, |dr| 1.0 / (1.0 - dr.p)));
    for r in 0..rows {
        lc[r] = m[r] + l[r].ln();
        let inv = rp / l[r];
        oc[r * d..(r + 1) * d].iter_mut().for_each(|x| *x = *x * inv);
    }
}

/// Outputs: dq `[B, Tq, H, D]`, dk and dv `[B, Tk, H, D]`, in the inputs' dtype. `o` and `dout`
/// are `[B, Tq, H, D]`-shaped, `lse` `[B, H, Tq]`.
pub(super) fn backward(
    pb: &Problem,
    q: Operand,
    k: Operand,
    v: Operand,
    o: Operand,
    dout: Operand,
    lse: Operand,
) -> Result<FusedOutputs<CpuStorage>> {
    let dtype = q.0.dtype();
    let (ol, dl) = (bhtd(o.1)?, bhtd(dout.1)?);
    if float_dtype(dtype)? {
        backward_as::<f64>(pb, [q, k, v, (o.0, &ol), (dout.0, &dl), lse], dtype)
    } else {
        backward_as::<f32>(pb, [q, k, v, (o.0, &ol), (dout.0, &dl), lse], dtype)
    }
}

fn backward_as<A: Acc>(pb: &Problem, x: [Operand; 6], dtype: DType) -> Result<FusedOutputs<CpuStorage>> {
    let [q, k, v, o, dout, lse] = x.map(|(s, l)| gather::<A>(s, l));
    let (q, k, v, o, dout, lse) = (q?, k?, v?, o?, dout?, lse?);
    let Problem { b, h, tq, tk, d, causal, .. } = *pb;
    let scale = A::of(pb.scale);
    let rp = A::of(pb.dropout.map_or(1.0, |dr| 1.0 / (1.0 - dr.p)));
    // delta_i = dO_i . O_i (the row sum of P * dP).
    let delta: Vec<A> =
        (0..b * h * tq).into_par_iter().map(|r| dot(&dout[r * d..(r + 1) * d], &o[r * d..(r + 1) * d])).collect();

    // One (query, key) pair: (P kept and scaled for dV, dS).
    let pair = |bh: usize, i: usize, j: usize, mask: &mut Option<RowMask>| -> (A, A) {
        let (qi, di) = (&q[(bh * tq + i) * d..][..d], &dout[(bh * tq + i) * d..][..d]);
        let (kj, vj) = (&k[(bh * tk + j) * d..][..d], &v[(bh * tk + j) * d..][..d]);
        let p = (scale * dot(qi, kj) - lse[bh * tq + i]).exp();
        let dp = dot(di, vj);
        let keep = mask.as_mut().is_none_or(|mk| mk.keeps(j));
        let (pk, dpk) = if keep { (p * rp, dp * rp) } else { (A::zero(), A::zero()) };
        (pk, p * (dpk - delta[bh * tq + i]))
    };

    let mut dk = vec![A::zero(); b * h * tk * d];
    let mut dv = vec![A::zero(); b * h * tk * d];
    if !dk.is_empty() {
        dk.par_chunks_mut(tk * d).zip(dv.par_chunks_mut(tk * d)).enumerate().for_each(|(bh, (dkh, dvh))| {
            dkh.par_chunks_mut(KB * d).zip(dvh.par_chunks_mut(KB * d)).enumerate().for_each(|(kb, (dkc, dvc))| {
                let j0 = kb * KB;
                let n = dkc.len() / d;
                for i in (if causal { j0 } else { 0 })..tq {
                    let (qi, di) = (&q[(bh * tq + i) * d..][..d], &dout[(bh * tq + i) * d..][..d]);
                    let mut mask = pb.dropout.as_ref().map(|dr| RowMask::new(dr, pb, bh, i));
                    for jj in 0..n {
                        let j = j0 + jj;
                        if causal && j > i {
                            break;
                        }
                        let (pk, ds) = pair(bh, i, j, &mut mask);
                        axpy(&mut dvc[jj * d..(jj + 1) * d], pk, di);
                        axpy(&mut dkc[jj * d..(jj + 1) * d], scale * ds, qi);
                    }
                }
            });
        });
    }

    let mut dq = vec![A::zero(); b * h * tq * d];
    if !dq.is_empty() {
        dq.par_chunks_mut(tq * d).enumerate().for_each(|(bh, dqh)| {
            dqh.par_chunks_mut(QB * d).enumerate().for_each(|(qb, dqc)| {
                for (r, dqi) in dqc.chunks_mut(d).enumerate() {
                    let i = qb * QB + r;
                    let jmax = if causal { tk.min(i + 1) } else { tk };
                    let mut mask = pb.dropout.as_ref().map(|dr| RowMask::new(dr, pb, bh, i));
                    for j in 0..jmax {
                        let (_, ds) = pair(bh, i, j, &mut mask);
                        axpy(dqi, scale * ds, &k[(bh * tk + j) * d..][..d]);
                    }
                }
            });
        });
    }
    Ok(vec![
        (to_bthd(&dq, (b, h, tq, d), dtype)?, Shape::from(vec![b, tq, h, d])),
        (to_bthd(&dk, (b, h, tk, d), dtype)?, Shape::from(vec![b, tk, h, d])),
        (to_bthd(&dv, (b, h, tk, d), dtype)?, Shape::from(vec![b, tk, h, d])),
    ])
}
