//! Reductions over any set of dims. The view is split into "kept" dims (one output each) and
//! "reduced" dims (folded); both are read through strides, so transposed inputs need no copy.
//! Sums accumulate in f64 so that f32/f16 sums of millions of terms stay accurate.

use super::{cpu_dispatch, strided, CpuStorage};
use crate::op::{ArgReduceOp, ReduceOp};
use crate::{Layout, Result, WithDType};
use rayon::prelude::*;

struct Split {
    /// Storage offset of the first reduced element of each output, in output order.
    bases: Vec<usize>,
    /// Offsets of the reduced elements relative to a base.
    inner: Vec<usize>,
}

fn split(l: &Layout, dims: &[usize]) -> Result<Split> {
    let (mut ks, mut kst, mut rs, mut rst) = (vec![], vec![], vec![], vec![]);
    for (i, (&d, &s)) in l.dims().iter().zip(l.strides()).enumerate() {
        if dims.contains(&i) {
            rs.push(d);
            rst.push(s);
        } else {
            ks.push(d);
            kst.push(s);
        }
    }
    let kept = Layout::new(ks.into(), kst, l.offset());
    let red = Layout::new(rs.into(), rst, 0);
    Ok(Split { bases: strided::offsets(&kept)?, inner: strided::offsets(&red)? })
}

fn fold(op: ReduceOp, vals: impl Iterator<Item = f64>) -> f64 {
    match op {
        // Not `Iterator::sum`: for floats it starts from -0.0, so an empty sum would print "-0".
        ReduceOp::Sum => vals.fold(0.0, |a, x| a + x),
        ReduceOp::Max => {
            vals.fold(f64::NEG_INFINITY, |a, x| if x.is_nan() || a.is_nan() { f64::NAN } else { a.max(x) })
        }
        ReduceOp::Min => vals.fold(f64::INFINITY, |a, x| if x.is_nan() || a.is_nan() { f64::NAN } else { a.min(x) }),
    }
}

fn combine(op: ReduceOp, parts: impl Iterator<Item = f64>) -> f64 {
    fold(op, parts)
}

fn reduce_t<T: WithDType>(v: &[T], l: &Layout, op: ReduceOp, dims: &[usize]) -> Result<Vec<T>> {
    let Split { bases, inner } = split(l, dims)?;
    let one = |b: usize, r: &[usize]| fold(op, r.iter().map(|&o| v[b + o].to_f64()));
    let out_f64: Vec<f64> = if bases.len() >= rayon::current_num_threads() * 2 || inner.len() < strided::PAR_MIN {
        bases.par_iter().with_min_len((strided::PAR_MIN / inner.len().max(1)).max(1)).map(|&b| one(b, &inner)).collect()
    } else {
        // Few outputs, many inputs each: split every output's fold across threads.
        bases
            .iter()
            .map(|&b| {
                combine(op, inner.par_chunks(strided::PAR_MIN).map(|c| one(b, c)).collect::<Vec<_>>().into_iter())
            })
            .collect()
    };
    Ok(out_f64.into_iter().map(T::from_f64).collect())
}

pub fn reduce(s: &CpuStorage, l: &Layout, op: ReduceOp, dims: &[usize]) -> Result<CpuStorage> {
    Ok(cpu_dispatch!(s, v => WithDType::to_cpu_storage(reduce_t(v, l, op, dims)?)))
}

fn arg_reduce_t<T: WithDType>(v: &[T], l: &Layout, op: ArgReduceOp, dim: usize) -> Result<Vec<u32>> {
    let Split { bases, inner } = split(l, &[dim])?;
    Ok(bases
        .par_iter()
        .map(|&b| {
            let mut best = 0usize;
            let mut best_v = f64::NAN;
            for (j, &o) in inner.iter().enumerate() {
                let x = v[b + o].to_f64();
                if best_v.is_nan() && j > 0 {
                    break; // NaN wins, as in PyTorch
                }
                let better = j == 0
                    || x.is_nan()
                    || match op {
                        ArgReduceOp::ArgMax => x > best_v,
                        ArgReduceOp::ArgMin => x < best_v,
                    };
                if better {
                    best = j;
                    best_v = x;
                }
            }
            best as u32
        })
        .collect())
}

pub fn arg_reduce(s: &CpuStorage, l: &Layout, op: ArgReduceOp, dim: usize) -> Result<CpuStorage> {
    Ok(CpuStorage::U32(cpu_dispatch!(s, v => arg_reduce_t(v, l, op, dim)?)))
}
