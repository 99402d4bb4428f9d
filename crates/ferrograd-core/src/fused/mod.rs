//! The fused-op extension point: ops that are one kernel (or a few) on each device and carry their
//! own backward, in the spirit of candle's `CustomOp`.
//!
//! Primitive ops (elementwise maps, reductions, matmul, views, indexing) keep their variant of the
//! `Op` enum and their rule in `backprop.rs`. An op that fuses several of them (softmax, layer
//! norm, cross entropy, attention, a linear layer with its activation, a selective scan, fake
//! quantization) implements [`FusedOp`] instead, in a folder of its own under `src/fused/` holding
//! its CPU reference, its CUDA launch, its `.cu` file and its bench, so that adding one touches that
//! folder, its `pub mod` line below, its line in the kernel module list
//! (`src/cuda/modules.rs` `ALL`; a test there fails naming any folder whose kernels are missing)
//! and its tests (see `docs/adding-an-op.md`, which walks through `bias_gelu/`).
//!
//! Each folder: `mod.rs` (the public function on `Tensor`, the `FusedOp` impl and its backward, the
//! `MODULE` declaration of its kernels), `cpu.rs` (the reference), `cuda.rs` (the launches), the
//! `.cu` file, and `bench.rs` (the workload `ferrograd bench elementwise` times against PyTorch).
//!
//! Contract:
//! - `cpu_fwd` / `cuda_fwd` read every input through its `Layout` (strided views in place, or copy
//!   when the kernel needs rows) and return new contiguous storages: the op's output first, then
//!   whatever the backward needs (the *saved* tensors: per-row statistics, encoded targets, a
//!   pre-activation). All inputs are on one device; [`apply`] checks that.
//! - `cuda_fwd` must not synchronize with the host: a training step built from fused ops is captured
//!   as a CUDA graph. Input errors that can only be seen on the device (an index out of range) are
//!   raised through the device's error flag and reported at the next host read.
//! - `backward` gets the inputs, the output and the saved tensors as `Tensor`s and returns one
//!   gradient per input (`None` for inputs without one, such as class ids). It may call other fused
//!   ops (its backward kernels) through [`apply_all`], which records nothing.
//! - An op may fold an input's pending gradient (what that tensor's other users, differentiated
//!   before it, gave it) into the gradient it returns for it, saving the walk's separate add pass
//!   ([`FusedOp::folds_pending`]; layer norm does, for the pre-LN residual stream).

mod acc;
pub mod add_layer_norm;
pub mod attention;
pub mod bench;
pub mod bias_gelu;
pub mod classifier;
pub mod conv1d_causal;
pub mod cross_entropy;
pub mod fake_quantize;
pub mod layer_norm;
pub mod linear;
pub mod mse_loss;
mod rows;
pub mod selective_scan;
pub mod softmax;

use crate::backprop::track;
use crate::cpu::CpuStorage;
use crate::cuda::CudaStorage;
use crate::op::Op;
use crate::storage::Storage;
use crate::{Device, Error, Layout, Result, Shape, Tensor};
use std::sync::Arc;

/// What a fused op's forward returns on one backend: each output storage with its shape, the op's
/// value first, saved tensors after.
pub type FusedOutputs<S> = Vec<(S, Shape)>;

/// A fused op: a forward on each device and a backward. See the module documentation.
pub trait FusedOp: Send + Sync + 'static {
    /// The op's name, as errors and logs spell it (`layer_norm`, `scaled_dot_product_attention`).
    fn name(&self) -> &'static str;

    /// The forward on host storages.
    fn cpu_fwd(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<FusedOutputs<CpuStorage>>;

    /// The forward on device storages, enqueued on the current stream without host synchronization.
    fn cuda_fwd(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<FusedOutputs<CudaStorage>>;

    /// Gradients of the inputs given the gradient of the output, one entry per input.
    fn backward(&self, ctx: &FusedCtx<'_>, grad: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let _ = (ctx, grad);
        Err(Error::Backward(format!("{} is not differentiable", self.name())))
    }

    /// Whether `backward` folds input `input`'s pending gradient into the one it returns. A tensor
    /// used by several ops gets the sum of their gradients; the walk adds them as it goes, a full
    /// extra pass over the tensor per user. For an input this answers true of, the walk instead
    /// takes the gradient accumulated so far out of its map and hands it to `backward` as
    /// `ctx.pending[input]` (only when the input tracks gradients, has such a gradient and occurs
    /// once among the op's inputs; else `None`). `backward` must then return, for that input, its
    /// own gradient plus the pending one (added as its kernel stores the gradient, where it can),
    /// which the walk keeps in place of the pending one; or `None`, and the walk puts the pending
    /// gradient back. The pending gradient has the input's shape but any layout, and the dtype
    /// the other users gave it (normally the input's). Users differentiated after this op still
    /// add theirs as usual.
    fn folds_pending(&self, input: usize) -> bool {
        let _ = input;
        false
    }
}

/// What a fused op's backward sees of its forward.
pub struct FusedCtx<'a> {
    /// The op's inputs, in the order given to [`apply`].
    pub inputs: &'a [Tensor],
    /// The op's output (its value).
    pub output: &'a Tensor,
    /// The extra outputs the forward returned after the value.
    pub saved: &'a [Tensor],
    /// The gradient already accumulated for each input the op folds ([`FusedOp::folds_pending`]),
    /// one entry per input (`None` where nothing is pending or the op does not fold); empty when
    /// the backward runs outside the walk with nothing to fold.
    pub pending: &'a [Option<Tensor>],
}

/// A recorded fused op: the op, its inputs and the tensors its forward saved for the backward.
#[derive(Clone)]
pub struct FusedRecord {
    /// The op.
    pub op: Arc<dyn FusedOp>,
    /// Its inputs.
    pub inputs: Vec<Tensor>,
    /// The tensors its forward saved for the backward.
    pub saved: Vec<Tensor>,
}

/// Run the op's forward on the inputs' device and wrap every output as a tensor.
fn forward(op: &dyn FusedOp, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
    let first = inputs.first().ok_or_else(|| Error::InvalidArgument(format!("{}: no inputs", op.name())))?;
    let device = first.device();
    if let Some(t) = inputs.iter().find(|t| t.device() != device) {
        return Err(Error::DeviceMismatch { op: op.name(), lhs: device, rhs: t.device() });
    }
    let guards: Vec<_> = inputs.iter().map(|t| t.storage()).collect();
    let outs: Vec<(Storage, Shape)> = match device {
        Device::Cpu => {
            let args = guards
                .iter()
                .zip(inputs)
                .map(|(g, t)| g.as_cpu().map(|s| (s, t.layout())))
                .collect::<Option<Vec<_>>>()
                .ok_or(Error::DeviceMismatch { op: op.name(), lhs: device, rhs: Device::Cuda(0) })?;
            op.cpu_fwd(&args)?.into_iter().map(|(s, sh)| (Storage::Cpu(s), sh)).collect()
        }
        Device::Cuda(_) => {
            let args = guards
                .iter()
                .zip(inputs)
                .map(|(g, t)| g.as_cuda().map(|s| (s, t.layout())))
                .collect::<Option<Vec<_>>>()
                .ok_or(Error::DeviceMismatch { op: op.name(), lhs: device, rhs: Device::Cpu })?;
            op.cuda_fwd(&args)?.into_iter().map(|(s, sh)| (Storage::Cuda(s), sh)).collect()
        }
    };
    drop(guards);
    if outs.is_empty() {
        return Err(Error::InvalidArgument(format!("{}: the forward returned no output", op.name())));
    }
    Ok(outs.into_iter().map(|(s, sh)| Tensor::from_storage(s, sh, None)).collect())
}

/// Apply a differentiable fused op: its value, recorded as `Op::Fused` when an input tracks
/// gradients (the saved outputs are kept with the record, not returned).
pub fn apply(op: Arc<dyn FusedOp>, inputs: &[&Tensor]) -> Result<Tensor> {
    let mut outs = forward(op.as_ref(), inputs)?.into_iter();
    let value = outs.next().ok_or_else(|| Error::InvalidArgument(format!("{}: no output", op.name())))?;
    if !track(inputs) {
        return Ok(value);
    }
    let rec = FusedRecord { op, inputs: inputs.iter().map(|t| (*t).clone()).collect(), saved: outs.collect() };
    Ok(value.view(value.layout().clone(), Some(Op::Fused(rec))))
}

/// Run a fused op and return every output (value and saved), recording nothing: backward kernels,
/// and ops whose extra outputs the caller wants (layer norm's statistics).
pub fn apply_all(op: &dyn FusedOp, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
    forward(op, inputs)
}

/// The gradients of a recorded fused op's inputs, paired with the inputs (for `backprop.rs`), given
/// the pending gradients the walk took out for the inputs the op folds (one per input).
pub(crate) fn input_grads(
    rec: &FusedRecord,
    node: &Tensor,
    g: &Tensor,
    pending: &[Option<Tensor>],
) -> Result<Vec<(Tensor, Tensor)>> {
    let ctx = FusedCtx { inputs: &rec.inputs, output: node, saved: &rec.saved, pending };
    let grads = rec.op.backward(&ctx, g)?;
    if grads.len() != rec.inputs.len() {
        return Err(Error::Backward(format!(
            "{}: backward returned {} gradients for {} inputs",
            rec.op.name(),
            grads.len(),
            rec.inputs.len()
        )));
    }
    let mut out = vec![];
    for (x, gx) in rec.inputs.iter().zip(grads) {
        if let Some(gx) = gx {
            if gx.dims() != x.dims() {
                return Err(Error::Backward(format!(
                    "{}: gradient of shape {:?} for an input of shape {:?}",
                    rec.op.name(),
                    gx.dims(),
                    x.dims()
                )));
            }
            out.push((x.clone(), gx));
        }
    }
    Ok(out)
}

/// `Ok` when a forward got `want` inputs (a mismatch is a bug in the op's public function, reported
/// as a typed error rather than an index panic).
pub(crate) fn check_arity(op: &'static str, got: usize, want: usize) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!("{op}: {got} inputs, expected {want}")))
    }
}

/// The walk's side of [`FusedOp::folds_pending`], on a probe op.
#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::BackendStorage;
    use crate::op::{BinaryOp, UnaryOp};
    use std::sync::Mutex;

    /// `y = sum of the inputs` (one shape), folding every input: each input's gradient is `g` plus
    /// its pending one (`give`), or nothing at all (`!give`). `seen` records, per backward call,
    /// which inputs came with a pending gradient.
    struct Probe {
        give: bool,
        seen: Mutex<Vec<Vec<bool>>>,
    }

    impl FusedOp for Probe {
        fn name(&self) -> &'static str {
            "probe"
        }

        fn cpu_fwd(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<FusedOutputs<CpuStorage>> {
            let (x, l) = inputs[0];
            let c = Layout::contiguous(l.shape().clone());
            let mut y = x.unary(l, UnaryOp::Affine { mul: 1.0, add: 0.0 })?;
            for (s, sl) in &inputs[1..] {
                y = y.binary(&c, s, sl, BinaryOp::Add)?;
            }
            Ok(vec![(y, l.shape().clone())])
        }

        fn cuda_fwd(&self, _: &[(&CudaStorage, &Layout)]) -> Result<FusedOutputs<CudaStorage>> {
            Err(Error::InvalidArgument("probe: CPU only".into()))
        }

        fn backward(&self, ctx: &FusedCtx<'_>, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
            let pending = |i: usize| ctx.pending.get(i).and_then(Option::as_ref);
            let seen = (0..ctx.inputs.len()).map(|i| pending(i).is_some()).collect();
            self.seen.lock().map_err(|_| Error::Backward("probe: poisoned".into()))?.push(seen);
            (0..ctx.inputs.len())
                .map(|i| match (self.give, pending(i)) {
                    (false, _) => Ok(None),
                    (true, Some(p)) => g.add(p).map(Some),
                    (true, None) => Ok(Some(g.clone())),
                })
                .collect()
        }

        fn folds_pending(&self, _: usize) -> bool {
            true
        }
    }

    fn probe(give: bool) -> Arc<Probe> {
        Arc::new(Probe { give, seen: Mutex::new(vec![]) })
    }

    fn seen(p: &Probe) -> Vec<Vec<bool>> {
        p.seen.lock().map(|s| s.clone()).unwrap_or_default()
    }

    fn vals(t: &[f64]) -> Result<Tensor> {
        Tensor::from_vec(t.to_vec(), t.len(), Device::Cpu)
    }

    /// `loss = sum(a * op(x)) + sum(c * x)`, `x * c` made after the op (so differentiated before
    /// it, as the next residual add is in a pre-LN block): x's gradient from the `x * c` user is
    /// pending when the op's backward runs.
    fn two_users(op: Arc<Probe>, x: &Tensor, twice: bool) -> Result<Tensor> {
        let (a, c) = (vals(&[1.0, 2.0, 3.0])?, vals(&[10.0, 20.0, 30.0])?);
        let ins: Vec<&Tensor> = if twice { vec![x, x] } else { vec![x] };
        let y = apply(op, &ins)?;
        y.mul(&a)?.sum_all()?.add(&x.mul(&c)?.sum_all()?)
    }

    #[test]
    fn a_folded_gradient_replaces_the_pending_one() -> Result<()> {
        let x = vals(&[0.5, -1.0, 2.0])?.requires_grad();
        let p = probe(true);
        let grads = two_users(p.clone(), &x, false)?.backward()?;
        assert_eq!(seen(&p), [[true]]);
        // a + c: the pending c once, not twice.
        assert_eq!(grads.get(&x).map(|g| g.to_f64_vec()).transpose()?, Some(vec![11.0, 22.0, 33.0]));
        Ok(())
    }

    #[test]
    fn a_pending_gradient_the_op_does_not_return_goes_back() -> Result<()> {
        let x = vals(&[0.5, -1.0, 2.0])?.requires_grad();
        let p = probe(false);
        let grads = two_users(p.clone(), &x, false)?.backward()?;
        assert_eq!(seen(&p), [[true]]);
        assert_eq!(grads.get(&x).map(|g| g.to_f64_vec()).transpose()?, Some(vec![10.0, 20.0, 30.0]));
        Ok(())
    }

    #[test]
    fn nothing_pending_and_repeated_inputs_are_not_folded() -> Result<()> {
        // The op is x's only user: nothing pending.
        let x = vals(&[0.5, -1.0, 2.0])?.requires_grad();
        let p = probe(true);
        let grads = apply(p.clone(), &[&x])?.mul(&vals(&[1.0, 2.0, 3.0])?)?.sum_all()?.backward()?;
        assert_eq!(seen(&p), [[false]]);
        assert_eq!(grads.get(&x).map(|g| g.to_f64_vec()).transpose()?, Some(vec![1.0, 2.0, 3.0]));
        // x twice among the inputs: neither gets the pending gradient, both gradients are added.
        let p = probe(true);
        let grads = two_users(p.clone(), &x, true)?.backward()?;
        assert_eq!(seen(&p), [[false, false]]);
        assert_eq!(grads.get(&x).map(|g| g.to_f64_vec()).transpose()?, Some(vec![12.0, 24.0, 36.0]));
        // An input that tracks no gradient is not folded either (and gets none).
        let k = vals(&[1.0, 1.0, 1.0])?;
        let p = probe(true);
        let grads = apply(p.clone(), &[&k, &x])?.sum_all()?.add(&k.mul(&x)?.sum_all()?)?.backward()?;
        assert_eq!(seen(&p), [[false, true]]);
        assert_eq!(grads.get(&x).map(|g| g.to_f64_vec()).transpose()?, Some(vec![2.0, 2.0, 2.0]));
        assert!(grads.get(&k).is_none());
        Ok(())
    }
}
