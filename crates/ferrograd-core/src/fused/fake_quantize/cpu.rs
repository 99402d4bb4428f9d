//! The CPU reference (the twin of `fake_quantize.cu`). Every step is rounded as the kernel rounds
//! it: to f32 for f32 / f16 / bf16 inputs (`r32` after each f64 operation on f32 values gives the
//! f32 result exactly: f64 has more than twice f32's precision), in f64 for f64 inputs. The sums of
//! the scale and zero-point gradients are taken in f64 and rounded once to f32.

use super::{geometry, FakeQuant};
use crate::backend::BackendStorage;
use crate::cpu::CpuStorage;
use crate::{DType, Error, Layout, Result};

type Arg<'a> = (&'a CpuStorage, &'a Layout);

/// One element's quantization, in the accumulation precision `r` rounds to.
pub(crate) struct Elem {
    /// `round_half_even(x / scale) + zp`, before the clamp.
    pub raw: f64,
    /// `(clamp(raw) - zp) * scale`.
    pub y: f64,
}

/// The effective zero point: rounded half to even, clamped to the range.
pub(crate) fn zero_point(zp: f64, q: &FakeQuant) -> f64 {
    zp.round_ties_even().clamp(q.qmin as f64, q.qmax as f64)
}

/// Quantize one value as the kernel does; `r` rounds to the accumulation type.
pub(crate) fn quantize(x: f64, scale: f64, zp: f64, q: &FakeQuant, r: impl Fn(f64) -> f64) -> Elem {
    let inv = r(1.0 / scale);
    let raw = r(r(x * inv).round_ties_even() + zp);
    // f64::max / min ignore a NaN, as fmaxf / fminf: a NaN x lands on qmin, masked out.
    let c = raw.max(q.qmin as f64).min(q.qmax as f64);
    Elem { raw, y: r(r(c - zp) * scale) }
}

/// Values already rounded to the accumulation type (f32, or f64 for f64) as a storage of `dtype`,
/// rounded once more from f32 as the kernels' `__float2bfloat16_rn` / `__float2half_rn` do.
/// (`CpuStorage::from_f64_iter` goes through `half`'s `from_f64`, whose bf16 rounding reads only
/// the top 32 bits of the f64 and so misrounds some f32 values just past a tie.)
pub(crate) fn from_acc(v: Vec<f64>, dtype: DType) -> Result<CpuStorage> {
    use half::{bf16, f16};
    Ok(match dtype {
        DType::F32 => CpuStorage::from_vec(v.into_iter().map(|x| x as f32).collect::<Vec<_>>()),
        DType::BF16 => CpuStorage::from_vec(v.into_iter().map(|x| bf16::from_f32(x as f32)).collect::<Vec<_>>()),
        DType::F16 => CpuStorage::from_vec(v.into_iter().map(|x| f16::from_f32(x as f32)).collect::<Vec<_>>()),
        _ => CpuStorage::from_f64_iter(v.into_iter(), dtype)?,
    })
}

fn rounding(dtype: DType) -> fn(f64) -> f64 {
    if dtype == DType::F64 {
        |v| v
    } else {
        |v| v as f32 as f64
    }
}

/// x's values, the scale and effective zero point of each channel, and `inner`.
type Params = (Vec<f64>, Vec<f64>, Vec<f64>, usize);

/// The per-element values x, and scale / zero point per element's channel.
fn params(q: &FakeQuant, (x, xl): Arg<'_>, (s, sl): Arg<'_>, (z, zl): Arg<'_>) -> Result<Params> {
    x.dtype().check_float("fake_quantize")?;
    let (c, inner) = geometry(xl.dims(), q.axis);
    let (scale, zp) = (s.to_f64_vec(sl)?, z.to_f64_vec(zl)?);
    if scale.len() != c || zp.len() != c {
        return Err(Error::InvalidArgument(format!(
            "fake_quantize: {c} channels, scale {} zero_point {}",
            scale.len(),
            zp.len()
        )));
    }
    Ok((x.to_f64_vec(xl)?, scale, zp.iter().map(|&v| zero_point(v, q)).collect(), inner))
}

/// `y`, contiguous, in x's dtype.
pub(super) fn forward(q: &FakeQuant, x: Arg<'_>, s: Arg<'_>, z: Arg<'_>) -> Result<CpuStorage> {
    let dtype = x.0.dtype();
    let (xs, scale, zp, inner) = params(q, x, s, z)?;
    let (c, r) = (scale.len(), rounding(dtype));
    let y = xs.iter().enumerate().map(|(i, &v)| {
        let ch = (i / inner) % c;
        quantize(v, scale[ch], zp[ch], q, r).y
    });
    from_acc(y.collect(), dtype)
}

/// `dx` (straight-through), and with `learnable` the f32 `(dscale, dzero_point)` (LSQ).
pub(super) fn backward(
    q: &FakeQuant,
    (dy, dyl): Arg<'_>,
    x: Arg<'_>,
    s: Arg<'_>,
    z: Arg<'_>,
    learnable: bool,
) -> Result<(CpuStorage, Option<(CpuStorage, CpuStorage)>)> {
    if dyl.dims() != x.1.dims() {
        return Err(Error::ShapeMismatch {
            op: "fake_quantize_backward",
            lhs: dyl.dims().to_vec(),
            rhs: x.1.dims().to_vec(),
        });
    }
    let dtype = x.0.dtype();
    if dy.dtype() != dtype {
        return Err(Error::DTypeMismatch { op: "fake_quantize_backward", lhs: dy.dtype(), rhs: dtype });
    }
    let g = dy.to_f64_vec(dyl)?;
    let (xs, scale, zp, inner) = params(q, x, s, z)?;
    let (c, r) = (scale.len(), rounding(dtype));
    let gf = q.grad_factor.unwrap_or(1.0) as f64;
    let (mut ds, mut dz) = (vec![0.0f64; c], vec![0.0f64; c]);
    let mut dx = Vec::with_capacity(xs.len());
    for (i, (&v, &g)) in xs.iter().zip(&g).enumerate() {
        let ch = (i / inner) % c;
        let (sc, z) = (scale[ch], zp[ch]);
        let e = quantize(v, sc, z, q, r);
        let inside = e.raw >= q.qmin as f64 && e.raw <= q.qmax as f64;
        dx.push(if inside { g } else { 0.0 });
        if learnable {
            if inside {
                let inv = r(1.0 / sc);
                ds[ch] += r(r(r(g * r(e.y - v)) * inv) * gf);
            } else {
                let edge = if e.raw < q.qmin as f64 { q.qmin } else { q.qmax } as f64;
                ds[ch] += r(r(g * r(edge - z)) * gf);
                dz[ch] += r(r(-g * sc) * gf);
            }
        }
    }
    let dx = CpuStorage::from_f64_iter(dx.into_iter(), dtype)?;
    if !learnable {
        return Ok((dx, None));
    }
    Ok((
        dx,
        Some((
            CpuStorage::from_f64_iter(ds.into_iter(), DType::F32)?,
            CpuStorage::from_f64_iter(dz.into_iter(), DType::F32)?,
        )),
    ))
}
