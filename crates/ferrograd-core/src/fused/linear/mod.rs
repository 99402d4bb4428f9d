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
//! Master weights (`master.rs`): `w` and `b` may be f32 while `x` is f16/bf16 (autocast over f32
//! parameters). The op casts them down itself, and its `dW`/`db` come out of the GEMM in f32, `dW`
//! in the weight's own layout (also for same-dtype weights: a transposed weight gets a transposed
//! gradient).
//!
//! Where cuBLASLt cannot run a problem (f64, an empty dim, a layout it has no kernel for, the
//! library missing) the CUDA op falls back to the reference composition on the device (cuBLAS).
//! Graph-safe: no host synchronization, every buffer from the caching allocator.

pub mod bench;
mod cpu;
mod cuda;
mod master;
mod mlp;

use super::{apply, apply_all, FusedCtx, FusedOp, FusedOutputs};
use crate::backend::BackendStorage;
use crate::backprop::track;
use crate::cpu::CpuStorage;
use crate::cuda::modules::headers::{ACC_MATH, COL_SUMS, COMMON};
use crate::cuda::modules::{Define, Module};
use crate::cuda::CudaStorage;
use crate::{DType, Error, Layout, Result, Shape, Tensor};
use master::{lower, stored_transposed, view_as, Lowered};
use std::sync::Arc;

pub use mlp::{mlp, mlp_recompute};

/// The backward's activation-gradient kernels (`linear.cu`): `linear_{dgelu,drelu}[_db]_{dt}` and
/// `linear_colsum_{dt}`, one compiled part per dtype `dt` (`-D FG_LINEAR_DTYPE`; `cuda.rs`
/// `module` picks the part by the suffix of the kernel it launches). The matmuls themselves are
/// cuBLASLt's (`cuda/blaslt`).
macro_rules! linear_part {
    ($id:ident, $name:literal, $dtype:literal, $ms:literal) => {
        /// The activation-gradient kernels of one dtype (see [`MODULES`]).
        pub const $id: Module = Module::new($name, include_str!("linear.cu"))
            .with_headers(&[COMMON, ACC_MATH, COL_SUMS])
            .with_defines(&[Define::int("FG_LINEAR_DTYPE", $dtype)])
            .with_cost_ms($ms);
    };
}
linear_part!(LINEAR_F32, "linear_f32", 0, 600);
linear_part!(LINEAR_F64, "linear_f64", 1, 800);
linear_part!(LINEAR_F16, "linear_f16", 2, 900);
linear_part!(LINEAR_BF16, "linear_bf16", 3, 900);

/// The kernel modules (for `cuda::modules::ALL`): f32, f64, f16, bf16.
pub const MODULES: [&Module; 4] = [&LINEAR_F32, &LINEAR_F64, &LINEAR_F16, &LINEAR_BF16];

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
/// the result is `[..., out]`, in x's dtype. Floating-point dtypes on one device; `w` and `b` share
/// one dtype, x's, or f32 when x is f16/bf16 (master weights: cast down inside the op, their
/// gradients in f32, see the module documentation).
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
    let master = check(x, w, b)?;
    let mut inputs = vec![x, w];
    inputs.extend(b);
    let tracks = track(&inputs);
    // Keep the pre-activation only when a backward can run (GELU's gradient needs it), and the
    // cast weight only for dx (the weight's gradient reads x and dz alone).
    let save_pre = act == Activation::GeluTanh && tracks;
    let save_w = master && tracks && x.tracks_grad();
    apply(Arc::new(LinearOp { act, save_pre, master, save_w }), &inputs)
}

/// Checks a linear's operands; `Ok(true)` for master weights (f32 `w`, `b` over an f16/bf16 `x`).
fn check(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<bool> {
    let mismatch =
        |rhs: &Tensor| Error::ShapeMismatch { op: "linear", lhs: x.dims().to_vec(), rhs: rhs.dims().to_vec() };
    if w.rank() != 2 || x.rank() == 0 || x.dims()[x.rank() - 1] != w.dims()[1] {
        return Err(mismatch(w));
    }
    let master = master::is_master(x.dtype(), w.dtype()).ok_or(Error::DTypeMismatch {
        op: "linear",
        lhs: x.dtype(),
        rhs: w.dtype(),
    })?;
    if let Some(b) = b.filter(|b| b.dtype() != w.dtype()) {
        return Err(Error::DTypeMismatch { op: "linear (bias)", lhs: w.dtype(), rhs: b.dtype() });
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
    Ok(master)
}

/// The inputs with every parameter (each input after x) cast to x's dtype when `master`, as
/// `f` reads them; the casts are returned too (the caller saves those the backward needs).
#[allow(clippy::type_complexity)]
fn with_params_lowered<S: BackendStorage, T>(
    inputs: &[(&S, &Layout)],
    master: bool,
    f: impl FnOnce(&[(&S, &Layout)]) -> Result<T>,
) -> Result<(T, Vec<Option<Lowered<S>>>)> {
    let dtype = inputs.first().map_or(DType::F32, |x| x.0.dtype());
    let low = inputs
        .iter()
        .enumerate()
        .map(|(i, (s, l))| if master && i > 0 { lower(*s, l, dtype).map(Some) } else { Ok(None) })
        .collect::<Result<Vec<_>>>()?;
    let args: Vec<(&S, &Layout)> =
        inputs.iter().zip(&low).map(|(inp, lo)| lo.as_ref().map_or(*inp, |lo| (&lo.s, &lo.view))).collect();
    let out = f(&args)?;
    Ok((out, low))
}

/// What the weight-gradient GEMM writes: `dW` (and `db`) in `dtype` (the parameters' own: f32 for
/// master weights), `dW` transposed (`[in, out]` row-major) when the weight is stored so.
#[derive(Clone, Copy, Debug)]
pub(super) struct WGrad {
    dtype: DType,
    transposed: bool,
}

impl WGrad {
    fn of(w: &Tensor) -> WGrad {
        WGrad { dtype: w.dtype(), transposed: stored_transposed(w.layout()) }
    }

    /// The gradient as the weight's shape (a transposed buffer viewed back).
    fn as_weight(self, dw: Tensor) -> Result<Tensor> {
        if self.transposed {
            dw.t()
        } else {
            Ok(dw)
        }
    }
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
/// when `save_pre`, plus the weight cast to x's dtype when `save_w` (master weights).
struct LinearOp {
    act: Activation,
    save_pre: bool,
    master: bool,
    save_w: bool,
}

impl LinearOp {
    fn run<S: BackendStorage>(
        &self,
        inputs: &[(&S, &Layout)],
        layer: impl FnOnce((&S, &Layout), (&S, &Layout), Option<(&S, &Layout)>) -> Result<FusedOutputs<S>>,
    ) -> Result<FusedOutputs<S>> {
        super::check_arity("linear", inputs.len().min(2), 2)?;
        let (mut out, low) = with_params_lowered(inputs, self.master, |a| layer(a[0], a[1], a.get(2).copied()))?;
        if self.save_w {
            if let Some(Some(w)) = low.into_iter().nth(1) {
                out.push((w.s, w.saved));
            }
        }
        Ok(out)
    }
}

impl FusedOp for LinearOp {
    fn name(&self) -> &'static str {
        "linear"
    }

    fn cpu_fwd(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<FusedOutputs<CpuStorage>> {
        self.run(inputs, |x, w, b| cpu::forward(x, w, b, self.act, self.save_pre, true))
    }

    fn cuda_fwd(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<FusedOutputs<CudaStorage>> {
        self.run(inputs, |x, w, b| cuda::forward(x, w, b, self.act, self.save_pre))
    }

    fn backward(&self, ctx: &FusedCtx<'_>, grad: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let (x, w, b) = (&ctx.inputs[0], &ctx.inputs[1], ctx.inputs.get(2));
        let need = Need { dx: x.tracks_grad(), dw: w.tracks_grad(), db: b.is_some_and(|b| b.tracks_grad()) };
        let wg = WGrad::of(w);
        // dx reads the weight as the forward did: the saved cast of a master weight.
        let low = match self.save_w {
            true => Some(view_as(
                ctx.saved
                    .get(self.save_pre as usize)
                    .ok_or_else(|| Error::Backward("linear: the cast weight was not saved".into()))?,
                w,
            )?),
            false if self.master && need.dx => {
                return Err(Error::Backward("linear: x tracks a gradient the forward did not expect".into()))
            }
            false => None,
        };
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
                let mut outs = apply_all(&ActBackward { act, with_db, db_dtype: wg.dtype }, &[grad, &s])?.into_iter();
                (outs.next().ok_or_else(|| Error::Backward("linear: no activation gradient".into()))?, outs.next())
            }
        };
        let mm = Need { db: need.db && db.is_none(), ..need };
        let wx = low.as_ref().unwrap_or(w);
        let outs = if mm.dx || mm.dw || mm.db { apply_all(&Grads { need: mm, wg }, &[&dz, x, wx])? } else { vec![] };
        let mut outs = outs.into_iter();
        let mut next = |want: bool| if want { outs.next() } else { None };
        let (dx, dw, db) = (next(mm.dx), next(mm.dw), db.or_else(|| next(mm.db)));
        let dw = dw.map(|d| wg.as_weight(d)).transpose()?;
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
/// sums `db` (`[out]`, in `db_dtype`: dy's, or f32 for master weights).
struct ActBackward {
    act: Activation,
    with_db: bool,
    db_dtype: DType,
}

impl FusedOp for ActBackward {
    fn name(&self) -> &'static str {
        "linear_act_backward"
    }

    fn cpu_fwd(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<FusedOutputs<CpuStorage>> {
        cpu::act_backward(inputs[0], inputs[1], self.act, self.with_db.then_some(self.db_dtype), true)
    }

    fn cuda_fwd(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<FusedOutputs<CudaStorage>> {
        cuda::act_backward(inputs[0], inputs[1], self.act, self.with_db.then_some(self.db_dtype), false)
    }
}

/// Which gradients of a linear to compute.
#[derive(Clone, Copy, Debug)]
struct Need {
    dx: bool,
    dw: bool,
    db: bool,
}

/// The matmul gradients: inputs `[dz, x, w]` (`w` in dz's dtype; only its shape is read unless
/// `dx` is wanted); outputs those of `dx` (x's shape), `dw` (`[out, in]`, or `[in, out]` when
/// `wg.transposed`) and `db` (`[out]`) that `need` asks for, in that order, `dw` and `db` in
/// `wg.dtype`.
struct Grads {
    need: Need,
    wg: WGrad,
}

impl FusedOp for Grads {
    fn name(&self) -> &'static str {
        "linear_backward"
    }

    fn cpu_fwd(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<FusedOutputs<CpuStorage>> {
        cpu::grads(inputs[0], inputs[1], inputs[2], self.need, self.wg, true)
    }

    fn cuda_fwd(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<FusedOutputs<CudaStorage>> {
        cuda::grads(inputs[0], inputs[1], inputs[2], self.need, self.wg)
    }
}
