//! Attention over one packed QKV buffer: [`Tensor::attention_packed`].
//!
//! Why a second entry point: a transformer's QKV projection writes `[B, T, 3, H, D]`, and with
//! q, k and v as three views of it autograd must put three gradients back into one buffer. The
//! `Narrow` rule does that with a zero-filled `cat` per view and two full-size adds: on GPT-2
//! 124M that was ten strided copies and seven fills per layer, 37% of an H200 step's kernel time.
//! Here the buffer is the op's single input, both backends read q, k and v in place from its
//! strides, and the CUDA backward (cuDNN's or ours) writes dq, dk and dv straight into one
//! `[B, T, 3, H, D]` gradient through its output strides: the buffer's gradient costs nothing.
//! On the CPU the three gradients are stacked (one copy).

use super::{
    cpu, cuda, cudnn, math, resolve, select, three, wants_cudnn, AttentionOpts, Dropout, Problem, Sdpa, SdpaBackward,
};
use crate::cpu::CpuStorage;
use crate::cuda::CudaStorage;
use crate::fused::{apply, apply_all, FusedCtx, FusedOp, FusedOutputs};
use crate::{shape_err, Error, Layout, Result, Shape, Tensor};
use select::{count, Backend};
use std::sync::Arc;

const OP: &str = "attention_packed";

/// The `[B, H, T, D]` layouts of q, k and v inside a `[B, T, 3, H, D]` buffer laid out as `l`.
fn parts(l: &Layout) -> Result<[Layout; 3]> {
    let (d, s) = (l.dims(), l.strides());
    if d.len() != 5 || d[2] != 3 {
        return Err(shape_err!(OP, "qkv must be [B, T, 3, H, D], got {d:?}"));
    }
    let shape = Shape::from(vec![d[0], d[3], d[1], d[4]]);
    Ok([0, 1, 2].map(|i| Layout::new(shape.clone(), vec![s[0], s[3], s[1], s[4]], l.offset() + i * s[2])))
}

/// q, k and v as `[B, H, T, D]` views of `qkv` (recorded views: the composed path differentiates
/// through them).
fn views(qkv: &Tensor) -> Result<[Tensor; 3]> {
    if qkv.rank() != 5 || qkv.dims()[2] != 3 {
        return Err(shape_err!(OP, "qkv must be [B, T, 3, H, D], got {:?}", qkv.dims()));
    }
    let part = |i: usize| qkv.narrow(2, i, 1)?.squeeze(2)?.permute(&[0, 2, 1, 3]);
    Ok([part(0)?, part(1)?, part(2)?])
}

impl Tensor {
    /// Scaled dot-product attention of the q, k and v packed in one buffer: with
    /// `q = qkv[:, :, 0].transpose(1, 2)` (likewise k, v), the result is
    /// `F.scaled_dot_product_attention(q, k, v, ...).transpose(1, 2)`, `[B, T, H, D]` and
    /// contiguous, so `.reshape((B, T, H * D))` is free. What GPT-2's `c_attn` output reshaped to
    /// `[B, T, 3, H, D]` feeds.
    ///
    /// Everything else is [`scaled_dot_product_attention`](Self::scaled_dot_product_attention)'s
    /// (dtypes, devices, head dims, causal alignment, dropout from the default generator, errors);
    /// its gradient is one `[B, T, 3, H, D]` tensor written in place by the backward kernels
    /// instead of three gradients scattered back through views (see the module documentation).
    /// `Error::Shape` when `qkv` is not `[B, T, 3, H, D]`.
    pub fn attention_packed(qkv: &Tensor, opts: AttentionOpts) -> Result<Tensor> {
        let [q, k, v] = views(qkv)?;
        let mut pb = resolve(&q, &k, &v, &opts)?;
        if qkv.device().is_cuda() && select::backend()? == Backend::Math {
            select::announce(Backend::Math);
            count(|c| c.math += 1);
            return math::composed(&q, &k, &v, &pb, opts.dropout_p)?.permute(&[0, 2, 1, 3]);
        }
        if opts.dropout_p > 0.0 {
            let (seed, offset) = crate::rng::with_global_rng(|r| r.advance(pb.mask_blocks() * 4));
            pb.dropout = Some(Dropout::new(opts.dropout_p, seed, offset));
        }
        apply(Arc::new(Packed(pb)), &[qkv])
    }
}

/// The forward: input qkv `[B, T, 3, H, D]`; outputs O `[B, T, H, D]` and the saved log-sum-exp.
struct Packed(Problem);

/// The CUDA backward: inputs qkv, O, dO, lse; output dqkv `[B, T, 3, H, D]`.
struct PackedBackward(Problem);

impl FusedOp for Packed {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<FusedOutputs<CpuStorage>> {
        let x = three(inputs, 1, OP)?;
        let [q, k, v] = parts(x[0].1)?;
        cpu::forward(&self.0, (x[0].0, &q), (x[0].0, &k), (x[0].0, &v))
    }

    fn cuda_fwd(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<FusedOutputs<CudaStorage>> {
        // The unpacked op's forward on the three views: it reads them in place.
        let x = three(inputs, 1, OP)?;
        let [q, k, v] = parts(x[0].1)?;
        Sdpa(self.0).cuda_fwd(&[(x[0].0, &q), (x[0].0, &k), (x[0].0, &v)])
    }

    fn backward(&self, ctx: &FusedCtx<'_>, grad: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let lse = ctx.saved.first().ok_or_else(|| Error::Backward(format!("{OP}: the log-sum-exp was not saved")))?;
        let [qkv] = ctx.inputs else {
            return Err(Error::Backward(format!("{OP}: {} inputs recorded, expected 1", ctx.inputs.len())));
        };
        let grad = if grad.dtype() == qkv.dtype() { grad.clone() } else { grad.to_dtype(qkv.dtype())? };
        if qkv.device().is_cuda() {
            let g = apply_all(&PackedBackward(self.0), &[qkv, ctx.output, &grad, lse])?;
            return Ok(g.into_iter().next().map(Some).into_iter().collect());
        }
        // The CPU: the unpacked backward's dq, dk, dv `[B, T, H, D]`, stacked.
        let [q, k, v] = views(qkv)?;
        let g = apply_all(&SdpaBackward(self.0), &[&q, &k, &v, ctx.output, &grad, lse])?;
        Ok(vec![Some(Tensor::stack(&g, 2)?)])
    }
}

impl FusedOp for PackedBackward {
    fn name(&self) -> &'static str {
        "attention_packed_backward"
    }

    fn cpu_fwd(&self, _inputs: &[(&CpuStorage, &Layout)]) -> Result<FusedOutputs<CpuStorage>> {
        Err(Error::InvalidArgument(format!("{}: CUDA only (the CPU stacks the unpacked gradients)", self.name())))
    }

    fn cuda_fwd(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<FusedOutputs<CudaStorage>> {
        let x = three(inputs, 4, self.name())?;
        let [q, k, v] = parts(x[0].1)?;
        let (s, o, g, l) = (x[0].0, x[1], x[2], x[3]);
        if wants_cudnn(&self.0, s.dtype())? {
            if let Some(out) = cudnn::backward(&self.0, (s, &q), (s, &k), (s, &v), o, g, l, true)? {
                count(|c| c.cudnn_bwd += 1);
                return Ok(out);
            }
            count(|c| c.cudnn_fallbacks += 1);
        }
        count(|c| c.flash_bwd += 1);
        cuda::backward(&self.0, (s, &q), (s, &k), (s, &v), o, g, l, true)
    }
}
