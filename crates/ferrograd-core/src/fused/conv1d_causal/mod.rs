//! The causal depthwise conv1d of Mamba (`causal_conv1d_fn` of the `causal-conv1d` package, and
//! `nn.Conv1d(C, C, k, groups=C, padding=k-1)(x)[..., :L]` in `mamba_ssm`'s reference path) as one
//! fused op: [`Tensor::conv1d_causal`], with its own backward.
//!
//! For `x` `[batch, channels, len]`, `w` `[channels, k]`, optional `b` `[channels]`:
//! `y[n, c, l] = b[c] + sum_j w[c, j] x[n, c, l - (k - 1) + j]`, steps before 0 read as zero (left
//! padding of `k - 1`), so `y[.., l]` sees only `x[.., ..=l]`.
//!
//! - `cpu.rs`: forward and backward in f64 (the reference of the gradcheck and the parity tests),
//!   rounded once to the dtype.
//! - `cuda.rs`: the launches of `conv1d_causal.cu` (one elementwise kernel forward; backward an
//!   elementwise `dx` kernel and a block per channel for `dw` / `db`, deterministic).
//!
//! Nothing is saved: the backward reads `x` and `w` from the record. `bench.rs`: the workload of
//! `ferrograd bench conv1d`.

pub mod bench;
mod cpu;
mod cuda;

use super::{apply, apply_all, FusedCtx, FusedOp, FusedOutputs};
use crate::cpu::CpuStorage;
use crate::cuda::modules::headers::COMMON;
use crate::cuda::modules::{Define, Module};
use crate::cuda::CudaStorage;
use crate::{shape_err, Error, Layout, Result, Tensor};
use std::sync::Arc;

/// The kernels `conv1d_causal_{fwd,bwd_dx,bwd_dw}_{f32,f64,f16,bf16}` (`conv1d_causal.cu`).
pub const MODULE: Module = Module::new("conv1d_causal", include_str!("conv1d_causal.cu"))
    .with_headers(&[COMMON])
    .with_defines(&[Define::int("FG_CONV1D_MAX_K", MAX_CUDA_K as i64)]);

/// The widest kernel the CUDA backward takes (its per-tap sums live in registers); Mamba uses 4.
/// Any width runs on the CPU.
pub const MAX_CUDA_K: usize = 16;

const OP: &str = "conv1d_causal";

/// The problem one call resolves to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Dims {
    pub batch: usize,
    pub channels: usize,
    pub len: usize,
    pub k: usize,
    pub has_bias: bool,
}

impl Dims {
    fn of(x: &Layout, w: &Layout, has_bias: bool) -> Result<Dims> {
        let &[batch, channels, len] = x.dims() else {
            return Err(shape_err!(OP, "x must be [batch, channels, len], got {:?}", x.dims()));
        };
        let &[wc, k] = w.dims() else {
            return Err(shape_err!(OP, "weight must be [channels, k], got {:?}", w.dims()));
        };
        if wc != channels || k == 0 {
            return Err(shape_err!(OP, "weight must be [channels = {channels}, k >= 1], got {:?}", w.dims()));
        }
        Ok(Dims { batch, channels, len, k, has_bias })
    }
}

/// The forward: inputs `x`, `w`[, `b`]; output `y`, the shape of `x`.
struct Conv1dCausal {
    has_bias: bool,
}

/// The backward's kernels: inputs `dy`, `x`, `w`[, `b`]; outputs `dx`, `dw`[, `db`].
struct Conv1dCausalBackward {
    has_bias: bool,
}

fn arity(op: &'static str, got: usize, has_bias: bool, extra: usize) -> Result<()> {
    super::check_arity(op, got, 2 + has_bias as usize + extra)
}

impl FusedOp for Conv1dCausal {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<FusedOutputs<CpuStorage>> {
        arity(OP, inputs.len(), self.has_bias, 0)?;
        let d = Dims::of(inputs[0].1, inputs[1].1, self.has_bias)?;
        Ok(vec![(cpu::forward(&d, inputs[0], inputs[1], inputs.get(2).copied())?, inputs[0].1.shape().clone())])
    }

    fn cuda_fwd(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<FusedOutputs<CudaStorage>> {
        arity(OP, inputs.len(), self.has_bias, 0)?;
        let d = Dims::of(inputs[0].1, inputs[1].1, self.has_bias)?;
        Ok(vec![(cuda::forward(&d, inputs[0], inputs[1], inputs.get(2).copied())?, inputs[0].1.shape().clone())])
    }

    fn backward(&self, ctx: &FusedCtx<'_>, dy: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let mut inputs = vec![dy];
        inputs.extend(ctx.inputs.iter());
        let grads = apply_all(&Conv1dCausalBackward { has_bias: self.has_bias }, &inputs)?;
        if grads.len() != ctx.inputs.len() {
            return Err(Error::Backward(format!(
                "{OP}: the backward returned {} gradients for {} inputs",
                grads.len(),
                ctx.inputs.len()
            )));
        }
        Ok(grads.into_iter().map(Some).collect())
    }
}

impl FusedOp for Conv1dCausalBackward {
    fn name(&self) -> &'static str {
        "conv1d_causal_backward"
    }

    fn cpu_fwd(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<FusedOutputs<CpuStorage>> {
        arity(self.name(), inputs.len(), self.has_bias, 1)?;
        let d = Dims::of(inputs[1].1, inputs[2].1, self.has_bias)?;
        check_dy(inputs[0].1, inputs[1].1)?;
        let (dx, dw, db) = cpu::backward(&d, inputs[0], inputs[1], inputs[2])?;
        let mut out = vec![(dx, inputs[1].1.shape().clone()), (dw, inputs[2].1.shape().clone())];
        if let (Some(db), Some(b)) = (db, inputs.get(3)) {
            out.push((db, b.1.shape().clone()));
        }
        Ok(out)
    }

    fn cuda_fwd(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<FusedOutputs<CudaStorage>> {
        arity(self.name(), inputs.len(), self.has_bias, 1)?;
        let d = Dims::of(inputs[1].1, inputs[2].1, self.has_bias)?;
        check_dy(inputs[0].1, inputs[1].1)?;
        let (dx, dw, db) = cuda::backward(&d, inputs[0], inputs[1], inputs[2], inputs.get(3).copied())?;
        let mut out = vec![(dx, inputs[1].1.shape().clone()), (dw, inputs[2].1.shape().clone())];
        if let (Some(db), Some(b)) = (db, inputs.get(3)) {
            out.push((db, b.1.shape().clone()));
        }
        Ok(out)
    }
}

fn check_dy(dy: &Layout, x: &Layout) -> Result<()> {
    if dy.dims() != x.dims() {
        return Err(Error::ShapeMismatch {
            op: "conv1d_causal_backward",
            lhs: dy.dims().to_vec(),
            rhs: x.dims().to_vec(),
        });
    }
    Ok(())
}

impl Tensor {
    /// The causal depthwise conv1d of Mamba: `self` `[batch, channels, len]`, `weight`
    /// `[channels, k]`, `bias` `[channels]`; output `[batch, channels, len]` with
    /// `y[n, c, l] = bias[c] + sum_j weight[c, j] self[n, c, l - (k - 1) + j]` (zero left padding
    /// of `k - 1` steps), PyTorch's `F.conv1d(x, weight.unsqueeze(1), bias, padding=k-1,
    /// groups=channels)[..., :len]`. One op with its own backward (gradients of all inputs).
    ///
    /// Float dtypes, one dtype for all inputs (sums in f32 for f16 / bf16, f64 for f64); any
    /// strides; on CUDA `k` at most [`MAX_CUDA_K`]. Errors: `Error::Shape` / `ShapeMismatch` for
    /// wrong ranks or sizes, `DTypeMismatch`, `UnsupportedDType` (integers), `DeviceMismatch`.
    pub fn conv1d_causal(&self, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        self.dtype().check_float(OP)?;
        for t in std::iter::once(weight).chain(bias) {
            if t.dtype() != self.dtype() {
                return Err(Error::DTypeMismatch { op: OP, lhs: self.dtype(), rhs: t.dtype() });
            }
            if t.device() != self.device() {
                return Err(Error::DeviceMismatch { op: OP, lhs: self.device(), rhs: t.device() });
            }
        }
        let d = Dims::of(self.layout(), weight.layout(), bias.is_some())?;
        if let Some(b) = bias {
            if b.dims() != [d.channels] {
                return Err(Error::ShapeMismatch { op: OP, lhs: vec![d.channels], rhs: b.dims().to_vec() });
            }
        }
        if self.device().is_cuda() {
            if d.k > MAX_CUDA_K {
                return Err(shape_err!(
                    OP,
                    "kernel width {} exceeds the CUDA kernels' {MAX_CUDA_K} (any width runs on the CPU)",
                    d.k
                ));
            }
            let big = u32::MAX as usize;
            if d.batch > big || d.channels > big || d.len > big || d.batch * d.len > big {
                return Err(shape_err!(OP, "{:?} exceeds the CUDA kernels' 32-bit sizes", self.dims()));
            }
        }
        let mut inputs = vec![self, weight];
        inputs.extend(bias);
        apply(Arc::new(Conv1dCausal { has_bias: bias.is_some() }), &inputs)
    }
}
