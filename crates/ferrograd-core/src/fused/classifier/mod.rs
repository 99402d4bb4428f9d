//! The fused classifier (llm.c's `fused_classifier`): cross entropy's loss *and* the logits'
//! gradient from one kernel (`classifier.cu`), one pass over the logits for the row's log-sum-exp
//! and one more (from the row's copy in shared memory) writing `(softmax - onehot) / kept`; no
//! probability tensor, no second kernel in the backward, and the logits read from DRAM once.
//!
//! Its own folder rather than a third mode of `cross_entropy`: cross entropy's forward must not
//! write `C` elements per row that a caller without a backward never reads, and this op's contract
//! (the gradient is formed in the forward, optionally over the logits themselves, over a prefix of
//! a padded row) is different enough to keep apart. It shares cross entropy's target encoding.
//!
//! Two entries:
//! - [`Tensor::fused_classifier`]: the mean loss as a differentiable op. The forward saves the
//!   gradient of the mean loss; the backward scales it by the incoming gradient (one elementwise
//!   pass: the upstream gradient is a device scalar, unknown when the forward runs).
//! - [`Tensor::classifier_loss_grad`]: what a training step wants, as llm.c does it: the upstream
//!   scale is known on the host (`1 / grad_accum`), so the kernel writes the final `dlogits`,
//!   optionally in place over the logits (dead after the loss), and the caller backpropagates from
//!   the logits with it (`Tensor::backward_into_with`). Over the first `classes` columns only: a
//!   padded vocabulary's extra columns get gradient 0 without a narrow (and the narrow's padding
//!   copy in the backward).

pub mod bench;
mod cpu;
mod cuda;

use super::{apply, check_arity, FusedCtx, FusedOp, FusedOutputs};
use crate::backend::BackendStorage;
use crate::cpu::CpuStorage;
use crate::cuda::modules::headers::{ACC_MATH, CE_ROW, COMMON, ONLINE_SOFTMAX};
use crate::cuda::modules::Module;
use crate::cuda::CudaStorage;
use crate::op::BinaryOp;
use crate::storage::Storage;
use crate::{shape_err, DType, Error, Layout, Result, Shape, Tensor};
use cuda::RowsView;
use std::sync::Arc;

pub(crate) use super::cross_entropy::IGNORED;

/// The kernels: `classifier_count_{dt}` and `classifier_{dt}`.
pub const MODULE: Module = Module::new("classifier", include_str!("classifier.cu"))
    .with_headers(&[COMMON, ACC_MATH, ONLINE_SOFTMAX, CE_ROW])
    .with_cost_ms(700);

/// What [`Tensor::classifier_loss_grad`] computes.
#[derive(Debug, Clone, Copy)]
pub struct ClassifierOpts {
    /// The real classes: the first `classes` columns (`None`: all). The rest get gradient 0.
    pub classes: Option<usize>,
    /// Rows whose target is this are skipped (PyTorch's `ignore_index`, -100 there by default; `None` here).
    pub ignore_index: Option<i64>,
    /// The gradient written is that of `grad_scale * mean loss` (`1 / k` for `k` micro-batches).
    pub grad_scale: f64,
    /// Write the gradient over the logits (CUDA; on the CPU a new tensor is returned either way).
    /// The logits' values are gone afterwards: only for logits nothing else reads.
    pub in_place: bool,
}

impl Default for ClassifierOpts {
    fn default() -> Self {
        ClassifierOpts { classes: None, ignore_index: None, grad_scale: 1.0, in_place: false }
    }
}

/// The mean over kept rows of the loss rows, cast to `dtype`: `sum(loss) / count`.
fn mean<S: BackendStorage>(loss: &S, count: &S, rows: usize, dtype: DType) -> Result<S> {
    let (l, one) = (Layout::contiguous(rows), Layout::contiguous(1));
    let total = loss.reduce(&l, crate::op::ReduceOp::Sum, &[0])?;
    total.binary(&one, count, &one, BinaryOp::Div)?.to_dtype(&one, dtype)
}

/// `(rows, cols)` of rank-2 logits.
fn dims2(l: &Layout) -> Result<(usize, usize)> {
    match l.dims() {
        &[r, c] => Ok((r, c)),
        d => Err(shape_err!("fused_classifier", "logits must be [N, C], got {d:?}")),
    }
}

/// The CPU forward: `(mean loss in ACC, dlogits [rows, cols] in x's dtype)`.
fn cpu_forward(
    x: (&CpuStorage, &Layout),
    t: (&CpuStorage, &Layout),
    valid: usize,
    scale: f64,
) -> Result<(CpuStorage, CpuStorage)> {
    let (rows, cols) = dims2(x.1)?;
    let tids = crate::cpu::strided::map(cpu::tids(t.0)?, t.1, |v| v)?;
    let (loss, dx) = cpu::classifier(&x.0.to_f64_vec(x.1)?, &tids, (rows, cols, valid), scale)?;
    let acc = x.0.dtype().acc();
    let kept = tids.iter().filter(|&&v| v != IGNORED).count();
    let loss = CpuStorage::from_f64_iter(loss.into_iter(), acc)?;
    let count = CpuStorage::from_f64_iter(std::iter::once(kept as f64), acc)?;
    Ok((mean(&loss, &count, rows, acc)?, CpuStorage::from_f64_iter(dx.into_iter(), x.0.dtype())?))
}

/// The logits as rows with unit column stride, or `None` (the caller copies).
fn rows_view(l: &Layout) -> Option<RowsView> {
    let (&[r, c], &[rs, cs]) = (l.dims(), l.strides()) else { return None };
    if (cs == 1 || c <= 1) && (rs >= c || r <= 1) {
        Some(RowsView { offset: l.offset(), ld: if r <= 1 { c.max(1) } else { rs } })
    } else {
        None
    }
}

/// The encoded targets' offset, contiguous.
fn targets_offset(t: &Layout, rows: usize) -> Result<usize> {
    if t.elem_count() != rows || !t.is_contiguous() {
        return Err(shape_err!("fused_classifier", "{} encoded targets for {rows} rows", t.elem_count()));
    }
    Ok(t.offset())
}

/// The CUDA forward into a new gradient buffer: `(mean loss in ACC, dlogits [rows, cols])`.
fn cuda_forward(
    x: (&CudaStorage, &Layout),
    t: (&CudaStorage, &Layout),
    valid: usize,
    scale: f64,
) -> Result<(CudaStorage, CudaStorage)> {
    let (rows, cols) = dims2(x.1)?;
    let toff = targets_offset(t.1, rows)?;
    let (own, xv) = match rows_view(x.1) {
        Some(v) => (None, v),
        None => (Some(x.0.copy_strided(x.1)?), RowsView { offset: 0, ld: cols.max(1) }),
    };
    let xs = own.as_ref().unwrap_or(x.0);
    let dx = CudaStorage::uninit(x.0.dev(), rows * cols, x.0.dtype())?;
    let dxv = RowsView { offset: 0, ld: cols.max(1) };
    let (loss, count) = cuda::classifier(xs, &xv, &dx, &dxv, t.0, toff, (rows, cols, valid), scale)?;
    Ok((mean(&loss, &count, rows, x.0.dtype().acc())?, dx))
}

/// Inputs: logits `[N, C]`, encoded targets `[N]`; outputs: the mean loss (0-d, ACC) and the saved
/// gradient of the mean loss (`[N, C]`, the logits' dtype).
struct Classifier {
    valid: usize,
}

impl FusedOp for Classifier {
    fn name(&self) -> &'static str {
        "fused_classifier"
    }

    fn cpu_fwd(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<FusedOutputs<CpuStorage>> {
        check_arity(self.name(), inputs.len(), 2)?;
        let (loss, dx) = cpu_forward(inputs[0], inputs[1], self.valid, 1.0)?;
        Ok(vec![(loss, Shape::from(())), (dx, inputs[0].1.shape().clone())])
    }

    fn cuda_fwd(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<FusedOutputs<CudaStorage>> {
        check_arity(self.name(), inputs.len(), 2)?;
        let (loss, dx) = cuda_forward(inputs[0], inputs[1], self.valid, 1.0)?;
        Ok(vec![(loss, Shape::from(())), (dx, inputs[0].1.shape().clone())])
    }

    /// The saved gradient of the mean loss times the incoming gradient.
    fn backward(&self, ctx: &FusedCtx<'_>, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let d = ctx.saved.first().ok_or_else(|| Error::Backward("fused_classifier: no saved gradient".into()))?;
        Ok(vec![Some(d.mul(&g.to_dtype(d.dtype())?)?), None])
    }
}

/// Checks shared by both entries; the encoded targets.
fn prepare(x: &Tensor, targets: &Tensor, classes: usize, ignore_index: Option<i64>) -> Result<Tensor> {
    if x.rank() != 2 || targets.dims() != [x.dims()[0]] {
        return Err(shape_err!(
            "fused_classifier",
            "logits {:?} and targets {:?}: expected [N, C] and [N]",
            x.dims(),
            targets.dims()
        ));
    }
    x.dtype().check_float("fused_classifier")?;
    if targets.dtype().is_float() {
        return Err(Error::UnsupportedDType { op: "fused_classifier targets", dtype: targets.dtype() });
    }
    if targets.device() != x.device() {
        return Err(Error::DeviceMismatch { op: "fused_classifier", lhs: x.device(), rhs: targets.device() });
    }
    if classes > x.dims()[1] {
        return Err(shape_err!("fused_classifier", "{classes} classes but the logits have {} columns", x.dims()[1]));
    }
    super::cross_entropy::encode_targets(targets, classes, ignore_index)
}

impl Tensor {
    /// Mean cross entropy of logits `[N, C]` against class indices `[N]` (any integer dtype) over
    /// the targets that are not `ignore_index`, as [`Tensor::cross_entropy_acc`] (the mean in the
    /// accumulation dtype), with the logits' gradient computed by the same kernel (see the module
    /// docs): faster when a backward follows, one extra `[N, C]` buffer held until it does.
    pub fn fused_classifier(&self, targets: &Tensor, ignore_index: Option<i64>) -> Result<Tensor> {
        let tids = prepare(self, targets, self.dims().get(1).copied().unwrap_or(0), ignore_index)?;
        apply(Arc::new(Classifier { valid: self.dims()[1] }), &[self, &tids])
    }

    /// `(mean loss, dlogits)`: the mean cross entropy over the first `classes` columns of logits
    /// `[N, C]` (in the accumulation dtype, cut from the graph) and the gradient of `grad_scale *`
    /// that loss with respect to the logits (their shape and dtype; 0 past `classes`), from one
    /// kernel. With `in_place` on CUDA the gradient overwrites the logits (their storage and
    /// layout); otherwise it is a new contiguous tensor. Backpropagate it with
    /// `logits.backward_into_with(&dlogits, store)`. Nothing here waits for the device.
    pub fn classifier_loss_grad(&self, targets: &Tensor, opts: ClassifierOpts) -> Result<(Tensor, Tensor)> {
        let cols = self.dims().get(1).copied().unwrap_or(0);
        let classes = opts.classes.unwrap_or(cols);
        let tids = prepare(self, targets, classes, opts.ignore_index)?;
        let _ng = crate::no_grad();
        let shape = self.shape().clone();
        if opts.in_place && self.device().is_cuda() {
            let xv = rows_view(self.layout())
                .ok_or_else(|| shape_err!("fused_classifier", "in place needs rows with unit column stride"))?;
            let (rows, cols) = (self.dims()[0], cols);
            let loss = {
                let (g, tg) = (self.storage(), tids.storage());
                let (Storage::Cuda(x), Storage::Cuda(t)) = (&*g, &*tg) else {
                    return Err(Error::DeviceMismatch {
                        op: "fused_classifier",
                        lhs: self.device(),
                        rhs: tids.device(),
                    });
                };
                let toff = targets_offset(tids.layout(), rows)?;
                let (loss, count) = cuda::classifier(x, &xv, x, &xv, t, toff, (rows, cols, classes), opts.grad_scale)?;
                mean(&loss, &count, rows, self.dtype().acc())?
            };
            let loss = Tensor::from_storage(Storage::Cuda(loss), (), None);
            return Ok((loss, self.view(self.layout().clone(), None)));
        }
        let (loss, dx) = {
            let (g, tg) = (self.storage(), tids.storage());
            match (&*g, &*tg) {
                (Storage::Cpu(x), Storage::Cpu(t)) => {
                    let (l, d) = cpu_forward((x, self.layout()), (t, tids.layout()), classes, opts.grad_scale)?;
                    (Storage::Cpu(l), Storage::Cpu(d))
                }
                (Storage::Cuda(x), Storage::Cuda(t)) => {
                    let (l, d) = cuda_forward((x, self.layout()), (t, tids.layout()), classes, opts.grad_scale)?;
                    (Storage::Cuda(l), Storage::Cuda(d))
                }
                _ => {
                    return Err(Error::DeviceMismatch {
                        op: "fused_classifier",
                        lhs: self.device(),
                        rhs: tids.device(),
                    })
                }
            }
        };
        Ok((Tensor::from_storage(loss, (), None), Tensor::from_storage(dx, shape, None)))
    }
}
