//! The CPU path and reference of `quant.cu`: the same formulas, each step rounded to the kernels'
//! accumulation type (f32 for f32 / f16 / bf16 inputs, f64 for f64; `r` rounds). The int8 matmul
//! accumulates in i64 and must fit i32 (checked by the caller: k * 127 * 127 < 2^31).

use super::RescaleArgs;
use crate::backend::BackendStorage;
use crate::cpu::CpuStorage;
use crate::fused::fake_quantize::from_acc;
use crate::{DType, Error, Layout, Result};

type Arg<'a> = (&'a CpuStorage, &'a Layout);

fn rounding(dtype: DType) -> fn(f64) -> f64 {
    if dtype == DType::F64 {
        |v| v
    } else {
        |v| v as f32 as f64
    }
}

/// Symmetric per-row int8 of `x` viewed as `[rows, cols]`: `(q, scale)`.
pub(super) fn quant_rows((x, xl): Arg<'_>, cols: usize) -> Result<(CpuStorage, CpuStorage)> {
    let r = rounding(x.dtype());
    let v = x.to_f64_vec(xl)?;
    let (mut q, mut scales) = (Vec::with_capacity(v.len()), vec![]);
    for row in v.chunks(cols.max(1)) {
        let m = row.iter().fold(0.0f64, |m, x| m.max(x.abs()));
        let s = if m > 0.0 { ((m as f32) / 127.0f32) as f64 } else { 1.0 };
        let inv = (1.0f32 / s as f32) as f64;
        // A NaN lands on -127 as the kernel's fmin(fmax(NaN, -127), 127) does.
        q.extend(row.iter().map(|&x| {
            let v = r(x * inv).round_ties_even();
            if v.is_nan() {
                -127
            } else {
                v.clamp(-127.0, 127.0) as i8
            }
        }));
        scales.push(s as f32);
    }
    Ok((CpuStorage::from_vec(q), CpuStorage::from_vec(scales)))
}

/// `q * scale[row]` in `dtype`.
pub(super) fn dequant_rows((q, ql): Arg<'_>, (s, sl): Arg<'_>, cols: usize, dtype: DType) -> Result<CpuStorage> {
    let r = rounding(dtype);
    let (q, s) = (q.to_f64_vec(ql)?, s.to_f64_vec(sl)?);
    let y: Vec<f64> = q.iter().enumerate().map(|(i, v)| r(v * s[i / cols.max(1)])).collect();
    from_acc(y, dtype)
}

/// `a [m, k] b [n, k]^T`, int32.
pub(super) fn matmul_nt((a, al): Arg<'_>, (b, bl): Arg<'_>, m: usize, n: usize, k: usize) -> Result<CpuStorage> {
    let to_i = |s: &CpuStorage, l: &Layout| -> Result<Vec<i64>> {
        Ok(s.to_f64_vec(l)?.into_iter().map(|v| v as i64).collect())
    };
    let (a, b) = (to_i(a, al)?, to_i(b, bl)?);
    let mut c = Vec::with_capacity(m * n);
    for i in 0..m {
        let ar = &a[i * k..(i + 1) * k];
        for j in 0..n {
            let s: i64 = ar.iter().zip(&b[j * k..(j + 1) * k]).map(|(x, y)| x * y).sum();
            c.push(
                i32::try_from(s).map_err(|_| Error::InvalidArgument(format!("int8 matmul: sum {s} overflows i32")))?,
            );
        }
    }
    Ok(CpuStorage::from_vec(c))
}

/// `acc[i, j] * sa[i] * sb[j] (+ bias[j])` in `dtype`.
pub(super) fn scale(a: RescaleArgs<'_, CpuStorage>) -> Result<CpuStorage> {
    let RescaleArgs { acc, sa, sb, bias, n, dtype } = a;
    let r = rounding(dtype);
    let (acc, sa, sb) = (acc.0.to_f64_vec(acc.1)?, sa.0.to_f64_vec(sa.1)?, sb.0.to_f64_vec(sb.1)?);
    let bias = bias.map(|(b, l)| b.to_f64_vec(l)).transpose()?;
    let y: Vec<f64> = acc
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            let (row, col) = (i / n.max(1), i % n.max(1));
            let p = r(r(r(v) * sa[row]) * sb[col]);
            bias.as_ref().map_or(p, |b| r(p + b[col]))
        })
        .collect();
    from_acc(y, dtype)
}
