//! Layer norm over the last dim, with an optional weight and bias of that size: one fused kernel
//! forward (`layer_norm.cu`, statistics kept for the backward) and one backward kernel that gives
//! the input's, the weight's and the bias's gradients together.

pub mod bench;
pub(crate) mod cpu;
mod cuda;

use super::{apply, apply_all, check_arity, FusedCtx, FusedOp, FusedOutputs};
use crate::cpu::CpuStorage;
use crate::cuda::modules::headers::{COMMON, ROW_REDUCE, VEC_LOAD};
use crate::cuda::modules::Module;
use crate::cuda::CudaStorage;
use crate::{shape_err, Error, Layout, Result, Shape, Tensor};
use std::sync::Arc;

/// The kernels: `layer_norm_fwd_{dt}` (any row), `layer_norm_fwd_rows_{dt}` (the row in
/// registers) and `layer_norm_bwd_{dt}`.
pub const MODULE: Module = Module::new("layer_norm", include_str!("layer_norm.cu"))
    .with_headers(&[COMMON, ROW_REDUCE, VEC_LOAD])
    .with_cost_ms(2000);

/// Inputs `x, [weight], [bias]`; outputs `y, mean, rstd` (mean and rstd saved for the backward:
/// one per row, in the accumulation dtype).
struct LayerNorm {
    eps: f64,
    has_w: bool,
    has_b: bool,
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
        Ok(self.outputs(l, cpu::layer_norm(x, l, w, b, self.eps)?))
    }

    fn cuda_fwd(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<FusedOutputs<CudaStorage>> {
        check_arity("layer_norm", inputs.len(), 1 + self.has_w as usize + self.has_b as usize)?;
        let (x, l) = inputs[0];
        let (w, b) = params(inputs, self.has_w, self.has_b);
        Ok(self.outputs(l, cuda::layer_norm(x, l, w, b, self.eps)?))
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

/// Inputs `x, [weight], mean, rstd, dy`; outputs `dx` (x's shape and dtype), `dweight` and `dbias`
/// (`[C]` in the weight's dtype, or x's without a weight; both computed either way).
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
        self.dtype().check_float("layer_norm")?;
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
        apply(Arc::new(LayerNorm { eps, has_w: weight.is_some(), has_b: bias.is_some() }), &inputs)
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
    let op = Arc::new(LayerNorm { eps, has_w: weight.is_some(), has_b: bias.is_some() });
    let rec = super::FusedRecord { op, inputs, saved: vec![mean, rstd] };
    y.view(y.layout().clone(), Some(crate::op::Op::Fused(rec)))
}
