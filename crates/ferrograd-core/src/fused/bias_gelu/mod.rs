//! Bias add fused with tanh-GELU, the activation of a transformer MLP's first layer when its
//! matmul runs without an epilogue: `y = gelu_tanh(x + b)`, `b` broadcast over the last dim. One
//! elementwise kernel forward; one kernel backward that writes `dx` and sums its columns into `db`
//! (deterministic partial sums, then one short kernel adds them), instead of the add, GELU, GELU
//! gradient, multiply and sum of the unfused graph. Nothing is saved: the backward recomputes
//! `x + b`. This folder is the worked example of `docs/adding-an-op.md`.

pub mod bench;
mod cpu;
mod cuda;

use super::{apply, apply_all, check_arity, FusedCtx, FusedOp, FusedOutputs};
use crate::cpu::CpuStorage;
use crate::cuda::modules::headers::{ACC_MATH, COL_SUMS, COMMON};
use crate::cuda::modules::Module;
use crate::cuda::CudaStorage;
use crate::{shape_err, Error, Layout, Result, Tensor};
use std::sync::Arc;

/// The kernels: `bias_gelu_fwd_{dt}`, `bias_gelu_bwd_{dt}`, `bias_gelu_colsum_{dt}`.
pub const MODULE: Module = Module::new("bias_gelu", include_str!("bias_gelu.cu"))
    .with_headers(&[COMMON, ACC_MATH, COL_SUMS])
    .with_cost_ms(300);

/// The forward: inputs `x [.., C]`, `b [C]`; output `y`, the shape of `x`.
struct BiasGelu;

/// The backward's kernels as an op of their own (run through `apply_all`, recording nothing):
/// inputs `dy`, `x`, `b`; outputs `dx` (the shape of `x`) and `db [C]`.
struct BiasGeluBackward;

impl FusedOp for BiasGelu {
    fn name(&self) -> &'static str {
        "bias_gelu"
    }

    fn cpu_fwd(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<FusedOutputs<CpuStorage>> {
        check_arity(self.name(), inputs.len(), 2)?;
        Ok(vec![(cpu::forward(inputs[0], inputs[1])?, inputs[0].1.shape().clone())])
    }

    fn cuda_fwd(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<FusedOutputs<CudaStorage>> {
        check_arity(self.name(), inputs.len(), 2)?;
        Ok(vec![(cuda::forward(inputs[0], inputs[1])?, inputs[0].1.shape().clone())])
    }

    /// `dz = dy * gelu_tanh'(x + b)`; `dx = dz`, `db` = the sum of `dz` over every dim but the last.
    fn backward(&self, ctx: &FusedCtx<'_>, dy: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let [x, b] = ctx.inputs else {
            return Err(Error::Backward(format!("bias_gelu: {} recorded inputs, expected 2", ctx.inputs.len())));
        };
        let mut grads = apply_all(&BiasGeluBackward, &[dy, x, b])?.into_iter();
        let (Some(dx), Some(db)) = (grads.next(), grads.next()) else {
            return Err(Error::Backward("bias_gelu: the backward returned fewer than 2 outputs".into()));
        };
        Ok(vec![Some(dx), Some(db)])
    }
}

impl FusedOp for BiasGeluBackward {
    fn name(&self) -> &'static str {
        "bias_gelu_backward"
    }

    fn cpu_fwd(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<FusedOutputs<CpuStorage>> {
        check_arity(self.name(), inputs.len(), 3)?;
        let (dx, db) = cpu::backward(inputs[0], inputs[1], inputs[2])?;
        Ok(vec![(dx, inputs[1].1.shape().clone()), (db, inputs[2].1.shape().clone())])
    }

    fn cuda_fwd(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<FusedOutputs<CudaStorage>> {
        check_arity(self.name(), inputs.len(), 3)?;
        let (dx, db) = cuda::backward(inputs[0], inputs[1], inputs[2])?;
        Ok(vec![(dx, inputs[1].1.shape().clone()), (db, inputs[2].1.shape().clone())])
    }
}

impl Tensor {
    /// `gelu_tanh(self + bias)` (GPT-2's GELU, PyTorch's `F.gelu(x + b, approximate="tanh")`), with
    /// `bias` of shape `[C]` broadcast over the last dim `C` of `self`, in one kernel; f32
    /// accumulation for f16 / bf16, `self + bias` rounded to the dtype first as PyTorch's two ops
    /// do. Float dtypes; both inputs on one device with one dtype; differentiable in both.
    pub fn bias_gelu(&self, bias: &Tensor) -> Result<Tensor> {
        self.dtype().check_float("bias_gelu")?;
        if bias.dtype() != self.dtype() {
            return Err(Error::DTypeMismatch { op: "bias_gelu", lhs: self.dtype(), rhs: bias.dtype() });
        }
        let c = *self.dims().last().ok_or_else(|| shape_err!("bias_gelu", "needs rank >= 1, got a scalar"))?;
        if bias.dims() != [c] {
            return Err(Error::ShapeMismatch { op: "bias_gelu", lhs: self.dims().to_vec(), rhs: bias.dims().to_vec() });
        }
        apply(Arc::new(BiasGelu), &[self, bias])
    }
}
