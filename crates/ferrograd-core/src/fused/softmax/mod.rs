//! Softmax and log-softmax over any dim: one fused kernel per row on CUDA (`softmax.cu`), a row
//! loop on the CPU (`cpu.rs`); the op moves the dim last and back when it is not the last.

pub mod bench;
mod cpu;
mod cuda;

use super::{apply, check_arity, FusedCtx, FusedOp, FusedOutputs};
use crate::cpu::CpuStorage;
use crate::cuda::modules::headers::{ACC_MATH, COMMON, ONLINE_SOFTMAX, ROW_REDUCE, VEC_LOAD};
use crate::cuda::modules::Module;
use crate::cuda::CudaStorage;
use crate::{Dim, Layout, Result, Tensor};
use std::sync::Arc;

/// The kernels: `softmax_{dt}` (any row) and `softmax_rows_{dt}` (the row in registers).
pub const MODULE: Module = Module::new("softmax", include_str!("softmax.cu"))
    .with_headers(&[COMMON, ACC_MATH, ONLINE_SOFTMAX, ROW_REDUCE, VEC_LOAD])
    .with_cost_ms(1450);

/// Softmax (`log: false`) or log-softmax over the last dim of its one input.
struct Softmax {
    log: bool,
}

impl FusedOp for Softmax {
    fn name(&self) -> &'static str {
        if self.log {
            "log_softmax"
        } else {
            "softmax"
        }
    }

    fn cpu_fwd(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<FusedOutputs<CpuStorage>> {
        check_arity(self.name(), inputs.len(), 1)?;
        let (x, l) = inputs[0];
        Ok(vec![(cpu::softmax_last(x, l, self.log)?, l.shape().clone())])
    }

    fn cuda_fwd(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<FusedOutputs<CudaStorage>> {
        check_arity(self.name(), inputs.len(), 1)?;
        let (x, l) = inputs[0];
        Ok(vec![(cuda::softmax_last(x, l, self.log)?, l.shape().clone())])
    }

    /// With y the output: softmax dx = y * (g - sum(g * y)); log-softmax dx = g - exp(y) * sum(g),
    /// sums over the last dim.
    fn backward(&self, ctx: &FusedCtx<'_>, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let y = ctx.output;
        let dx = if self.log {
            let s = g.sum(-1, true)?;
            g.sub(&y.exp()?.mul(&s)?)?
        } else {
            let s = g.mul(y)?.sum(-1, true)?;
            y.mul(&g.sub(&s)?)?
        };
        Ok(vec![Some(dx)])
    }
}

impl Tensor {
    /// Softmax over `dim`, numerically stable (the row max is subtracted first): `F.softmax(x,
    /// dim)`. Same shape, dtype and device; float dtypes (f16/bf16 accumulate in f32), one kernel
    /// on CUDA, differentiable.
    pub fn softmax<D: Dim>(&self, dim: D) -> Result<Tensor> {
        self.softmax_impl(dim, false)
    }

    /// Log-softmax over `dim`: `x - max - ln(sum(exp(x - max)))` (`F.log_softmax(x, dim)`); as
    /// [`Tensor::softmax`].
    pub fn log_softmax<D: Dim>(&self, dim: D) -> Result<Tensor> {
        self.softmax_impl(dim, true)
    }

    fn softmax_impl<D: Dim>(&self, dim: D, log: bool) -> Result<Tensor> {
        self.dtype().check_float("softmax")?;
        if self.rank() == 0 {
            return self.reshape(1)?.softmax_impl(0usize, log)?.reshape(());
        }
        let d = dim.to_index(self.rank(), "softmax")?;
        let last = self.rank() - 1;
        if d == last {
            return apply(Arc::new(Softmax { log }), &[self]);
        }
        // The kernels work on the last dim: move `d` there and back (views).
        apply(Arc::new(Softmax { log }), &[&self.transpose(d, last)?])?.transpose(d, last)
    }
}
