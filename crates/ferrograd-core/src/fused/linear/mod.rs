//! `linear(x, w, b, act)`: `y = act(x W^T + b)` as one fused op, PyTorch's `nn.Linear` layout
//! (`w` is `[out, in]`, `x` is `[..., in]` with any leading dims, `b` is `[out]`).
//!
//! - CUDA: one cuBLASLt matmul whose epilogue adds the bias and applies the activation
//!   (`cuda.rs`); for GELU it also writes the pre-activation `z` that the backward needs.
//! - CPU: the reference (`cpu.rs`): the CPU matmul (gemm crate), the bias and the activation,
//!   computed in f32 for f16/bf16 and rounded once, as the GPU does.
//! - Backward: `dz = dy * act'(z)` and its column sums `db` in one kernel (`linear.cu`), then
//!   `dx = dz W` and `dW = dz^T x` as two cuBLASLt matmuls. Without an activation `dz` is `dy` and
//!   `db` comes from the `dW` matmul's epilogue (BGRADB). Gradients nobody asked for (an input that
//!   does not track) are not computed.
//!
//! Why `dz` is a kernel and not cuBLASLt's DGELU_BGRAD epilogue: that epilogue applies gelu' to the
//! output of a matmul, so it fuses into the matmul that *produces* `dy` (the next layer's `dx`),
//! which this op does not own; within one linear, `dz` must exist before either gradient matmul
//! can read it. [`mlp`] owns both layers of GPT-2's MLP block and uses it.
//!
//! Where cuBLASLt cannot run a problem (f64, an empty dim, a layout it has no kernel for, the
//! library missing) the CUDA op falls back to the reference composition on the device (cuBLAS).
//! Graph-safe: no host synchronization, every buffer from the caching allocator.

pub mod bench;
mod cpu;
mod cuda;
mod mlp;

use super::{apply, apply_all, FusedCtx, FusedOp, FusedOutputs};
use crate::backprop::track;
use crate::cpu::CpuStorage;
use crate::cuda::modules::headers::{ACC_MATH, COL_SUMS, COMMON};
use crate::cuda::modules::Module;
use crate::cuda::CudaStorage;
use crate::{Error, Layout, Result, Shape, Tensor};
use std::sync::Arc;

pub use mlp::mlp;

/// The backward's activation-gradient kernels (`linear.cu`): `linear_{dgelu,drelu}[_db]_{dt}` and
/// `linear_colsum_{dt}`. The matmuls themselves are cuBLASLt's (`cuda/blaslt`).
pub const MODULE: Module =
    Module::new("linear", include_str!("linear.cu")).with_headers(&[COMMON, ACC_MATH, COL_SUMS]).with_cost_ms(1700);

/// The activation fused after the matmul and bias.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Activation {
    /// `y = x W^T + b`
    None,
    /// GELU in its tanh form (GPT-2's, PyTorch's `F.gelu(approximate="tanh")`), the form
    /// cuBLASLt's epilogue computes. Not the exact erf GELU of `Tensor::gelu`.
    GeluTanh,
    /// `max(z, 0)`
    Relu,
}

/// `act(x W^T + b)` with PyTorch's layout: `x` is `[..., in]`, `w` is `[out, in]`, `b` is `[out]`;
/// the result is `[..., out]`. Floating-point dtypes, all operands of one dtype and device.
///
/// ```
/// use ferrograd_core::fused::linear::{linear, Activation};
/// use ferrograd_core::{Device, Tensor};
/// let x = Tensor::from_vec(vec![1f32, -2.0], (1, 2), Device::Cpu)?;
/// let w = Tensor::from_vec(vec![1f32, 1.0, 3.0, 0.0], (2, 2), Device::Cpu)?;
/// let b = Tensor::from_vec(vec![0.5f32, 0.0], 2, Device::Cpu)?;
/// assert_eq!(linear(&x, &w, Some(&b), Activation::Relu)?.to_vec::<f32>()?, vec![0.0, 3.0]);
/// # Ok::<(), ferrograd_core::Error>(())
/// ```
pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>, act: Activation) -> Result<Tensor> {
    check(x, w, b)?;
    let mut inputs = vec![x, w];
    inputs.extend(b);
    // Keep the pre-activation only when a backward can run (GELU's gradient needs it).
    let save_pre = act == Activation::GeluTanh && track(&inputs);
    apply(Arc::new(LinearOp { act, save_pre }), &inputs)
}

fn check(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<()> {
    let mismatch =
        |rhs: &Tensor| Error::ShapeMismatch { op: "linear", lhs: x.dims().to_vec(), rhs: rhs.dims().to_vec() };
    if w.rank() != 2 || x.rank() == 0 || x.dims()[x.rank() - 1] != w.dims()[1] {
        return Err(mismatch(w));
    }
    for t in [Some(w), b].into_iter().flatten() {
        if t.dtype() != x.dtype() {
            return Err(Error::DTypeMismatch { op: "linear", lhs: x.dtype(), rhs: t.dtype() });
        }
    }
    if !x.dtype().is_float() {
        return Err(Error::UnsupportedDType { op: "linear", dtype: x.dtype() });
    }
    if let Some(b) = b {
        if b.dims() != [w.dims()[0]] {
            return Err(Error::ShapeMismatch { op: "linear (bias)", lhs: w.dims().to_vec(), rhs: b.dims().to_vec() });
        }
    }
    // The output, and the saved pre-activation whose rows are padded to a multiple of 8, must be
    // shapes a tensor may have (checked, never wrapped: issue 11).
    let padded = w.dims()[0].checked_next_multiple_of(8).unwrap_or(usize::MAX);
    let leading = &x.dims()[..x.rank() - 1];
    Shape::from(leading.iter().copied().chain([padded]).collect::<Vec<_>>()).checked_elem_count("linear")?;
    Ok(())
}

/// `(rows, in, out)` of a linear: rows is the product of x's leading dims.
fn sizes(x: &Layout, w: &Layout) -> (usize, usize, usize) {
    let d = x.dims();
    (d[..d.len() - 1].iter().product(), w.dims()[1], w.dims()[0])
}

/// The output's shape: x's leading dims, then `out`.
fn out_dims(x: &Layout, n: usize) -> Vec<usize> {
    let d = x.dims();
    d[..d.len() - 1].iter().copied().chain([n]).collect()
}

/// The forward. Inputs `[x, w]` or `[x, w, b]`; outputs `[y]`, plus `z` (`[rows, ld]`, ld >= out)
/// when `save_pre`.
struct LinearOp {
    act: Activation,
    save_pre: bool,
}

impl FusedOp for LinearOp {
    fn name(&self) -> &'static str {
        "linear"
    }

    fn cpu_fwd(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<FusedOutputs<CpuStorage>> {
        cpu::forward(inputs[0], inputs[1], inputs.get(2).copied(), self.act, self.save_pre, true)
    }

    fn cuda_fwd(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<FusedOutputs<CudaStorage>> {
        cuda::forward(inputs[0], inputs[1], inputs.get(2).copied(), self.act, self.save_pre)
    }

    fn backward(&self, ctx: &FusedCtx<'_>, grad: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let (x, w, b) = (&ctx.inputs[0], &ctx.inputs[1], ctx.inputs.get(2));
        let need = Need { dx: x.tracks_grad(), dw: w.tracks_grad(), db: b.is_some_and(|b| b.tracks_grad()) };
        // With an activation, the kernel that forms dz also sums it into db (no second pass);
        // without one, dz is the incoming gradient and db comes from dW's epilogue (BGRADB).
        let with_db = need.db && db_in_kernel();
        let (dz, db) = match self.act {
            Activation::None => (grad.clone(), None),
            act => {
                let s = match act {
                    Activation::GeluTanh => ctx
                        .saved
                        .first()
                        .ok_or_else(|| Error::Backward("linear: the pre-activation was not saved".into()))?
                        .narrow(1, 0, w.dims()[0])?,
                    _ => ctx.output.clone(),
                };
                let mut outs = apply_all(&ActBackward { act, with_db }, &[grad, &s])?.into_iter();
                (outs.next().ok_or_else(|| Error::Backward("linear: no activation gradient".into()))?, outs.next())
            }
        };
        let mm = Need { db: need.db && db.is_none(), ..need };
        let outs = if mm.dx || mm.dw || mm.db { apply_all(&Grads { need: mm }, &[&dz, x, w])? } else { vec![] };
        let mut outs = outs.into_iter();
        let mut next = |want: bool| if want { outs.next() } else { None };
        let (dx, dw, db) = (next(mm.dx), next(mm.dw), db.or_else(|| next(mm.db)));
        let mut grads = vec![dx, dw];
        if b.is_some() {
            grads.push(db);
        }
        Ok(grads)
    }
}

/// Where an activation's backward gets db: in the kernel that forms dz (default), or, with
/// `FERROGRAD_LINEAR_DB=epilogue`, in the dW matmul's BGRADB epilogue (kept to compare the two).
fn db_in_kernel() -> bool {
    static KERNEL: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *KERNEL.get_or_init(|| std::env::var("FERROGRAD_LINEAR_DB").map_or(true, |v| v.trim() != "epilogue"))
}

/// `dz = dy * act'(s)`: inputs `[dy, s]` where `s` is the pre-activation (GELU) or the output
/// (ReLU), both viewable as `[rows, out]`; outputs `dz` (dy's shape) and, `with_db`, its column
/// sums `db` (`[out]`).
struct ActBackward {
    act: Activation,
    with_db: bool,
}

impl FusedOp for ActBackward {
    fn name(&self) -> &'static str {
        "linear_act_backward"
    }

    fn cpu_fwd(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<FusedOutputs<CpuStorage>> {
        cpu::act_backward(inputs[0], inputs[1], self.act, self.with_db, true)
    }

    fn cuda_fwd(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<FusedOutputs<CudaStorage>> {
        cuda::act_backward(inputs[0], inputs[1], self.act, self.with_db)
    }
}

/// Which gradients of a linear to compute.
#[derive(Clone, Copy, Debug)]
struct Need {
    dx: bool,
    dw: bool,
    db: bool,
}

/// The matmul gradients: inputs `[dz, x, w]`; outputs those of `dx` (x's shape), `dw` (`[out,
/// in]`) and `db` (`[out]`) that `need` asks for, in that order.
struct Grads {
    need: Need,
}

impl FusedOp for Grads {
    fn name(&self) -> &'static str {
        "linear_backward"
    }

    fn cpu_fwd(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<FusedOutputs<CpuStorage>> {
        cpu::grads(inputs[0], inputs[1], inputs[2], self.need, true)
    }

    fn cuda_fwd(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<FusedOutputs<CudaStorage>> {
        cuda::grads(inputs[0], inputs[1], inputs[2], self.need)
    }
}
