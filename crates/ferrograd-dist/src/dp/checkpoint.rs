//! Checkpoints of data-parallel runs: rank 0 writes (atomically, ferrograd-nn's checkpoint
//! format), every rank reads. The file is the one a single-process run with the same optimizer
//! writes: ZeRO-1 gathers its moment shards into whole per-parameter tensors (`<name>.m`,
//! `<name>.v`) first, and cuts its own shard out of them on load. So a run saved on N GPUs
//! resumes on M (or on one, with plain AdamW), as long as the global batch stays the same.
//!
//! Every rank must call both functions (they communicate) and must be able to read the file
//! rank 0 wrote (a shared filesystem across nodes).

use super::zero::{flat_params, shards_of};
use super::{DataParallel, Mode};
use crate::comm::Work;
use crate::error::DistResult;
use ferrograd_core::{no_grad, DType, Result, Tensor};
use ferrograd_nn::checkpoint::{self, TrainState};
use ferrograd_nn::Module;
use std::path::Path;

impl DataParallel {
    /// Write `model`, this optimizer's state and `state` to `path` from rank 0; every rank returns
    /// once the file is complete.
    pub fn save_checkpoint(
        &mut self,
        path: impl AsRef<Path>,
        model: &dyn Module,
        state: &TrainState,
    ) -> DistResult<()> {
        self.gather_zero_state()?;
        let written = if self.comm.rank() == 0 {
            checkpoint::save(path.as_ref(), model, Some(&*self), state).map_err(Into::into)
        } else {
            Ok(())
        };
        if let Mode::Zero(z) = &mut self.mode {
            z.staging = None;
        }
        // Everyone waits for the file, also when rank 0 failed to write it (then all report it:
        // rank 0 its error, the others find no new file when they next read it).
        self.comm.barrier()?;
        written
    }

    /// Restore `model` (its parameters are this optimizer's), the optimizer state and the
    /// training state from `path`, whatever world size wrote it.
    pub fn load_checkpoint(&mut self, path: impl AsRef<Path>, model: &dyn Module) -> DistResult<TrainState> {
        if let Mode::Zero(z) = &mut self.mode {
            let _g = no_grad();
            let mut staging = Vec::with_capacity(2 * self.params.len());
            for (name, p) in &self.params {
                staging.push((format!("{name}.m"), p.zeros_like()?));
                staging.push((format!("{name}.v"), p.zeros_like()?));
            }
            z.staging = Some(staging);
        }
        let loaded = checkpoint::load(path.as_ref(), model, Some(&mut *self));
        let (device, rank) = (self.comm.device(), self.comm.rank());
        if let Mode::Zero(z) = &mut self.mode {
            let staging = z.staging.take();
            let state = loaded?;
            let _g = no_grad();
            let staging = staging.unwrap_or_default();
            // Built above as (<name>.m, <name>.v) per parameter, in parameter order.
            let (m, v): (Vec<_>, Vec<_>) = staging.chunks(2).map(|c| (c[0].clone(), c[1].clone())).unzip();
            z.m = shards_of(&self.plan, &flat_params(&self.plan, &m, device)?, rank)?;
            z.v = shards_of(&self.plan, &flat_params(&self.plan, &v, device)?, rank)?;
            z.refresh_master(&self.plan, &self.params, device, rank)?;
            return Ok(state);
        }
        Ok(loaded?)
    }

    /// ZeRO-1: all-gather the moment shards into whole per-parameter tensors for the writer.
    fn gather_zero_state(&mut self) -> DistResult<()> {
        let Mode::Zero(z) = &mut self.mode else { return Ok(()) };
        let _g = no_grad();
        let (comm, plan) = (&self.comm, &self.plan);
        let rank = comm.rank();
        let gather = |shards: &[Tensor]| -> DistResult<Vec<Tensor>> {
            let mut full = vec![];
            let mut works: Vec<Work> = vec![];
            for (b, s) in shards.iter().enumerate() {
                let sl = plan.shard_len(b);
                let f = Tensor::zeros(plan.buckets[b].len, DType::F32, comm.device())?;
                f.narrow(0, rank * sl, sl)?.set(s)?;
                works.push(comm.all_gather(&f)?);
                full.push(f);
            }
            for w in works {
                w.wait()?;
            }
            Ok(full)
        };
        let (fm, fv) = (gather(&z.m)?, gather(&z.v)?);
        let view = |full: &[Tensor], p: usize, t: &Tensor| -> Result<Tensor> {
            let s = &plan.slots[p];
            full[s.bucket].narrow(0, s.offset, s.numel)?.reshape(t.dims())
        };
        let mut staging = Vec::with_capacity(2 * self.params.len());
        for (p, (name, t)) in self.params.iter().enumerate() {
            staging.push((format!("{name}.m"), view(&fm, p, t)?));
            staging.push((format!("{name}.v"), view(&fv, p, t)?));
        }
        z.staging = Some(staging);
        Ok(())
    }
}
