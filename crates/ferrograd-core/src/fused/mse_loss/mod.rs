//! Mean squared error, `mean((pred - target)^2)` (`F.mse_loss`, reduction "mean"), as one fused op:
//! on CUDA two kernels forward (per-block partial sums of the squared differences, then their sum
//! over n, both in a fixed order: deterministic) and one backward (`dpred = g * 2/n * (pred -
//! target)`, and `dtarget = -dpred` when the target needs a gradient), instead of the sub, sqr,
//! sum and scale of the composite and the four kernels of their backward. Monster Walk's autograd
//! step replays as a CUDA graph, whose cost grows with its node count. Nothing is saved: the
//! backward reads both inputs again.

mod cpu;
mod cuda;

use super::{apply, apply_all, check_arity, FusedCtx, FusedOp, FusedOutputs};
use crate::cpu::CpuStorage;
use crate::cuda::modules::headers::COMMON;
use crate::cuda::modules::Module;
use crate::cuda::CudaStorage;
use crate::{Error, Layout, Result, Shape, Tensor};
use std::sync::Arc;

/// The kernels: `mse_part_{dt}`, `mse_final_{dt}`, `mse_bwd_{dt}`.
pub const MODULE: Module =
    Module::new("mse_loss", include_str!("mse_loss.cu")).with_headers(&[COMMON]).with_cost_ms(300);

/// The forward: inputs `pred`, `target` (one shape); output the scalar loss.
struct MseLoss;

/// The backward's kernel: inputs `g` (the scalar gradient of the loss), `pred`, `target`; outputs
/// `dpred`, and `dtarget` when `with_target`.
struct MseBackward {
    with_target: bool,
}

impl FusedOp for MseLoss {
    fn name(&self) -> &'static str {
        "mse_loss"
    }

    fn cpu_fwd(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<FusedOutputs<CpuStorage>> {
        check_arity(self.name(), inputs.len(), 2)?;
        Ok(vec![(cpu::forward(inputs[0], inputs[1])?, Shape::from(()))])
    }

    fn cuda_fwd(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<FusedOutputs<CudaStorage>> {
        check_arity(self.name(), inputs.len(), 2)?;
        Ok(vec![(cuda::forward(inputs[0], inputs[1])?, Shape::from(()))])
    }

    fn backward(&self, ctx: &FusedCtx<'_>, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let [pred, target] = ctx.inputs else {
            return Err(Error::Backward(format!("mse_loss: {} recorded inputs, expected 2", ctx.inputs.len())));
        };
        let (np, nt) = (pred.tracks_grad(), target.tracks_grad());
        if !np && !nt {
            return Ok(vec![None, None]);
        }
        let mut outs = apply_all(&MseBackward { with_target: nt }, &[g, pred, target])?.into_iter();
        let dpred = outs.next().ok_or_else(|| Error::Backward("mse_loss: no gradient".into()))?;
        let dtarget = if nt { outs.next() } else { None };
        Ok(vec![np.then_some(dpred), dtarget])
    }
}

impl FusedOp for MseBackward {
    fn name(&self) -> &'static str {
        "mse_loss_backward"
    }

    fn cpu_fwd(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<FusedOutputs<CpuStorage>> {
        check_arity(self.name(), inputs.len(), 3)?;
        let shape = inputs[1].1.shape().clone();
        let outs = cpu::backward(inputs[0], inputs[1], inputs[2], self.with_target)?;
        Ok(outs.into_iter().map(|s| (s, shape.clone())).collect())
    }

    fn cuda_fwd(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<FusedOutputs<CudaStorage>> {
        check_arity(self.name(), inputs.len(), 3)?;
        let shape = inputs[1].1.shape().clone();
        let outs = cuda::backward(inputs[0], inputs[1], inputs[2], self.with_target)?;
        Ok(outs.into_iter().map(|s| (s, shape.clone())).collect())
    }
}

/// Checks shared by [`Tensor::mse_loss`] and the backends: one shape, one float dtype.
pub(crate) fn check(pred: &Layout, target: &Layout) -> Result<()> {
    if pred.dims() != target.dims() {
        return Err(Error::ShapeMismatch { op: "mse_loss", lhs: pred.dims().to_vec(), rhs: target.dims().to_vec() });
    }
    Ok(())
}

impl Tensor {
    /// Mean squared error against `target` (`F.mse_loss(self, target)`, reduction "mean"): a
    /// scalar of `self`'s dtype, accumulated in f32 (f64 for f64). Float dtypes, one shape, one
    /// device; differentiable in both inputs. An empty input gives NaN, as PyTorch's.
    pub fn mse_loss(&self, target: &Tensor) -> Result<Tensor> {
        check(self.layout(), target.layout())?;
        self.dtype().check_float("mse_loss")?;
        if target.dtype() != self.dtype() {
            return Err(Error::DTypeMismatch { op: "mse_loss", lhs: self.dtype(), rhs: target.dtype() });
        }
        apply(Arc::new(MseLoss), &[self, target])
    }
}
