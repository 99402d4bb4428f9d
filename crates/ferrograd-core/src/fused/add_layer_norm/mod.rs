//! Residual add fused with layer norm, the pre-LN transformer pattern: `h = x + residual` and
//! `y = layer_norm(h)` from one kernel (`add_layer_norm.cu`), both returned because the next
//! residual needs `h`.
//!
//! The backward is recorded, not fused: `h` is recorded as the add of `x` and `residual` and `y` as
//! layer norm of `h` (`layer_norm::record`, with the statistics this kernel saved), so the gradient
//! is layer norm's one backward kernel (dh, dweight, dbias) plus the gradient arriving at `h` from
//! the next residual, summed by the tape and handed to `x` and `residual` unchanged (dx = dr).
//! Folding that sum into the layer norm backward kernel is the next step for speed.

pub mod bench;
mod cpu;
mod cuda;

use super::{apply_all, check_arity, FusedOp, FusedOutputs};
use crate::backprop::track;
use crate::cpu::CpuStorage;
use crate::cuda::modules::headers::{COMMON, VEC_LOAD};
use crate::cuda::modules::Module;
use crate::cuda::CudaStorage;
use crate::op::{BinaryOp, Op};
use crate::{shape_err, Error, Layout, Result, Shape, Tensor};

/// The kernel: `add_layer_norm_fwd_{dt}`.
pub const MODULE: Module = Module::new("add_layer_norm", include_str!("add_layer_norm.cu"))
    .with_headers(&[COMMON, VEC_LOAD])
    .with_cost_ms(800);

/// Inputs `x, residual, [weight], [bias]`; outputs `y, h, mean, rstd` (`h = x + residual` rounded to
/// the dtype, `y` the layer norm of that `h`; mean and rstd per row in the accumulation dtype). Only
/// its forward runs as a fused op: the public function records the backward (module docs).
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
        self.dtype().check_float("add_layer_norm")?;
        if residual.dtype() != self.dtype() {
            return Err(Error::DTypeMismatch { op: "add_layer_norm", lhs: self.dtype(), rhs: residual.dtype() });
        }
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
        let h = if track(&[self, residual]) {
            h.view(h.layout().clone(), Some(Op::Binary(self.clone(), residual.clone(), BinaryOp::Add)))
        } else {
            h
        };
        let y = super::layer_norm::record(&h, weight, bias, eps, (y, mean, rstd));
        Ok((h, y))
    }
}
