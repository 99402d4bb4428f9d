//! ZeRO-1: each rank keeps AdamW's moments (and an f32 master copy of the parameters) for its
//! shard of every bucket only: 1/world of the optimizer memory. A step is reduce-scatter of the
//! gradient buckets (during backward), AdamW on the shards, all-gather of the updated shards, and
//! a copy back into the parameters. AdamW is elementwise, so the result is the unsharded step's.

use crate::bucket::BucketPlan;
use crate::comm::{Communicator, ReduceOp};
use crate::error::DistResult;
use ferrograd_core::optim::{adam_step, AdamConfig};
use ferrograd_core::{no_grad, DType, Device, Error, Result, Tensor};
use std::sync::Arc;

pub(super) struct ZeroState {
    pub adam: AdamConfig,
    pub steps: u64,
    /// Per bucket, this rank's shard: parameters (f32 master copy) and moments.
    pub master: Vec<Tensor>,
    pub m: Vec<Tensor>,
    pub v: Vec<Tensor>,
    /// Whole per-parameter moments while a checkpoint is written or read (`<name>.m`, `<name>.v`).
    pub staging: Option<Vec<(String, Tensor)>>,
}

/// Every parameter written into its slot of a flat f32 buffer per bucket.
pub(super) fn flat_params(plan: &BucketPlan, params: &[(String, Tensor)], device: Device) -> Result<Vec<Tensor>> {
    let _g = no_grad();
    let flats = plan.buckets.iter().map(|b| Tensor::zeros(b.len, DType::F32, device)).collect::<Result<Vec<_>>>()?;
    for (p, (_, t)) in params.iter().enumerate() {
        let s = &plan.slots[p];
        flats[s.bucket].narrow(0, s.offset, s.numel)?.set(&t.reshape(s.numel)?)?;
    }
    Ok(flats)
}

/// A copy of chunk `rank` of each flat buffer.
pub(super) fn shards_of(plan: &BucketPlan, flats: &[Tensor], rank: usize) -> Result<Vec<Tensor>> {
    flats
        .iter()
        .enumerate()
        .map(|(b, f)| {
            let sl = plan.shard_len(b);
            let s = Tensor::zeros(sl, DType::F32, f.device())?;
            s.set(&f.narrow(0, rank * sl, sl)?)?;
            Ok(s)
        })
        .collect()
}

/// All-gather the f32 buckets `flats` (chunk `rank` of each holds this rank's updated shard) and
/// copy every parameter out of its slot, except those `skip` names (ones this rank's chunk holds
/// whole, already in place). Compute waits on the device only, so a captured step can hold it.
pub(super) fn gather_into_params(
    comm: &Arc<dyn Communicator>,
    plan: &BucketPlan,
    params: &[(String, Tensor)],
    flats: &[Tensor],
    skip: impl Fn(usize) -> bool,
) -> DistResult<()> {
    let _g = no_grad();
    let works = flats.iter().map(|f| comm.all_gather(f)).collect::<DistResult<Vec<_>>>()?;
    for w in works {
        w.wait()?;
    }
    for (p, (_, t)) in params.iter().enumerate().filter(|(p, _)| !skip(*p)) {
        let s = &plan.slots[p];
        t.set(&flats[s.bucket].narrow(0, s.offset, s.numel)?.reshape(t.dims())?)?;
    }
    Ok(())
}

impl ZeroState {
    pub fn new(plan: &BucketPlan, dp: &super::DataParallel, adam: AdamConfig) -> DistResult<ZeroState> {
        let (device, rank) = (dp.comm.device(), dp.comm.rank());
        let master = shards_of(plan, &flat_params(plan, &dp.params, device)?, rank)?;
        let zeros = || -> Result<Vec<Tensor>> {
            (0..plan.buckets.len()).map(|b| Tensor::zeros(plan.shard_len(b), DType::F32, device)).collect()
        };
        Ok(ZeroState { adam: AdamConfig { ..adam }, steps: 0, master, m: zeros()?, v: zeros()?, staging: None })
    }

    /// Re-read the master shards from the parameters (after a checkpoint wrote them).
    pub fn refresh_master(
        &mut self,
        plan: &BucketPlan,
        params: &[(String, Tensor)],
        device: Device,
        rank: usize,
    ) -> Result<()> {
        self.master = shards_of(plan, &flat_params(plan, params, device)?, rank)?;
        Ok(())
    }

    /// Scale this rank's gradient shards to a global L2 norm of at most `max_norm`; returns the
    /// norm before clipping (PyTorch's formula and epsilon, as ferrograd-nn's clip_grad_norm).
    pub fn clip(&mut self, comm: &Arc<dyn Communicator>, shards: &mut [Tensor], max_norm: f64) -> DistResult<Tensor> {
        let _g = no_grad();
        let sums = shards.iter().map(|g| g.sqr()?.sum_all()).collect::<Result<Vec<_>>>()?;
        let local = Tensor::stack(&sums, 0)?.sum_all()?.reshape(1)?.contiguous()?;
        let total = Tensor::zeros(1, DType::F32, comm.device())?;
        total.set(&local)?;
        comm.all_reduce(&total, ReduceOp::Sum)?.wait()?;
        let norm = total.sqrt()?.reshape(())?;
        let scale = norm.add_scalar(1e-6)?.recip()?.mul_scalar(max_norm)?.clamp(f64::NEG_INFINITY, 1.0)?;
        for g in shards.iter_mut() {
            *g = g.mul(&scale)?;
        }
        Ok(norm)
    }

    /// AdamW on the shards, all-gather, write back into the parameters.
    pub fn step(
        &mut self,
        comm: &Arc<dyn Communicator>,
        plan: &BucketPlan,
        params: &[(String, Tensor)],
        bufs: &[Tensor],
        grads: &[Tensor],
    ) -> DistResult<()> {
        let _g = no_grad();
        self.steps += 1;
        adam_step(&self.master, grads, &self.m, &self.v, &self.adam, self.steps)?;
        let rank = comm.rank();
        let mut full = Vec::with_capacity(bufs.len());
        for (b, buf) in bufs.iter().enumerate() {
            // The gradient bucket is free again: gather the parameters through it when it is f32.
            let f = if buf.dtype() == DType::F32 {
                buf.clone()
            } else {
                Tensor::zeros(buf.elem_count(), DType::F32, buf.device())?
            };
            let sl = plan.shard_len(b);
            f.narrow(0, rank * sl, sl)?.set(&self.master[b])?;
            full.push(f);
        }
        gather_into_params(comm, plan, params, &full, |_| false)
    }

    pub fn state_tensors(&self, rank: usize) -> Vec<(String, Tensor)> {
        if let Some(s) = &self.staging {
            return s.clone();
        }
        // Outside save_checkpoint/load_checkpoint only the shards exist; their names do not match a
        // whole-model file, so a file written from them fails loudly on load instead of silently.
        let mut out = vec![];
        for (b, (m, v)) in self.m.iter().zip(&self.v).enumerate() {
            out.push((format!("zero1.bucket{b}.rank{rank}.m"), m.clone()));
            out.push((format!("zero1.bucket{b}.rank{rank}.v"), v.clone()));
        }
        out
    }

    pub fn load_meta(&mut self, meta: &serde_json::Value) -> Result<()> {
        let bad = |k: &str| Error::InvalidArgument(format!("optimizer state: missing or bad {k:?}"));
        let steps = meta.get("steps").and_then(|v| v.as_u64()).ok_or_else(|| bad("steps"))?;
        let lr = meta.get("lr").and_then(|v| v.as_f64()).ok_or_else(|| bad("lr"))?;
        self.steps = steps;
        self.adam.lr = lr;
        Ok(())
    }
}
