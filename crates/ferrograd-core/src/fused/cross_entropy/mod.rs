//! Fused cross entropy of `[N, C]` logits against class ids, averaged over the rows whose target
//! is not the ignore index: one kernel forward (per-row loss, log-sum-exp and kept flag, then two
//! reductions and a division on the device) and one kernel backward.
//!
//! Targets are encoded first (`encode_targets`: u32 class ids, `IGNORED` for an ignored row);
//! the forward and the backward take them in that form.

pub mod bench;
mod cpu;
mod cuda;

use super::{apply, apply_all, check_arity, FusedCtx, FusedOp, FusedOutputs};
use crate::backend::BackendStorage;
use crate::cpu::CpuStorage;
use crate::cuda::modules::headers::{ACC_MATH, CE_ROW, COMMON, ONLINE_SOFTMAX};
use crate::cuda::modules::{Define, Module};
use crate::cuda::CudaStorage;
use crate::op::{BinaryOp, ReduceOp};
use crate::{shape_err, DType, Error, Layout, Result, Shape, Tensor};
use std::sync::Arc;

/// The encoded target of a row that the ignore index removes from the loss: the index kernels'
/// "no id" (`FG_ID_NONE`, `FG_CE_IGNORED`), so that the device's target check and the kernels agree.
pub(crate) const IGNORED: u32 = crate::cuda::ops::index::NO_ID;

/// Rows up to this many columns go one warp per row, longer rows one block per row.
pub(crate) const WARP_COLS: usize = 1024;

/// The kernels: `cross_entropy_fwd_{dt}` and `cross_entropy_bwd_{dt}`.
pub const MODULE: Module = Module::new("cross_entropy", include_str!("cross_entropy.cu"))
    .with_headers(&[COMMON, ACC_MATH, ONLINE_SOFTMAX, CE_ROW])
    .with_defines(&[Define::int("FG_CE_WARP_COLS", WARP_COLS as i64)])
    .with_cost_ms(700);

/// Input: integer targets `[N]`; output: the encoded ids (u32 `[N]`). A target outside
/// `[0, classes)` that is not the ignore index is `Error::IndexOutOfRange`: at once on the CPU, at
/// the next host read on CUDA (the device checks it; the host never reads the targets).
struct EncodeTargets {
    classes: usize,
    ignore_index: Option<i64>,
}

impl FusedOp for EncodeTargets {
    fn name(&self) -> &'static str {
        "cross_entropy targets"
    }

    fn cpu_fwd(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<FusedOutputs<CpuStorage>> {
        check_arity(self.name(), inputs.len(), 1)?;
        let (t, l) = inputs[0];
        Ok(vec![(cpu::encode_targets(t, l, self.classes, self.ignore_index)?, l.shape().clone())])
    }

    fn cuda_fwd(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<FusedOutputs<CudaStorage>> {
        check_arity(self.name(), inputs.len(), 1)?;
        let (t, l) = inputs[0];
        Ok(vec![(cuda::encode_targets(t, l, self.classes, self.ignore_index)?, l.shape().clone())])
    }
}

/// Inputs: logits `[N, C]`, encoded targets; outputs: the mean loss (a scalar in the logits'
/// dtype, or in `mean_dtype`), saved per-row log-sum-exp `[N]` and kept count (a scalar), both in
/// the accumulation dtype.
struct CrossEntropy {
    /// The mean's dtype when not the logits' own (`cross_entropy_acc`: the accumulation dtype).
    mean_dtype: Option<DType>,
}

/// `sum(loss_rows) / sum(kept)` (NaN when no row is kept, as in PyTorch) cast to `dtype`, and the
/// kept count: the same reductions on either backend.
fn mean_over_kept<S: BackendStorage>(loss: &S, kept: &S, rows: usize, dtype: DType) -> Result<(S, S)> {
    let (l, one) = (Layout::contiguous(rows), Layout::contiguous(1));
    let total = loss.reduce(&l, ReduceOp::Sum, &[0])?;
    let count = kept.reduce(&l, ReduceOp::Sum, &[0])?;
    let mean = total.binary(&one, &count, &one, BinaryOp::Div)?.to_dtype(&one, dtype)?;
    Ok((mean, count))
}

/// The forward's outputs from the per-row `(loss, lse, kept)` of logits with layout `l`.
fn forward_outputs<S: BackendStorage>(
    l: &Layout,
    dtype: DType,
    (loss, lse, kept): (S, S, S),
) -> Result<FusedOutputs<S>> {
    let rows = super::rows::last_dim_rows(l).0;
    let (mean, count) = mean_over_kept(&loss, &kept, rows, dtype)?;
    Ok(vec![(mean, Shape::from(())), (lse, Shape::from(rows)), (count, Shape::from(()))])
}

impl FusedOp for CrossEntropy {
    fn name(&self) -> &'static str {
        "cross_entropy"
    }

    fn cpu_fwd(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<FusedOutputs<CpuStorage>> {
        check_arity("cross_entropy", inputs.len(), 2)?;
        let ((x, l), (t, tl)) = (inputs[0], inputs[1]);
        forward_outputs(l, self.mean_dtype.unwrap_or(x.dtype()), cpu::cross_entropy_fwd(x, l, t, tl)?)
    }

    fn cuda_fwd(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<FusedOutputs<CudaStorage>> {
        check_arity("cross_entropy", inputs.len(), 2)?;
        let ((x, l), (t, tl)) = (inputs[0], inputs[1]);
        forward_outputs(l, self.mean_dtype.unwrap_or(x.dtype()), cuda::cross_entropy_fwd(x, l, t, tl)?)
    }

    /// dlogits = g / count * (softmax(x) - onehot(target)) on kept rows, 0 on ignored ones.
    fn backward(&self, ctx: &FusedCtx<'_>, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let (logits, tids) = (&ctx.inputs[0], &ctx.inputs[1]);
        let (lse, count) = (&ctx.saved[0], &ctx.saved[1]);
        let scale = g.to_dtype(count.dtype())?.div(count)?;
        let dx = apply_all(&CrossEntropyBackward, &[logits, tids, lse, &scale])?.into_iter().next();
        Ok(vec![dx, None])
    }
}

/// Inputs: logits, encoded targets, saved lse, scale (one accumulation-dtype element: the upstream
/// gradient over the kept count); output: the logits' gradient.
struct CrossEntropyBackward;

impl FusedOp for CrossEntropyBackward {
    fn name(&self) -> &'static str {
        "cross_entropy_backward"
    }

    fn cpu_fwd(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<FusedOutputs<CpuStorage>> {
        check_arity(self.name(), inputs.len(), 4)?;
        let ((x, l), (t, tl), (lse, ll), (s, sl)) = (inputs[0], inputs[1], inputs[2], inputs[3]);
        Ok(vec![(cpu::cross_entropy_bwd(x, l, t, tl, lse, ll, s, sl)?, l.shape().clone())])
    }

    fn cuda_fwd(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<FusedOutputs<CudaStorage>> {
        check_arity(self.name(), inputs.len(), 4)?;
        let ((x, l), (t, tl), (lse, ll), (s, sl)) = (inputs[0], inputs[1], inputs[2], inputs[3]);
        Ok(vec![(cuda::cross_entropy_bwd(x, l, t, tl, lse, ll, s, sl)?, l.shape().clone())])
    }
}

/// `targets` (any integer dtype) checked against `classes` and encoded as u32 ids (`IGNORED` for
/// the ignore index), as cross entropy's kernels and the fused classifier's take them.
pub(crate) fn encode_targets(targets: &Tensor, classes: usize, ignore_index: Option<i64>) -> Result<Tensor> {
    Ok(apply_all(&EncodeTargets { classes, ignore_index }, &[targets])?.remove(0))
}

impl Tensor {
    /// Cross entropy of logits `[N, C]` against class indices `[N]` (any integer dtype), averaged
    /// over the targets that are not `ignore_index`.
    pub fn cross_entropy(&self, targets: &Tensor, ignore_index: Option<i64>) -> Result<Tensor> {
        self.cross_entropy_impl(targets, ignore_index, None)
    }

    /// [`Tensor::cross_entropy`] whose mean stays in the kernels' accumulation dtype (f32 for f16
    /// and bf16 logits, else the logits' own): the loss as autocast computes it, without an f32
    /// copy of the logits (half-precision logits are read as they are; the gradient comes back in
    /// their dtype).
    pub fn cross_entropy_acc(&self, targets: &Tensor, ignore_index: Option<i64>) -> Result<Tensor> {
        let acc = if self.dtype() == DType::F64 { DType::F64 } else { DType::F32 };
        self.cross_entropy_impl(targets, ignore_index, Some(acc))
    }

    fn cross_entropy_impl(
        &self,
        targets: &Tensor,
        ignore_index: Option<i64>,
        mean_dtype: Option<DType>,
    ) -> Result<Tensor> {
        if self.rank() != 2 || targets.dims() != [self.dims()[0]] {
            return Err(shape_err!(
                "cross_entropy",
                "logits {:?} and targets {:?}: expected [N, C] and [N]",
                self.dims(),
                targets.dims()
            ));
        }
        if targets.dtype().is_float() {
            return Err(Error::UnsupportedDType { op: "cross_entropy targets", dtype: targets.dtype() });
        }
        self.dtype().check_float("cross_entropy")?;
        if targets.device() != self.device() {
            return Err(Error::DeviceMismatch { op: "cross_entropy", lhs: self.device(), rhs: targets.device() });
        }
        // Checked and encoded once (u32 ids, IGNORED for an ignored row); the backward reuses them.
        let tids = encode_targets(targets, self.dims()[1], ignore_index)?;
        apply(Arc::new(CrossEntropy { mean_dtype }), &[self, &tids])
    }
}
