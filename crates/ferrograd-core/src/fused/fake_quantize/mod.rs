//! Fake quantization for quantization-aware training, with PyTorch's semantics
//! (`torch.fake_quantize_per_tensor_affine`, `torch.fake_quantize_per_channel_affine` and the
//! learnable `torch._fake_quantize_learnable_per_{tensor,channel}_affine`):
//!
//! ```text
//! zp  = clamp(round_half_even(zero_point), qmin, qmax)
//! raw = round_half_even(x * (1 / scale)) + zp          (in f32; f64 for f64 x)
//! y   = (clamp(raw, qmin, qmax) - zp) * scale
//! ```
//!
//! Backward: the straight-through estimator, `dx = dy` where `qmin <= raw <= qmax` and 0 outside;
//! in learnable mode also LSQ's gradients of the scale and the zero point (summed per channel,
//! times `grad_factor`): inside the range `dscale = dy * (y - x) / scale`, `dzp = 0`; below it
//! `dscale = dy * (qmin - zp)`, above `dy * (qmax - zp)`, and `dzp = -dy * scale`.
//!
//! One elementwise kernel forward; one backward (dx only), or in learnable mode one kernel that
//! writes dx and per-block partial sums of dscale / dzp per channel, and one short kernel adding
//! them (deterministic, no atomics). Nothing is saved: the backward recomputes `raw` from x.
//!
//! Departures from PyTorch, on purpose: the zero point is a float tensor rounded and clamped on
//! the device (PyTorch's learnable ops do that; its plain ones take an int and refuse one out of
//! range, which would need a host read here); f64 inputs are computed in f64 (PyTorch rounds them
//! through f32), so that gradcheck can run in f64.

pub mod bench;
mod cpu;
mod cuda;

pub(crate) use cpu::from_acc;

use super::{apply, apply_all, check_arity, FusedCtx, FusedOp, FusedOutputs};
use crate::cpu::CpuStorage;
use crate::cuda::modules::headers::COMMON;
use crate::cuda::modules::Module;
use crate::cuda::CudaStorage;
use crate::{shape_err, DType, Error, Layout, Result, Tensor};
use std::sync::Arc;

/// The kernels: `fake_quant_fwd_{dt}`, `fake_quant_bwd_{dt}`, `fake_quant_bwd_lsq_{dt}`,
/// `fake_quant_sum_parts_{f32,f64}`.
pub const MODULE: Module = Module::new("fake_quantize", include_str!("fake_quantize.cu")).with_headers(&[COMMON]);

/// How a tensor is fake-quantized: the integer range, the channel axis (`None`: one scale for the
/// whole tensor) and, for a learnable scale and zero point, LSQ's gradient factor.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FakeQuant {
    /// The smallest quantized integer (PyTorch's `quant_min`, e.g. -128 or 0).
    pub qmin: i32,
    /// The largest quantized integer (`quant_max`, e.g. 127 or 255).
    pub qmax: i32,
    /// The dim that indexes `scale` / `zero_point` (per channel), or `None` (per tensor).
    pub axis: Option<usize>,
    /// `Some(g)`: scale and zero point get LSQ gradients, scaled by `g` (LSQ's paper suggests
    /// `1 / sqrt(numel_per_channel * qmax)`; PyTorch's default is 1). `None`: they get none.
    pub grad_factor: Option<f32>,
}

impl FakeQuant {
    /// Signed 8-bit, per tensor, fixed scale: `[-128, 127]`.
    pub const fn int8() -> FakeQuant {
        FakeQuant { qmin: -128, qmax: 127, axis: None, grad_factor: None }
    }

    /// The same range per channel along `axis`.
    pub const fn per_channel(self, axis: usize) -> FakeQuant {
        FakeQuant { axis: Some(axis), ..self }
    }

    /// The same, with learnable scale and zero point (LSQ) and gradient factor `g`.
    pub const fn learnable(self, g: f32) -> FakeQuant {
        FakeQuant { grad_factor: Some(g), ..self }
    }
}

/// `(channels, inner)` of x's elements: element `i` uses scale `(i / inner) % channels`.
pub(crate) fn geometry(dims: &[usize], axis: Option<usize>) -> (usize, usize) {
    match axis {
        None => (1, 1),
        Some(a) => (dims.get(a).copied().unwrap_or(1), dims.iter().skip(a + 1).product()),
    }
}

/// The forward: inputs `x`, `scale [C]` (f32), `zero_point [C]` (f32); output `y`, x's shape.
struct FakeQuantize(FakeQuant);

/// The straight-through backward: inputs `dy`, `x`, `scale`, `zero_point`; output `dx`.
struct FakeQuantizeSte(FakeQuant);

/// The learnable backward: the same inputs; outputs `dx`, `dscale [C]`, `dzero_point [C]` (f32).
struct FakeQuantizeLsq(FakeQuant);

impl FusedOp for FakeQuantize {
    fn name(&self) -> &'static str {
        "fake_quantize"
    }

    fn cpu_fwd(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<FusedOutputs<CpuStorage>> {
        check_arity(self.name(), inputs.len(), 3)?;
        Ok(vec![(cpu::forward(&self.0, inputs[0], inputs[1], inputs[2])?, inputs[0].1.shape().clone())])
    }

    fn cuda_fwd(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<FusedOutputs<CudaStorage>> {
        check_arity(self.name(), inputs.len(), 3)?;
        Ok(vec![(cuda::forward(&self.0, inputs[0], inputs[1], inputs[2])?, inputs[0].1.shape().clone())])
    }

    fn backward(&self, ctx: &FusedCtx<'_>, dy: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let [x, scale, zp] = ctx.inputs else {
            return Err(Error::Backward(format!("fake_quantize: {} recorded inputs, expected 3", ctx.inputs.len())));
        };
        if self.0.grad_factor.is_none() {
            let dx = apply_all(&FakeQuantizeSte(self.0), &[dy, x, scale, zp])?.into_iter().next();
            let dx = dx.ok_or_else(|| Error::Backward("fake_quantize: the backward returned no output".into()))?;
            return Ok(vec![Some(dx), None, None]);
        }
        let mut g = apply_all(&FakeQuantizeLsq(self.0), &[dy, x, scale, zp])?.into_iter();
        let (Some(dx), Some(ds), Some(dz)) = (g.next(), g.next(), g.next()) else {
            return Err(Error::Backward("fake_quantize: the backward returned fewer than 3 outputs".into()));
        };
        Ok(vec![Some(dx), Some(ds), Some(dz)])
    }
}

impl FusedOp for FakeQuantizeSte {
    fn name(&self) -> &'static str {
        "fake_quantize_backward"
    }

    fn cpu_fwd(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<FusedOutputs<CpuStorage>> {
        check_arity(self.name(), inputs.len(), 4)?;
        let (dx, _) = cpu::backward(&self.0, inputs[0], inputs[1], inputs[2], inputs[3], false)?;
        Ok(vec![(dx, inputs[1].1.shape().clone())])
    }

    fn cuda_fwd(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<FusedOutputs<CudaStorage>> {
        check_arity(self.name(), inputs.len(), 4)?;
        let dx = cuda::backward_ste(&self.0, inputs[0], inputs[1], inputs[2], inputs[3])?;
        Ok(vec![(dx, inputs[1].1.shape().clone())])
    }
}

impl FusedOp for FakeQuantizeLsq {
    fn name(&self) -> &'static str {
        "fake_quantize_learnable_backward"
    }

    fn cpu_fwd(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<FusedOutputs<CpuStorage>> {
        check_arity(self.name(), inputs.len(), 4)?;
        let (dx, Some((ds, dz))) = cpu::backward(&self.0, inputs[0], inputs[1], inputs[2], inputs[3], true)? else {
            return Err(Error::Backward("fake_quantize: the CPU backward returned no scale gradients".into()));
        };
        Ok(vec![
            (dx, inputs[1].1.shape().clone()),
            (ds, inputs[2].1.shape().clone()),
            (dz, inputs[3].1.shape().clone()),
        ])
    }

    fn cuda_fwd(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<FusedOutputs<CudaStorage>> {
        check_arity(self.name(), inputs.len(), 4)?;
        let (dx, ds, dz) = cuda::backward_lsq(&self.0, inputs[0], inputs[1], inputs[2], inputs[3])?;
        Ok(vec![
            (dx, inputs[1].1.shape().clone()),
            (ds, inputs[2].1.shape().clone()),
            (dz, inputs[3].1.shape().clone()),
        ])
    }
}

impl Tensor {
    /// Fake-quantize `self` (see the module documentation for the formula): `scale` and
    /// `zero_point` are f32 tensors of shape `[C]` (`[1]` or `[]` per tensor), `C` the size of
    /// `q.axis`. Float `self` (f32, f64, f16, bf16); `qmin < qmax`. Differentiable in `self`
    /// (straight-through) and, when `q.grad_factor` is set, in `scale` and `zero_point` (LSQ).
    /// A scale that is zero, negative or NaN is not checked (that would need a host read on CUDA):
    /// the outputs are then inf / NaN as PyTorch's would be.
    pub fn fake_quantize(&self, scale: &Tensor, zero_point: &Tensor, q: FakeQuant) -> Result<Tensor> {
        const OP: &str = "fake_quantize";
        self.dtype().check_float(OP)?;
        for t in [scale, zero_point] {
            if t.dtype() != DType::F32 {
                return Err(Error::UnsupportedDType { op: OP, dtype: t.dtype() });
            }
        }
        if q.qmin >= q.qmax {
            return Err(Error::InvalidArgument(format!("{OP}: qmin {} must be below qmax {}", q.qmin, q.qmax)));
        }
        if let Some(a) = q.axis {
            if a >= self.rank() {
                return Err(shape_err!(OP, "axis {a} out of range for a tensor of shape {:?}", self.dims()));
            }
        }
        if let Some(g) = q.grad_factor {
            if !g.is_finite() {
                return Err(Error::InvalidArgument(format!("{OP}: grad_factor {g} is not finite")));
            }
        }
        let (c, _) = geometry(self.dims(), q.axis);
        for t in [scale, zero_point] {
            if t.rank() > 1 || t.elem_count() != c {
                return Err(shape_err!(
                    OP,
                    "scale and zero_point must have shape [{c}] for x of shape {:?} (axis {:?}), got {:?}",
                    self.dims(),
                    q.axis,
                    t.dims()
                ));
            }
        }
        apply(Arc::new(FakeQuantize(q)), &[self, scale, zero_point])
    }

    /// `torch.fake_quantize_per_tensor_affine(self, scale, zero_point, qmin, qmax)`, with scale and
    /// zero point as numbers (fixed: no gradient for them).
    pub fn fake_quantize_per_tensor(&self, scale: f32, zero_point: i32, qmin: i32, qmax: i32) -> Result<Tensor> {
        let s = Tensor::from_vec(vec![scale], 1, self.device())?;
        let z = Tensor::from_vec(vec![zero_point as f32], 1, self.device())?;
        self.fake_quantize(&s, &z, FakeQuant { qmin, qmax, axis: None, grad_factor: None })
    }

    /// `torch.fake_quantize_per_channel_affine(self, scale, zero_point, axis, qmin, qmax)`.
    pub fn fake_quantize_per_channel(
        &self,
        scale: &Tensor,
        zero_point: &Tensor,
        axis: usize,
        qmin: i32,
        qmax: i32,
    ) -> Result<Tensor> {
        self.fake_quantize(scale, zero_point, FakeQuant { qmin, qmax, axis: Some(axis), grad_factor: None })
    }
}
