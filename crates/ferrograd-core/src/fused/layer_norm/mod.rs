//! Layer norm over the last dim, with an optional weight and bias of that size: one fused kernel
//! forward (`layer_norm.cu`, statistics kept for the backward) and one backward kernel that gives
//! the input's, the weight's and the bias's gradients together. The backward folds the input's
//! pending gradient (`FusedOp::folds_pending`) into the input's as it stores it: in a pre-LN
//! transformer the norm's input is the residual stream, whose gradient from the next block's
//! residual add would otherwise be summed by a separate pass over it.

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

    /// dx, dweight and dbias from one kernel ([`LayerNormBackward`]), dx with x's pending gradient
    /// added: by the kernel where that gradient is dx's twin (x's shape, dtype and device), else
    /// after it, as the walk would have.
    fn backward(&self, ctx: &FusedCtx<'_>, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let x = &ctx.inputs[0];
        let (fold, after) = match ctx.pending.first().and_then(Option::as_ref) {
            Some(p) if p.dims() == x.dims() && p.dtype() == x.dtype() && p.device() == x.device() => (Some(p), None),
            p => (None, p),
        };
        let mut ins = vec![x];
        if self.has_w {
            ins.push(&ctx.inputs[1]);
        }
        ins.extend([&ctx.saved[0], &ctx.saved[1], g]);
        ins.extend(fold);
        let op = LayerNormBackward { has_w: self.has_w, has_res: fold.is_some() };
        let mut grads = apply_all(&op, &ins)?.into_iter();
        let (dx, dw, db) = (grads.next(), grads.next(), grads.next());
        let dx = match (dx, after) {
            // The walk's own order: the pending gradient plus the new one.
            (Some(dx), Some(p)) => Some(p.add(&dx)?),
            (dx, _) => dx,
        };
        let mut out = vec![dx];
        if self.has_w {
            out.push(dw);
        }
        if self.has_b {
            out.push(db);
        }
        Ok(out)
    }

    /// x's pending gradient goes into dx's store (see `backward`).
    fn folds_pending(&self, input: usize) -> bool {
        input == 0
    }
}

/// Inputs `x, [weight], mean, rstd, dy, [dres]`; outputs `dx` (x's shape and dtype, whatever dy's:
/// see [`mixed_suffix`]; plus `dres`, a gradient of x from elsewhere, where given), `dweight` and
/// `dbias` (`[C]` in the weight's dtype, or x's without a weight; both computed either way).
struct LayerNormBackward {
    has_w: bool,
    has_res: bool,
}

/// `LayerNormBackward`'s inputs by role: x, weight, mean, rstd, dy, dres.
struct BwdArgs<'a, S> {
    x: Arg<'a, S>,
    w: Option<Arg<'a, S>>,
    mean: &'a S,
    rstd: &'a S,
    dy: Arg<'a, S>,
    dres: Option<Arg<'a, S>>,
}

impl LayerNormBackward {
    /// The inputs by role, `dres` checked against x (its shape and dtype: it is added into dx).
    fn split<'a, S: BackendStorage>(&self, inputs: &[Arg<'a, S>]) -> Result<BwdArgs<'a, S>> {
        let k = self.has_w as usize;
        check_arity("layer_norm_backward", inputs.len(), 4 + k + self.has_res as usize)?;
        let (x, dres) = (inputs[0], self.has_res.then(|| inputs[4 + k]));
        if let Some((r, rl)) = dres {
            if rl.dims() != x.1.dims() {
                return Err(Error::ShapeMismatch {
                    op: "layer_norm_backward",
                    lhs: x.1.dims().to_vec(),
                    rhs: rl.dims().to_vec(),
                });
            }
            if r.dtype() != x.0.dtype() {
                return Err(Error::DTypeMismatch { op: "layer_norm_backward", lhs: x.0.dtype(), rhs: r.dtype() });
            }
        }
        let w = self.has_w.then(|| inputs[1]);
        Ok(BwdArgs { x, w, mean: inputs[1 + k].0, rstd: inputs[2 + k].0, dy: inputs[3 + k], dres })
    }
}

impl FusedOp for LayerNormBackward {
    fn name(&self) -> &'static str {
        "layer_norm_backward"
    }

    fn cpu_fwd(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<FusedOutputs<CpuStorage>> {
        let a = self.split(inputs)?;
        mixed_suffix("layer_norm_backward", a.x.0.dtype(), a.dy.0.dtype())?;
        let out = cpu::layer_norm_backward(a.x, a.w, a.mean, a.rstd, a.dy, a.dres)?;
        Ok(grad_outputs(a.x.1, out))
    }

    fn cuda_fwd(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<FusedOutputs<CudaStorage>> {
        let a = self.split(inputs)?;
        let out = cuda::layer_norm_backward(a.x, a.w, a.mean, a.rstd, a.dy, a.dres)?;
        Ok(grad_outputs(a.x.1, out))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::op::Op;
    use crate::{Device, Rng};

    /// The backward with x's pending gradient `p` gives dx + p (exactly, in f64) and the same
    /// dweight: `p` folded into the kernel's store when it is dx's twin (contiguous or strided),
    /// added after it otherwise (here a broadcastable `[C]`, which only a direct caller can pass).
    #[test]
    fn backward_adds_the_pending_gradient() -> Result<()> {
        let mut rng = Rng::new(4);
        let mut n = |d: &[usize]| Tensor::randn_with(&mut rng, 0.0, 1.0, d.to_vec(), DType::F64, Device::Cpu);
        let (x, w, g) = (n(&[3, 8])?, n(&[8])?, n(&[3, 8])?);
        let y = x.requires_grad().layer_norm(Some(&w), None, 1e-5)?;
        let Some(Op::Fused(rec)) = y.op() else {
            return Err(Error::Backward("layer norm was not recorded".into()));
        };
        // x's pending gradient reaches the backward (the weight's does not).
        assert!(rec.op.folds_pending(0) && !rec.op.folds_pending(1));
        let grads = |pending: &[Option<Tensor>]| -> Result<Vec<Vec<f64>>> {
            let ctx = FusedCtx { inputs: &rec.inputs, output: &y, saved: &rec.saved, pending };
            let gs = rec.op.backward(&ctx, &g)?;
            gs.iter().map(|t| t.as_ref().map_or(Ok(vec![]), |t| t.to_f64_vec())).collect()
        };
        let plain = grads(&[])?;
        let ln_dx = Tensor::from_vec(plain[0].clone(), (3, 8), Device::Cpu)?;
        for p in [n(&[3, 8])?, n(&[8, 3])?.t()?, n(&[8])?] {
            let got = grads(&[Some(p.clone()), None])?;
            assert_eq!(got[0], p.add(&ln_dx)?.to_f64_vec()?, "dx, pending {:?}", p.dims());
            assert_eq!(got[1], plain[1], "dweight, pending {:?}", p.dims());
        }
        Ok(())
    }
}
