//! `gpt train` data parallel (under `ferrograd launch`, torchrun or srun): what the run needs
//! from the process group, as hooks. `ferrograd-dist` provides them (the CLI wires them, see
//! `ferrograd-cli/src/gpt/dist.rs`), so this crate stays free of NCCL.
//!
//! How a data-parallel run differs from a single-GPU one with the same `--total-batch`:
//!
//! - **Data**: the loader walks the single-GPU order of micro-batches; rank `r` of `N` takes
//!   micro-batches `r, r + N, r + 2N, ...` of it (`TokenLoader::set_stride`). So the ranks read
//!   disjoint batches, one optimizer step of N GPUs reads exactly the micro-batches one GPU would,
//!   and the loader position (which checkpoints record) is the same on every rank.
//! - **Gradients**: each rank accumulates its `k / N` micro-batches locally; on the last one the
//!   gradients are averaged over the ranks in buckets while backward runs ([`GradSync`], built
//!   on `ferrograd_dist::DataParallel`), then every rank clips and steps identically. All of it
//!   happens inside the one-GPU step body (`train.rs`), so N GPUs compute exactly what one does
//!   (fused classifier, device-scheduled AdamW) and the step, collectives included, is captured
//!   as one CUDA graph where NCCL allows it.
//! - **Files**: rank 0 alone writes the checkpoint (atomically; the others wait at a barrier),
//!   the log, the exported model and the plot. A checkpoint records the global number of
//!   micro-batches per step, so it resumes on any number of GPUs that divides it.
//! - **Numbers**: the logged loss is the mean over the ranks; tokens/s counts the whole group.

use ferrograd_core::{GradStore, Result, Tensor};
use std::sync::Arc;

/// An in-place operation on a device tensor across the ranks.
pub type TensorHook = Arc<dyn Fn(&Tensor) -> Result<()> + Send + Sync>;

/// Gradient averaging as the step body (`train.rs`, `StepBody`) drives it, the same calls for
/// an eager step and for one recorded into a CUDA graph:
///
/// 1. `backward_seeded` for each micro-batch: a plain seeded backward, except on the last
///    (`last`), where each bucket is all-reduced (averaged) on the communication stream as soon as
///    its gradients are final, overlapping the rest of the walk;
/// 2. `reduce_grads`: compute waits (on the device) for every bucket, `grads` holds the averages;
/// 3. the step's own clipping and AdamW on them, then `end_step`.
///
/// Nothing here reads a value back to the host, so a step of these calls can be captured where
/// `graph_capturable` says the communicator allows it.
pub trait GradSync {
    fn backward_seeded(&mut self, root: &Tensor, seed: &Tensor, grads: &mut GradStore, last: bool) -> Result<()>;
    fn reduce_grads(&mut self, grads: &mut GradStore) -> Result<()>;
    fn end_step(&mut self, grads: &GradStore) -> Result<()>;
    /// `Ok` where the collectives can be recorded into a CUDA graph, else why not.
    fn graph_capturable(&self) -> std::result::Result<(), String>;
}

/// Builds the gradient averager over the model's parameters (broadcasting them from rank 0).
pub type GradSyncFactory = Arc<dyn Fn(Vec<(String, Tensor)>) -> Result<Box<dyn GradSync>> + Send + Sync>;

/// What a data-parallel `gpt train` needs from the process group.
#[derive(Clone)]
pub struct GptDist {
    pub rank: usize,
    pub world: usize,
    pub grad_sync: GradSyncFactory,
    /// Average a contiguous f32 device tensor over the ranks in place.
    pub all_reduce_mean: TensorHook,
    /// The smallest of a number over the ranks (`--batch auto` must agree).
    pub min: Arc<dyn Fn(usize) -> Result<usize> + Send + Sync>,
    /// Every rank reaches this point before any goes on (after rank 0 writes a checkpoint).
    pub barrier: Arc<dyn Fn() -> Result<()> + Send + Sync>,
    /// How the gradients travel, for the run's notes ("nccl, bf16 gradients, 25 MiB buckets").
    pub describe: String,
}

impl std::fmt::Debug for GptDist {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GptDist(rank {} of {}, {})", self.rank, self.world, self.describe)
    }
}

impl GptDist {
    pub fn is_main(&self) -> bool {
        self.rank == 0
    }
}

/// Rank and world of an optional group (a single process: 0 of 1).
pub(crate) fn rank_world(d: Option<&GptDist>) -> (usize, usize) {
    d.map_or((0, 1), |d| (d.rank, d.world))
}

/// Whether this process writes files (rank 0, or no group).
pub(crate) fn writes_files(d: Option<&GptDist>) -> bool {
    d.is_none_or(GptDist::is_main)
}

/// The loss window's mean over the ranks (the same number on every rank).
pub(crate) fn mean_over_ranks(d: Option<&GptDist>, t: Tensor) -> Result<Tensor> {
    let Some(d) = d else { return Ok(t) };
    let t = t.to_dtype(ferrograd_core::DType::F32)?.contiguous()?;
    // A fresh buffer: the hook writes in place.
    let buf = t.zeros_like()?;
    buf.set(&t)?;
    (d.all_reduce_mean)(&buf)?;
    Ok(buf)
}
