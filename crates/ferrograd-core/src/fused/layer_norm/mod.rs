//! Layer norm over the last dim, with an optional weight and bias of that size: one fused kernel
//! forward (`layer_norm.cu`, statistics kept for the backward) and one backward kernel that gives
//! the input's, the weight's and the bias's gradients together.

pub mod bench;
pub(crate) mod cpu;
mod cuda;

use super::{apply, apply_all, check_arity, FusedCtx, FusedOp, FusedOutputs};
use crate::backend::BackendStorage;
use crate::cpu::CpuStorage;
use crate::cuda::modules::headers::{COMMON, ROW_REDUCE, VEC_LOAD};
use crate::cuda::modules::Module;
use crate::cuda::CudaStorage;
use crate::{shape_err, DType, Error, Layout, Result, Shape, Tensor};
use std::sync::Arc;

/// The forward kernels: `layer_norm_fwd_{dt}` (any row) and `layer_norm_fwd_rows_{dt}` (the row
/// in registers), per float dtype and as `f32_bf16` (see `mixed_suffix`).
pub const MODULE: Module = Module::new("layer_norm", include_str!("layer_norm.cu"))
    .with_headers(&[COMMON, ROW_REDUCE, VEC_LOAD])
    .with_cost_ms(1400);

/// The backward kernels, a module of their own (compiled in parallel with the forward's):
/// `layer_norm_bwd_{dt}` (a block per row; per float dtype and `f32_bf16`) and
/// `layer_norm_bwd_rows_{f32,f32_bf16}` (a warp per row, where the row fits its registers).
pub const MODULE_BWD: Module = Module::new("layer_norm_bwd", include_str!("layer_norm_bwd.cu"))
    .with_headers(&[COMMON, VEC_LOAD])
    .with_cost_ms(1500);

/// The kernel-name suffix of a layer norm whose x is `x` and whose output (forward) or incoming
/// gradient (backward) is `low`: `x` itself when they agree, `f32_bf16` for an f32 x with bf16
/// `low` (autocast's layer norm feeding a bf16 GEMM, the one mixed pair the kernels are built for:
/// each variant costs NVRTC time), else a typed error. The CPU references follow the same rule.
pub(crate) fn mixed_suffix(op: &'static str, x: DType, low: DType) -> Result<String> {
    match (x, low) {
        _ if x == low => Ok(x.to_string()),
        (DType::F32, DType::BF16) => Ok("f32_bf16".into()),
        _ => Err(Error::DTypeMismatch { op, lhs: x, rhs: low }),
    }
}

/// Inputs `x, [weight], [bias]`; outputs `y` (in `out`), mean, rstd (mean and rstd saved for the
/// backward: one per row, in the accumulation dtype).
struct LayerNorm {
    eps: f64,
    has_w: bool,
    has_b: bool,
    out: DType,
}

/// An input storage with its layout.
type Arg<'a, S> = (&'a S, &'a Layout);

/// The parameters among `inputs[1..]`, given which are present.
fn params<'a, S>(inputs: &[Arg<'a, S>], has_w: bool, has_b: bool) -> (Option<Arg<'a, S>>, Option<Arg<'a, S>>) {
    let w = has_w.then(|| inputs[1]);
    let b = has_b.then(|| inputs[1 + has_w as usize]);
    (w, b)
}

impl LayerNorm {
    fn outputs<S>(&self, l: &Layout, (y, mean, rstd): (S, S, S)) -> FusedOutputs<S> {
        let rows = super::rows::last_dim_rows(l).0;
        vec![(y, l.shape().clone()), (mean, Shape::from(rows)), (rstd, Shape::from(rows))]
    }
}

impl FusedOp for LayerNorm {
    fn name(&self) -> &'static str {
        "layer_norm"
    }

    fn cpu_fwd(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<FusedOutputs<CpuStorage>> {
        check_arity("layer_norm", inputs.len(), 1 + self.has_w as usize + self.has_b as usize)?;
        let (x, l) = inputs[0];
        let (w, b) = params(inputs, self.has_w, self.has_b);
        Ok(self.outputs(l, cpu::layer_norm(x, l, w, b, self.eps, self.out)?))
    }

    fn cuda_fwd(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<FusedOutputs<CudaStorage>> {
        check_arity("layer_norm", inputs.len(), 1 + self.has_w as usize + self.has_b as usize)?;
        let (x, l) = inputs[0];
        let (w, b) = params(inputs, self.has_w, self.has_b);
        Ok(self.outputs(l, cuda::layer_norm(x, l, w, b, self.eps, self.out)?))
    }

    /// dx, dweight and dbias from one kernel ([`LayerNormBackward`]).
    fn backward(&self, ctx: &FusedCtx<'_>, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let x = &ctx.inputs[0];
        let mut ins = vec![x];
        if self.has_w {
            ins.push(&ctx.inputs[1]);
        }
        ins.extend([&ctx.saved[0], &ctx.saved[1], g]);
        let mut grads = apply_all(&LayerNormBackward { has_w: self.has_w }, &ins)?.into_iter();
        let (dx, dw, db) = (grads.next(), grads.next(), grads.next());
        let mut out = vec![dx];
        if self.has_w {
            out.push(dw);
        }
        if self.has_b {
            out.push(db);
        }
        Ok(out)
    }
}

/// Inputs `x, [weight], mean, rstd, dy`; outputs `dx` (x's shape and dtype, whatever dy's: see
/// [`mixed_suffix`]), `dweight` and `dbias` (`[C]` in the weight's dtype, or x's without a weight;
/// both computed either way).
struct LayerNormBackward {
    has_w: bool,
}

impl FusedOp for LayerNormBackward {
    fn name(&self) -> &'static str {
        "layer_norm_backward"
    }

    fn cpu_fwd(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<FusedOutputs<CpuStorage>> {
        check_arity("layer_norm_backward", inputs.len(), 4 + self.has_w as usize)?;
        let k = self.has_w as usize;
        let ((x, l), w) = (inputs[0], self.has_w.then(|| inputs[1]));
        let ((m, _), (r, _), (g, gl)) = (inputs[1 + k], inputs[2 + k], inputs[3 + k]);
        mixed_suffix("layer_norm_backward", x.dtype(), g.dtype())?;
        let out = cpu::layer_norm_backward(x, l, w, m, r, g, gl)?;
        Ok(grad_outputs(l, out))
    }

    fn cuda_fwd(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<FusedOutputs<CudaStorage>> {
        check_arity("layer_norm_backward", inputs.len(), 4 + self.has_w as usize)?;
        let k = self.has_w as usize;
        let ((x, l), w) = (inputs[0], self.has_w.then(|| inputs[1]));
        let ((m, _), (r, _), (g, gl)) = (inputs[1 + k], inputs[2 + k], inputs[3 + k]);
        let out = cuda::layer_norm_backward(x, l, w, m, r, g, gl)?;
        Ok(grad_outputs(l, out))
    }
}

fn grad_outputs<S>(l: &Layout, (dx, dw, db): (S, S, S)) -> FusedOutputs<S> {
    let c = super::rows::last_dim_rows(l).1;
    vec![(dx, l.shape().clone()), (dw, Shape::from(c)), (db, Shape::from(c))]
}

impl Tensor {
    /// Layer norm over the last dim with optional weight and bias of that size:
    /// `(x - mean) / sqrt(var + eps) * weight + bias`, the variance biased (as PyTorch's
    /// `F.layer_norm(x, [C], weight, bias, eps)`).
    pub fn layer_norm(&self, weight: Option<&Tensor>, bias: Option<&Tensor>, eps: f64) -> Result<Tensor> {
        self.layer_norm_to(weight, bias, eps, self.dtype())
    }

    /// [`Tensor::layer_norm`] with the output written in `out`: the input's dtype, or bf16 for an
    /// f32 input (the statistics and the normalization in f32, the result rounded once as it is
    /// stored: what `layer_norm(..).to_dtype(BF16)` gives, without the cast kernel). This is
    /// autocast's layer norm whose output feeds a bf16 GEMM; its backward takes the bf16 gradient
    /// and gives the input's, the weight's and the bias's in f32. Other pairs are a
    /// `DTypeMismatch`.
    pub fn layer_norm_to(
        &self,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f64,
        out: DType,
    ) -> Result<Tensor> {
        self.dtype().check_float("layer_norm")?;
        mixed_suffix("layer_norm", self.dtype(), out)?;
        let c = *self.dims().last().ok_or_else(|| shape_err!("layer_norm", "needs rank >= 1"))?;
        for (p, what) in [(weight, "weight"), (bias, "bias")] {
            if let Some(p) = p {
                if p.dims() != [c] {
                    return Err(shape_err!("layer_norm", "{what} has shape {:?}, expected [{c}]", p.dims()));
                }
                if p.dtype() != self.dtype() {
                    return Err(Error::DTypeMismatch { op: "layer_norm", lhs: self.dtype(), rhs: p.dtype() });
                }
            }
        }
        let mut inputs = vec![self];
        inputs.extend(weight);
        inputs.extend(bias);
        apply(Arc::new(LayerNorm { eps, has_w: weight.is_some(), has_b: bias.is_some(), out }), &inputs)
    }
}

/// `y` (with its saved `mean` and `rstd`) recorded as the layer norm of `x`, as if `x.layer_norm(..)`
/// had computed it: for fused ops whose kernel computes a layer norm along with something else
/// (`add_layer_norm`), so that their backward is layer norm's own.
pub(crate) fn record(
    x: &Tensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f64,
    (y, mean, rstd): (Tensor, Tensor, Tensor),
) -> Tensor {
    let mut inputs = vec![x.clone()];
    inputs.extend(weight.cloned());
    inputs.extend(bias.cloned());
    if !crate::backprop::track(&inputs.iter().collect::<Vec<_>>()) {
        return y;
    }
    let op = Arc::new(LayerNorm { eps, has_w: weight.is_some(), has_b: bias.is_some(), out: y.dtype() });
    let rec = super::FusedRecord { op, inputs, saved: vec![mean, rstd] };
    y.view(y.layout().clone(), Some(crate::op::Op::Fused(rec)))
}
