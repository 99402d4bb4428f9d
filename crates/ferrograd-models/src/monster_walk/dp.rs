//! Monster Walk data parallel (`ferrograd monster-walk` under `ferrograd launch`): what the run
//! needs from the process group, as hooks (`ferrograd-dist` provides them; this crate stays free
//! of NCCL), and the fused step with the gradients averaged between its two kernels. The
//! persistent kernel is single-GPU (no host point between its steps to all-reduce at), so a
//! data-parallel run takes this step; `train::run` says so in the report's `step_fallback`.

use super::model::Autoencoder;
use super::stepper::Stepper;
use ferrograd_core::{Result, Tensor};
use std::sync::Arc;

/// An in-place operation on a device tensor across the ranks.
pub type TensorHook = Arc<dyn Fn(&Tensor) -> Result<()> + Send + Sync>;

/// The all-reduce (mean) a data-parallel step applies to its flat gradient.
pub(super) type Reduce = TensorHook;

/// What a data-parallel run needs from the process group.
#[derive(Clone)]
pub struct DistHooks {
    pub rank: usize,
    pub world: usize,
    /// Average a flat f32 device tensor over all ranks in place; compute queued later waits for it.
    pub all_reduce_mean: TensorHook,
    /// Overwrite a tensor with rank 0's values.
    pub broadcast: TensorHook,
    /// The smallest of a number over all ranks (every rank must take the same number of steps).
    pub min: Arc<dyn Fn(usize) -> Result<usize> + Send + Sync>,
}

impl std::fmt::Debug for DistHooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DistHooks(rank {} of {})", self.rank, self.world)
    }
}

/// The fused step with the gradients (and the loss) averaged over the ranks between its two
/// kernels: every rank takes the same step and reads the same loss.
pub(super) struct FusedDp {
    pub inner: super::fused::FusedTrainer,
    pub reduce: Reduce,
}

impl Stepper for FusedDp {
    fn step(&mut self, x: &Tensor) -> Result<()> {
        self.inner.step_reduced(x, &*self.reduce)
    }
    fn loss(&self) -> Result<Tensor> {
        Ok(self.inner.loss().clone())
    }
    fn finish(&self, model: &Autoencoder) -> Result<()> {
        self.inner.write_back(model)
    }
    fn state(&self) -> (Vec<Tensor>, u64) {
        self.inner.state()
    }
    fn set_step_count(&mut self, step: u64) {
        self.inner.set_step_count(step)
    }
}
