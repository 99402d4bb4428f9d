//! Residual add fused with layer norm, the pre-LN transformer pattern: `h = x + residual` and
//! `y = layer_norm(h)` from one kernel (`add_layer_norm.cu`), both returned because the next
//! residual needs `h`.
//!
//! The backward is recorded, not fused: `h` is recorded as the add of `x` and `residual` and `y` as
//! layer norm of `h` (`layer_norm::record`, with the statistics this kernel saved), so the gradient
//! is layer norm's one backward kernel (dh, dweight, dbias) plus the gradient arriving at `h` from
//! the next residual, handed to `x` and `residual` unchanged (dx = dr). That sum is folded into
//! the layer norm backward kernel (`FusedOp::folds_pending`): the next residual add is made after
//! `y`, so the walk has differentiated it when layer norm's backward runs, and hands its gradient
//! of `h` to that kernel, which adds it as it stores dh instead of a separate add kernel reading
//! both (a full pass over the residual stream per norm).
//!
//! [`Tensor::add_layer_norm_mixed`] is the autocast form: an f32 residual stream plus a bf16 branch,
//! `y` in bf16 for the next GEMM, one kernel where three ran (the branch's cast up, the add and
//! norm, `y`'s cast down). Its `h` is recorded as `ResidualAdd` (the branch's gradient is `h`'s
//! rounded to bf16) and `y` as layer norm of `h` with a bf16 output (backward `layer_norm_bwd_f32_bf16`).

pub mod bench;
mod cpu;
mod cuda;

use super::layer_norm::mixed_suffix;
use super::{apply_all, check_arity, FusedCtx, FusedOp, FusedOutputs, FusedRecord};
use crate::backprop::track;
use crate::cpu::CpuStorage;
use crate::cuda::modules::headers::{COMMON, ROW_REDUCE, VEC_LOAD};
use crate::cuda::modules::Module;
use crate::cuda::CudaStorage;
use crate::op::{BinaryOp, Op};
use crate::{shape_err, DType, Error, Layout, Result, Shape, Tensor};
use std::sync::Arc;

/// The kernels: `add_layer_norm_fwd_{dt}` and `add_layer_norm_fwd_f32_bf16` (x f32; residual and
/// y bf16), a block per row, and `add_layer_norm_fwd_rows_{f32,f32_bf16}`, the row in registers.
pub const MODULE: Module = Module::new("add_layer_norm", include_str!("add_layer_norm.cu"))
    .with_headers(&[COMMON, ROW_REDUCE, VEC_LOAD])
    .with_cost_ms(800);

/// Inputs `x, residual, [weight], [bias]`; outputs `y, h, mean, rstd` (`h = x + residual` rounded to
/// x's dtype, `y` the layer norm of that `h` in the residual's dtype; mean and rstd per row in the
/// accumulation dtype). Only its forward runs as a fused op: the public function records the
/// backward (module docs).
struct AddLayerNorm {
    eps: f64,
    has_w: bool,
    has_b: bool,
}

type Arg<'a, S> = (&'a S, &'a Layout);
/// (x, residual, weight, bias).
type Split<'a, S> = (Arg<'a, S>, Arg<'a, S>, Option<Arg<'a, S>>, Option<Arg<'a, S>>);

impl AddLayerNorm {
    fn arity(&self) -> usize {
        2 + self.has_w as usize + self.has_b as usize
    }

    /// (x, residual, weight, bias) among the inputs.
    fn split<'a, S>(&self, inputs: &[Arg<'a, S>]) -> Result<Split<'a, S>> {
        check_arity("add_layer_norm", inputs.len(), self.arity())?;
        let w = self.has_w.then(|| inputs[2]);
        let b = self.has_b.then(|| inputs[2 + self.has_w as usize]);
        if inputs[0].1.dims() != inputs[1].1.dims() {
            return Err(Error::ShapeMismatch {
                op: "add_layer_norm",
                lhs: inputs[0].1.dims().to_vec(),
                rhs: inputs[1].1.dims().to_vec(),
            });
        }
        Ok((inputs[0], inputs[1], w, b))
    }

    fn outputs<S>(&self, l: &Layout, (y, h, mean, rstd): (S, S, S, S)) -> FusedOutputs<S> {
        let rows = super::rows::last_dim_rows(l).0;
        let shape = l.shape().clone();
        vec![(y, shape.clone()), (h, shape), (mean, Shape::from(rows)), (rstd, Shape::from(rows))]
    }
}

impl FusedOp for AddLayerNorm {
    fn name(&self) -> &'static str {
        "add_layer_norm"
    }

    fn cpu_fwd(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<FusedOutputs<CpuStorage>> {
        let (x, r, w, b) = self.split(inputs)?;
        Ok(self.outputs(x.1, cpu::add_layer_norm(x, r, w, b, self.eps)?))
    }

    fn cuda_fwd(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<FusedOutputs<CudaStorage>> {
        let (x, r, w, b) = self.split(inputs)?;
        Ok(self.outputs(x.1, cuda::add_layer_norm(x, r, w, b, self.eps)?))
    }
}

/// `h = x + branch` with an f32 `x` and a bf16 `branch`, as `add_layer_norm_mixed` records it: the
/// forward is that op's kernel, so this op only carries the backward (`x` gets `h`'s gradient, the
/// branch the same rounded to its dtype, which is what casting the branch up then adding gives).
struct ResidualAdd;

impl FusedOp for ResidualAdd {
    fn name(&self) -> &'static str {
        "add_layer_norm_mixed residual"
    }

    fn cpu_fwd(&self, _: &[(&CpuStorage, &Layout)]) -> Result<FusedOutputs<CpuStorage>> {
        Err(Error::InvalidArgument("the mixed residual add runs inside add_layer_norm_mixed only".into()))
    }

    fn cuda_fwd(&self, _: &[(&CudaStorage, &Layout)]) -> Result<FusedOutputs<CudaStorage>> {
        Err(Error::InvalidArgument("the mixed residual add runs inside add_layer_norm_mixed only".into()))
    }

    fn backward(&self, ctx: &FusedCtx<'_>, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let branch = ctx.inputs[1].dtype();
        Ok(vec![Some(g.clone()), Some(g.to_dtype(branch)?)])
    }
}

impl Tensor {
    /// `(h, y)` with `h = self + residual` and `y = h.layer_norm(weight, bias, eps)`, computed by one
    /// kernel (f32 accumulation for f16 / bf16; `h` is rounded to the dtype before it is normalized,
    /// as `x + r` followed by `F.layer_norm` does in PyTorch). `residual` must have `self`'s shape
    /// (no broadcasting), dtype and device; weight and bias `[C]` over the last dim. Both outputs are
    /// differentiable: `self` and `residual` get the same gradient.
    pub fn add_layer_norm(
        &self,
        residual: &Tensor,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f64,
    ) -> Result<(Tensor, Tensor)> {
        if residual.dtype() != self.dtype() {
            return Err(Error::DTypeMismatch { op: "add_layer_norm", lhs: self.dtype(), rhs: residual.dtype() });
        }
        self.add_layer_norm_any(residual, weight, bias, eps)
    }

    /// [`Tensor::add_layer_norm`] of an f32 residual stream `self` and a bf16 `branch` (a bf16
    /// GEMM's output under autocast), with `y` in bf16 for the next GEMM: `h = self + branch` in
    /// f32 (the branch widened exactly), `y = layer_norm(h)` in f32 rounded once to bf16. The same
    /// values as `self.add_layer_norm(&branch.to_dtype(F32)?, ..)` with `y.to_dtype(BF16)`, from one
    /// kernel instead of three. Gradients: `self`'s, the weight's and the bias's in f32, the
    /// branch's in bf16 (`h`'s rounded). Other dtypes are a `DTypeMismatch`; weight and bias f32.
    pub fn add_layer_norm_mixed(
        &self,
        branch: &Tensor,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f64,
    ) -> Result<(Tensor, Tensor)> {
        if (self.dtype(), branch.dtype()) != (DType::F32, DType::BF16) {
            return Err(Error::DTypeMismatch { op: "add_layer_norm_mixed", lhs: self.dtype(), rhs: branch.dtype() });
        }
        self.add_layer_norm_any(branch, weight, bias, eps)
    }

    /// Both public forms, the residual's dtype checked by the caller.
    fn add_layer_norm_any(
        &self,
        residual: &Tensor,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f64,
    ) -> Result<(Tensor, Tensor)> {
        self.dtype().check_float("add_layer_norm")?;
        mixed_suffix("add_layer_norm", self.dtype(), residual.dtype())?;
        if residual.dims() != self.dims() {
            return Err(Error::ShapeMismatch {
                op: "add_layer_norm",
                lhs: self.dims().to_vec(),
                rhs: residual.dims().to_vec(),
            });
        }
        let c = *self.dims().last().ok_or_else(|| shape_err!("add_layer_norm", "needs rank >= 1"))?;
        for (p, what) in [(weight, "weight"), (bias, "bias")] {
            if let Some(p) = p {
                if p.dims() != [c] {
                    return Err(shape_err!("add_layer_norm", "{what} has shape {:?}, expected [{c}]", p.dims()));
                }
                if p.dtype() != self.dtype() {
                    return Err(Error::DTypeMismatch { op: "add_layer_norm", lhs: self.dtype(), rhs: p.dtype() });
                }
            }
        }
        let mut inputs = vec![self, residual];
        inputs.extend(weight);
        inputs.extend(bias);
        let op = AddLayerNorm { eps, has_w: weight.is_some(), has_b: bias.is_some() };
        let mut outs = apply_all(&op, &inputs)?.into_iter();
        let (Some(y), Some(h), Some(mean), Some(rstd)) = (outs.next(), outs.next(), outs.next(), outs.next()) else {
            return Err(Error::InvalidArgument("add_layer_norm: the forward returned fewer than 4 outputs".into()));
        };
        let h = if !track(&[self, residual]) {
            h
        } else if residual.dtype() == self.dtype() {
            h.view(h.layout().clone(), Some(Op::Binary(self.clone(), residual.clone(), BinaryOp::Add)))
        } else {
            let rec =
                FusedRecord { op: Arc::new(ResidualAdd), inputs: vec![self.clone(), residual.clone()], saved: vec![] };
            h.view(h.layout().clone(), Some(Op::Fused(rec)))
        };
        let y = super::layer_norm::record(&h, weight, bias, eps, (y, mean, rstd));
        Ok((h, y))
    }
}
