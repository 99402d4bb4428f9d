//! ZeRO-1 for a training loop that keeps its own optimizer (`gpt train --zero 1`: GPT's two-group,
//! device-scheduled AdamW over this rank's shard, `ferrograd-models/src/gpt/zero.rs`).
//!
//! [`DataParallel::shard_sync`] reduce-scatters the gradient buckets during backward like ZeRO-1
//! ([`DataParallel::zero1`]) but owns no optimizer state. Per step the caller:
//!
//! 1. runs `backward_seeded` / `backward` and `reduce_grads` as always;
//! 2. reads this rank's averaged gradient shard per bucket ([`DataParallel::shard_grads`]), clips
//!    it (summing its squared norm over the ranks) and updates the parameter elements the shard
//!    covers ([`DataParallel::shard_parts`]) in place, with moments for those elements only;
//! 3. calls `step`, which writes this rank's updated elements into an f32 bucket, all-gathers the
//!    buckets and copies every parameter back out.
//!
//! The parameters themselves hold the updated elements, so there is no master copy; compute only
//! ever waits on the device, so the whole step can be captured as a CUDA graph.

use super::zero::gather_into_params;
use super::{invalid, DataParallel, DpConfig, Mode, NoUpdate, Phase};
use crate::comm::Communicator;
use crate::error::DistResult;
use ferrograd_core::{no_grad, DType, Device, Result, Tensor};
use std::ops::Range;
use std::sync::Arc;

/// A part of this rank's shard: elements `range` of parameter `param` (flattened), whose averaged
/// gradient is elements `offset..offset + range.len()` of this rank's shard of bucket `bucket`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardPart {
    pub param: usize,
    pub range: Range<usize>,
    pub bucket: usize,
    pub offset: usize,
}

pub(super) struct ShardSync {
    /// In parameter order; a parameter has at most one part (a shard is one contiguous range).
    parts: Vec<ShardPart>,
    /// Per bucket, the f32 buffer the parameters are all-gathered through: the gradient bucket
    /// itself when gradients travel as f32 (it is free once the shard is updated), else its own.
    gather: Vec<Tensor>,
}

impl DataParallel {
    /// ZeRO-1 without an optimizer (see the module doc): buckets are reduce-scattered, the
    /// caller's optimizer updates the elements of [`DataParallel::shard_parts`], `step`
    /// all-gathers the parameters. Broadcasts `params` from rank 0 like `new`.
    pub fn shard_sync(
        comm: Arc<dyn Communicator>,
        params: Vec<(String, Tensor)>,
        cfg: DpConfig,
    ) -> DistResult<DataParallel> {
        let cfg = DpConfig { zero: 1, ..cfg };
        let mut dp =
            Self::build(comm, params, cfg, |_, _| Ok(Mode::Replicated(Box::new(NoUpdate { params: vec![] }))))?;
        let rank = dp.comm.rank();
        let parts = (0..dp.params.len())
            .filter_map(|p| {
                let (range, offset) = dp.plan.shard_part(p, rank)?;
                Some(ShardPart { param: p, range, bucket: dp.plan.slots[p].bucket, offset })
            })
            .collect();
        let gather = if dp.cfg.comm_dtype == DType::F32 {
            dp.bufs.clone()
        } else {
            let device = dp.comm.device();
            dp.plan.buckets.iter().map(|b| Tensor::zeros(b.len, DType::F32, device)).collect::<Result<Vec<_>>>()?
        };
        dp.shard = Some(ShardSync { parts, gather });
        Ok(dp)
    }

    /// The parameter elements this rank updates, in parameter order (empty outside `shard_sync`).
    pub fn shard_parts(&self) -> &[ShardPart] {
        self.shard.as_ref().map_or(&[], |s| &s.parts)
    }

    /// After `reduce_grads`: this rank's shard of each bucket's averaged gradient, f32 (padding
    /// is zero). Valid until `step`.
    pub fn shard_grads(&self) -> DistResult<Vec<Tensor>> {
        if self.shard.is_none() || self.phase != Phase::Reduced {
            return Err(invalid("shard_grads: only between reduce_grads and step of a shard_sync".into()));
        }
        Ok(self.reduced.clone())
    }

    /// `step` of a `shard_sync`: this rank's parameter elements into its chunk of the f32 buckets,
    /// all-gather, every parameter copied back (but those this rank holds whole).
    pub(super) fn gather_params(&mut self) -> DistResult<()> {
        let Some(s) = &self.shard else { return Ok(()) };
        let _g = no_grad();
        let rank = self.comm.rank();
        for part in &s.parts {
            let (t, n) = (&self.params[part.param].1, part.range.len());
            let at = rank * self.plan.shard_len(part.bucket) + part.offset;
            s.gather[part.bucket].narrow(0, at, n)?.set(&t.reshape(t.elem_count())?.narrow(
                0,
                part.range.start,
                n,
            )?)?;
        }
        let whole = |p: usize| {
            let n = self.params[p].1.elem_count();
            s.parts.iter().any(|q| q.param == p && q.range.len() == n)
        };
        gather_into_params(&self.comm, &self.plan, &self.params, &s.gather, whole)
    }

    /// Whole per-parameter tensors, on the host, from every rank's parts: `parts[i]` holds this
    /// rank's elements of `shard_parts()[i]` (AdamW moments, for a checkpoint). A collective:
    /// every rank calls it. One bucket's buffer at a time lives on the device.
    pub fn gather_parts(&self, parts: &[Tensor]) -> DistResult<Vec<Tensor>> {
        let mine = self.shard_parts();
        if parts.len() != mine.len() {
            return Err(invalid(format!("gather_parts: {} tensors for {} shard parts", parts.len(), mine.len())));
        }
        let _g = no_grad();
        let (rank, device) = (self.comm.rank(), self.comm.device());
        let mut out: Vec<Option<Tensor>> = vec![None; self.params.len()];
        for (b, bucket) in self.plan.buckets.iter().enumerate() {
            let f = Tensor::zeros(bucket.len, DType::F32, device)?;
            let sl = self.plan.shard_len(b);
            for (part, t) in mine.iter().zip(parts).filter(|(q, _)| q.bucket == b) {
                let n = part.range.len();
                f.narrow(0, rank * sl + part.offset, n)?.set(&t.to_dtype(DType::F32)?.reshape(n)?)?;
            }
            self.comm.all_gather(&f)?.wait()?;
            for &p in &bucket.params {
                let (s, t) = (&self.plan.slots[p], &self.params[p].1);
                out[p] = Some(f.narrow(0, s.offset, s.numel)?.reshape(t.dims())?.to_device(Device::Cpu)?);
            }
        }
        out.into_iter()
            .enumerate()
            .map(|(p, t)| t.ok_or_else(|| invalid(format!("gather_parts: parameter {p} is in no bucket"))))
            .collect()
    }
}
