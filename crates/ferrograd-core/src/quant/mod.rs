//! int8 inference: symmetric per-row int8 quantization (weights per output channel, activations
//! per token), the int8 x int8 -> int32 matmul (cuBLASLt's IMMA kernels on CUDA, exact), the
//! rescale that turns its int32 sums back into floats, and the two quantized linear layers built
//! from them:
//!
//! - **W8A8** ([`linear_w8a8`]): the input quantized per row (token) on the fly, `int32 = x_q
//!   w_q^T`, `y = int32 * x_scale[row] * w_scale[col] + b`.
//! - **W8A16** ([`linear_w8a16`], weight-only): the weight dequantized to the input's dtype, then
//!   the float linear (cuBLASLt). A quarter of the weight's memory; the matmul itself is float.
//!
//! Quantization is symmetric on `[-127, 127]`: `s = max |row| / 127` (1 for a row of zeros),
//! `q = clamp(round_half_even(x * (1 / s)), -127, 127)`, exactly what `fake_quantize(x, s, 0,
//! -127, 127)` rounds to, so a model trained with QAT at these ranges quantizes to the same
//! integers. None of these ops is differentiable (inference only). CPU twins in `cpu.rs`.

mod cpu;
mod cuda;

use crate::cpu::CpuStorage;
use crate::cuda::modules::headers::COMMON;
use crate::cuda::modules::Module;
use crate::cuda::CudaStorage;
use crate::fused::linear::{linear, Activation};
use crate::fused::{apply_all, check_arity, FusedOp, FusedOutputs};
use crate::{shape_err, DType, Error, Layout, Result, Shape, Tensor};

/// The kernels: `quant_rows_i8_{dt}`, `dequant_rows_i8_{dt}`, `int8_scale_{dt}`, `int8_gemm_nt`.
pub const MODULE: Module = Module::new("quant", include_str!("quant.cu")).with_headers(&[COMMON]);

/// A weight `[out, in]` quantized per output row: int8 values and one f32 scale per row.
#[derive(Clone, Debug)]
pub struct Int8Weight {
    /// `[out, in]`, i8.
    pub q: Tensor,
    /// `[out]`, f32.
    pub scale: Tensor,
}

impl Int8Weight {
    /// Quantize a float weight `[out, in]` per output row.
    pub fn quantize(w: &Tensor) -> Result<Int8Weight> {
        if w.rank() != 2 {
            return Err(shape_err!("Int8Weight::quantize", "a weight is [out, in], got {:?}", w.dims()));
        }
        let (q, scale) = quantize_rows_i8(w)?;
        Ok(Int8Weight { q, scale })
    }

    /// From stored parts (a checkpoint): checks shapes and dtypes.
    pub fn from_parts(q: Tensor, scale: Tensor) -> Result<Int8Weight> {
        if q.dtype() != DType::I8 || scale.dtype() != DType::F32 {
            return Err(Error::InvalidArgument(format!(
                "Int8Weight: q {} and scale {}, expected i8 and f32",
                q.dtype(),
                scale.dtype()
            )));
        }
        if q.rank() != 2 || scale.dims() != [q.dims()[0]] {
            return Err(shape_err!("Int8Weight", "q {:?} with scale {:?}", q.dims(), scale.dims()));
        }
        Ok(Int8Weight { q, scale })
    }

    /// The float weight it stands for, in `dtype`.
    pub fn dequantize(&self, dtype: DType) -> Result<Tensor> {
        dequantize_rows(&self.q, &self.scale, dtype)
    }
}

/// The last dim and the number of rows before it.
fn rows_cols(op: &'static str, x: &Tensor) -> Result<(usize, usize)> {
    let cols = *x.dims().last().ok_or_else(|| shape_err!(op, "needs rank >= 1, got a scalar"))?;
    Ok((x.elem_count().checked_div(cols).unwrap_or(0), cols))
}

struct QuantRows;
struct DequantRows(DType);
struct MatmulNt;
struct Rescale(DType);

impl FusedOp for QuantRows {
    fn name(&self) -> &'static str {
        "quantize_rows_i8"
    }
    fn cpu_fwd(&self, i: &[(&CpuStorage, &Layout)]) -> Result<FusedOutputs<CpuStorage>> {
        check_arity(self.name(), i.len(), 1)?;
        let (sh, cols, rows) = shapes(i[0].1);
        let (q, s) = cpu::quant_rows(i[0], cols)?;
        Ok(vec![(q, sh), (s, Shape::from(rows))])
    }
    fn cuda_fwd(&self, i: &[(&CudaStorage, &Layout)]) -> Result<FusedOutputs<CudaStorage>> {
        check_arity(self.name(), i.len(), 1)?;
        let (sh, cols, rows) = shapes(i[0].1);
        let (q, s) = cuda::quant_rows(i[0], cols)?;
        Ok(vec![(q, sh), (s, Shape::from(rows))])
    }
}

/// x's shape, its last dim and the rows before it.
fn shapes(l: &Layout) -> (Shape, usize, usize) {
    let cols = l.dims().last().copied().unwrap_or(1);
    (l.shape().clone(), cols, l.elem_count().checked_div(cols).unwrap_or(0))
}

impl FusedOp for DequantRows {
    fn name(&self) -> &'static str {
        "dequantize_rows"
    }
    fn cpu_fwd(&self, i: &[(&CpuStorage, &Layout)]) -> Result<FusedOutputs<CpuStorage>> {
        check_arity(self.name(), i.len(), 2)?;
        let (sh, cols, _) = shapes(i[0].1);
        Ok(vec![(cpu::dequant_rows(i[0], i[1], cols, self.0)?, sh)])
    }
    fn cuda_fwd(&self, i: &[(&CudaStorage, &Layout)]) -> Result<FusedOutputs<CudaStorage>> {
        check_arity(self.name(), i.len(), 2)?;
        let (sh, cols, _) = shapes(i[0].1);
        Ok(vec![(cuda::dequant_rows(i[0], i[1], cols, self.0)?, sh)])
    }
}

impl FusedOp for MatmulNt {
    fn name(&self) -> &'static str {
        "matmul_i8_nt"
    }
    fn cpu_fwd(&self, i: &[(&CpuStorage, &Layout)]) -> Result<FusedOutputs<CpuStorage>> {
        check_arity(self.name(), i.len(), 2)?;
        let (m, n, k) = (i[0].1.dims()[0], i[1].1.dims()[0], i[0].1.dims()[1]);
        Ok(vec![(cpu::matmul_nt(i[0], i[1], m, n, k)?, Shape::from((m, n)))])
    }
    fn cuda_fwd(&self, i: &[(&CudaStorage, &Layout)]) -> Result<FusedOutputs<CudaStorage>> {
        check_arity(self.name(), i.len(), 2)?;
        let (m, n, k) = (i[0].1.dims()[0], i[1].1.dims()[0], i[0].1.dims()[1]);
        Ok(vec![(cuda::matmul_nt(i[0], i[1], m, n, k)?, Shape::from((m, n)))])
    }
}

/// The W8A8 epilogue's operands on one backend: `acc [m, n]` i32, `sa [m]` and `sb [n]` f32, an
/// optional bias `[n]`, and the output dtype (one type for `cpu::scale` and `cuda::scale`).
struct RescaleArgs<'a, S> {
    acc: (&'a S, &'a Layout),
    sa: (&'a S, &'a Layout),
    sb: (&'a S, &'a Layout),
    bias: Option<(&'a S, &'a Layout)>,
    n: usize,
    dtype: DType,
}

impl Rescale {
    fn args<'a, S>(&self, i: &[(&'a S, &'a Layout)]) -> Result<RescaleArgs<'a, S>> {
        match i {
            [acc, sa, sb, rest @ ..] if rest.len() <= 1 => Ok(RescaleArgs {
                acc: *acc,
                sa: *sa,
                sb: *sb,
                bias: rest.first().copied(),
                n: acc.1.dims().get(1).copied().unwrap_or(0),
                dtype: self.0,
            }),
            _ => Err(Error::InvalidArgument(format!("int8_rescale: 3 or 4 inputs, got {}", i.len()))),
        }
    }
}

impl FusedOp for Rescale {
    fn name(&self) -> &'static str {
        "int8_rescale"
    }
    fn cpu_fwd(&self, i: &[(&CpuStorage, &Layout)]) -> Result<FusedOutputs<CpuStorage>> {
        let a = self.args(i)?;
        let shape = a.acc.1.shape().clone();
        Ok(vec![(cpu::scale(a)?, shape)])
    }
    fn cuda_fwd(&self, i: &[(&CudaStorage, &Layout)]) -> Result<FusedOutputs<CudaStorage>> {
        let a = self.args(i)?;
        let shape = a.acc.1.shape().clone();
        Ok(vec![(cuda::scale(a)?, shape)])
    }
}

fn first(op: &'static str, v: Vec<Tensor>) -> Result<Tensor> {
    v.into_iter().next().ok_or_else(|| Error::InvalidArgument(format!("{op}: no output")))
}

/// Symmetric per-row int8 of a float `x` (rows = everything before the last dim): `(q, scale)`,
/// `q` i8 of x's shape, `scale` f32 `[rows]`.
pub fn quantize_rows_i8(x: &Tensor) -> Result<(Tensor, Tensor)> {
    x.dtype().check_float("quantize_rows_i8")?;
    rows_cols("quantize_rows_i8", x)?;
    let mut out = apply_all(&QuantRows, &[x])?.into_iter();
    match (out.next(), out.next()) {
        (Some(q), Some(s)) => Ok((q, s)),
        _ => Err(Error::InvalidArgument("quantize_rows_i8: fewer than 2 outputs".into())),
    }
}

/// `q * scale[row]` in `dtype` (q i8, scale f32 `[rows]`).
pub fn dequantize_rows(q: &Tensor, scale: &Tensor, dtype: DType) -> Result<Tensor> {
    dtype.check_float("dequantize_rows")?;
    let (rows, _) = rows_cols("dequantize_rows", q)?;
    if q.dtype() != DType::I8 || scale.dtype() != DType::F32 || scale.dims() != [rows] {
        return Err(Error::InvalidArgument(format!(
            "dequantize_rows: q {} {:?} with scale {} {:?}; expected i8 and f32 [{rows}]",
            q.dtype(),
            q.dims(),
            scale.dtype(),
            scale.dims()
        )));
    }
    first("dequantize_rows", apply_all(&DequantRows(dtype), &[q, scale])?)
}

/// `a [m, k] b [n, k]^T` of two i8 matrices, exact in i32 (`k <= 133_000` keeps every sum of
/// products of values in `[-128, 127]` below 2^31... for `[-127, 127]`, as quantized here).
pub fn matmul_i8_nt(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    const OP: &str = "matmul_i8_nt";
    for t in [a, b] {
        if t.dtype() != DType::I8 {
            return Err(Error::UnsupportedDType { op: OP, dtype: t.dtype() });
        }
    }
    if a.rank() != 2 || b.rank() != 2 || a.dims()[1] != b.dims()[1] {
        return Err(Error::ShapeMismatch { op: OP, lhs: a.dims().to_vec(), rhs: b.dims().to_vec() });
    }
    if a.dims()[1] > 133_000 {
        return Err(shape_err!(OP, "k = {} could overflow the int32 sums (at most 133000)", a.dims()[1]));
    }
    first(OP, apply_all(&MatmulNt, &[a, b])?)
}

/// `acc [m, n] * a_scale[i] * b_scale[j] (+ bias[j])` in `dtype` (the W8A8 epilogue).
pub fn rescale_i32(
    acc: &Tensor,
    a_scale: &Tensor,
    b_scale: &Tensor,
    bias: Option<&Tensor>,
    dtype: DType,
) -> Result<Tensor> {
    const OP: &str = "rescale_i32";
    dtype.check_float(OP)?;
    if acc.dtype() != DType::I32 || a_scale.dtype() != DType::F32 || b_scale.dtype() != DType::F32 {
        return Err(Error::InvalidArgument(format!("{OP}: acc must be i32 and the scales f32")));
    }
    let [m, n] = acc.dims() else {
        return Err(shape_err!(OP, "acc must be [m, n], got {:?}", acc.dims()));
    };
    if a_scale.dims() != [*m] || b_scale.dims() != [*n] || bias.is_some_and(|b| b.dims() != [*n] || b.dtype() != dtype)
    {
        return Err(shape_err!(
            OP,
            "acc {:?}: scales [m] and [n] (and a bias [n] of the output dtype) expected",
            acc.dims()
        ));
    }
    let mut ins = vec![acc, a_scale, b_scale];
    ins.extend(bias);
    first(OP, apply_all(&Rescale(dtype), &ins)?)
}

fn check_linear(op: &'static str, x: &Tensor, w: &Int8Weight, bias: Option<&Tensor>) -> Result<usize> {
    x.dtype().check_float(op)?;
    let (_, k) = rows_cols(op, x)?;
    if w.q.dims().get(1) != Some(&k) {
        return Err(Error::ShapeMismatch { op, lhs: x.dims().to_vec(), rhs: w.q.dims().to_vec() });
    }
    let n = w.q.dims()[0];
    if let Some(b) = bias {
        if b.dims() != [n] || b.dtype() != x.dtype() {
            return Err(shape_err!(op, "bias {} {:?}, expected {} [{n}]", b.dtype(), b.dims(), x.dtype()));
        }
    }
    Ok(n)
}

/// `x w^T + b` with the input quantized per row on the fly and an int8 matmul (W8A8): `x [.., in]`
/// float, the output `[.., out]` in x's dtype.
pub fn linear_w8a8(x: &Tensor, w: &Int8Weight, bias: Option<&Tensor>) -> Result<Tensor> {
    let n = check_linear("linear_w8a8", x, w, bias)?;
    let (rows, k) = rows_cols("linear_w8a8", x)?;
    let (xq, xs) = quantize_rows_i8(&x.reshape((rows, k))?)?;
    let acc = matmul_i8_nt(&xq, &w.q)?;
    let y = rescale_i32(&acc, &xs, &w.scale, bias, x.dtype())?;
    let mut dims = x.dims().to_vec();
    if let Some(last) = dims.last_mut() {
        *last = n;
    }
    y.reshape(dims)
}

/// `x w^T + b` with the weight dequantized to x's dtype and the float linear (W8A16, weight-only).
pub fn linear_w8a16(x: &Tensor, w: &Int8Weight, bias: Option<&Tensor>) -> Result<Tensor> {
    check_linear("linear_w8a16", x, w, bias)?;
    linear(x, &w.dequantize(x.dtype())?, bias, Activation::None)
}
