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
//! - **ZeRO-1** (`--zero 1`, [`GradSync::shard`]): the buckets are reduce-scattered instead, each
//!   rank clips and steps GPT's AdamW on its shard of the flattened parameters only (moments for
//!   1/N of the elements, `zero.rs`), and the updated parameters are all-gathered; checkpoints
//!   gather the moments into a plain GPT AdamW file.
//! - **Files**: rank 0 alone writes the checkpoint (atomically; the others wait at a barrier),
//!   the log, the exported model and the plot. A checkpoint records the global number of
//!   micro-batches per step, so it resumes on any number of GPUs that divides it.
//! - **Numbers**: the logged loss is the mean over the ranks; tokens/s counts the whole group.

use ferrograd_core::{Error, GradStore, Result, Tensor};
use std::ops::Range;
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
/// ZeRO-1 (where [`GradSync::shard`] is `Some`): step 1 reduce-scatters, so after step 2 `grads`
/// is not averaged; the step clips [`GradSync::shard_grads`] instead (its squared norm summed over
/// the ranks by [`GradSync::sum_over_ranks`]), AdamW updates the parameter elements of the shard,
/// and `end_step` all-gathers the parameters.
///
/// Nothing here reads a value back to the host, so a step of these calls can be captured where
/// `graph_capturable` says the communicator allows it.
pub trait GradSync {
    /// Takes `root`, the step's last handle on the graph, so the walk frees it as it goes.
    fn backward_seeded(&mut self, root: Tensor, seed: &Tensor, grads: &mut GradStore, last: bool) -> Result<()>;
    fn reduce_grads(&mut self, grads: &mut GradStore) -> Result<()>;
    /// Ends the step (ZeRO-1: all-gathers the parameters each rank updated).
    fn end_step(&mut self, grads: &GradStore) -> Result<()>;
    /// `Ok` where the collectives can be recorded into a CUDA graph, else why not.
    fn graph_capturable(&self) -> std::result::Result<(), String>;

    /// ZeRO-1: the parameter elements this rank updates (and keeps AdamW's moments for), in
    /// parameter order; `None` where every rank receives the whole averaged gradient.
    fn shard(&self) -> Option<Vec<ShardPart>> {
        None
    }
    /// ZeRO-1, between `reduce_grads` and `end_step`: this rank's shard of the averaged gradient,
    /// one f32 tensor per [`ShardPart::buffer`] (elements outside every part are zero).
    fn shard_grads(&self) -> Result<Vec<Tensor>> {
        Err(Error::InvalidArgument("shard_grads: gradients are not sharded (no --zero 1)".into()))
    }
    /// Sum a one-element contiguous f32 device tensor over the ranks, in place; compute waits on
    /// the device only (it runs inside a captured step).
    fn sum_over_ranks(&self, _t: &Tensor) -> Result<()> {
        Err(Error::InvalidArgument("sum_over_ranks: not offered by this gradient averager".into()))
    }
    /// ZeRO-1: whole per-parameter tensors (on the host) from every rank's parts, `parts[i]` this
    /// rank's elements of `shard()[i]` (AdamW's moments, for a checkpoint). Every rank calls it.
    fn gather_parts(&self, _parts: &[Tensor]) -> Result<Vec<Tensor>> {
        Err(Error::InvalidArgument("gather_parts: gradients are not sharded (no --zero 1)".into()))
    }
}

/// ZeRO-1: elements `range` of parameter `param` (flattened) belong to this rank's shard; their
/// averaged gradient is elements `offset..offset + range.len()` of `shard_grads()[buffer]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardPart {
    pub param: usize,
    pub range: Range<usize>,
    pub buffer: usize,
    pub offset: usize,
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
