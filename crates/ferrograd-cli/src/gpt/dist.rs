//! `gpt train` under `ferrograd launch` (or torchrun, or srun): the data-parallel hooks of
//! `ferrograd_models::gpt::dp` built from a communicator. Gradients are averaged by
//! `ferrograd_dist::DataParallel::grad_sync` (buckets all-reduced on the communication stream
//! while backward runs, f32 or bf16 on the wire) inside GPT's step body; GPT's own two-group
//! AdamW then steps on them. With `--zero 1` (`DataParallel::shard_sync`) the buckets are
//! reduce-scattered instead, GPT's AdamW steps on this rank's shard (`ferrograd-models`
//! `gpt/zero.rs`) and `end_step` all-gathers the parameters.

use ferrograd_core::{DType, GradStore, Result, Tensor};
use ferrograd_dist::{Communicator, DataParallel, DpConfig, ReduceOp};
use ferrograd_models::gpt::dp::{GptDist, GradSync, ShardPart};
use ferrograd_nn::optim::Optimizer;
use std::sync::Arc;

/// `DataParallel` in gradient-averaging mode as the step body drives it.
struct Averager(DataParallel);

impl GradSync for Averager {
    fn backward_seeded(&mut self, root: Tensor, seed: &Tensor, grads: &mut GradStore, last: bool) -> Result<()> {
        self.0.backward_seeded(root, seed, grads, last)
    }

    fn reduce_grads(&mut self, grads: &mut GradStore) -> Result<()> {
        self.0.reduce_grads(grads)
    }

    fn end_step(&mut self, grads: &GradStore) -> Result<()> {
        // Updates nothing (GPT's AdamW did): ends the step, so the next may communicate again.
        self.0.step(grads)
    }

    fn graph_capturable(&self) -> std::result::Result<(), String> {
        self.0.comm().graph_capturable()
    }

    fn shard(&self) -> Option<Vec<ShardPart>> {
        (self.0.config().zero == 1).then(|| {
            let parts = self.0.shard_parts().iter();
            parts
                .map(|q| ShardPart { param: q.param, range: q.range.clone(), buffer: q.bucket, offset: q.offset })
                .collect()
        })
    }

    fn shard_grads(&self) -> Result<Vec<Tensor>> {
        Ok(self.0.shard_grads()?)
    }

    fn sum_over_ranks(&self, t: &Tensor) -> Result<()> {
        // Compute waits on the device: the sum can sit inside a captured step.
        Ok(self.0.comm().all_reduce(t, ReduceOp::Sum)?.wait()?)
    }

    fn gather_parts(&self, parts: &[Tensor]) -> Result<Vec<Tensor>> {
        Ok(self.0.gather_parts(parts)?)
    }
}

/// The hooks over `comm`, averaging gradients as `dp` says: all-reduced (`zero: 0`) or
/// reduce-scattered to GPT's AdamW on each rank's shard (`zero: 1`, ZeRO-1).
pub fn hooks(comm: Arc<dyn Communicator>, dp: DpConfig) -> GptDist {
    let describe = format!(
        "{}, {} gradients in {:.0} MiB buckets{}",
        comm.backend(),
        dp.comm_dtype,
        dp.bucket_bytes as f64 / (1 << 20) as f64,
        if dp.zero == 1 { ", ZeRO-1 (reduce-scatter, AdamW on each rank's shard, all-gather)" } else { "" }
    );
    let (c1, c2, c3, c4) = (comm.clone(), comm.clone(), comm.clone(), comm.clone());
    GptDist {
        rank: comm.rank(),
        world: comm.world_size(),
        grad_sync: Arc::new(move |params| {
            let d = match dp.zero {
                0 => DataParallel::grad_sync(c1.clone(), params, dp.clone())?,
                _ => DataParallel::shard_sync(c1.clone(), params, dp.clone())?,
            };
            Ok(Box::new(Averager(d)) as Box<dyn GradSync>)
        }),
        all_reduce_mean: Arc::new(move |t| Ok(c2.all_reduce(t, ReduceOp::Avg)?.wait()?)),
        min: Arc::new(move |v| {
            let t = Tensor::full(v as f64, 1, DType::F64, c3.device())?;
            c3.all_reduce(&t, ReduceOp::Min)?.wait()?;
            Ok(t.item_f64()? as usize)
        }),
        barrier: Arc::new(move || Ok(c4.barrier()?)),
        describe,
    }
}
