//! Gradient accumulation over micro-batches: several backward passes add into one store, the
//! optimizer steps on the sum, and `zero_grad` empties the store for the next step. The store
//! keeps its table capacity and the optimizer its parameter list, so resetting allocates nothing.

use super::Optimizer;
use ferrograd_core::{GradStore, Result, Tensor};

/// Gradient accumulation over micro-batches (see the module documentation).
#[derive(Debug, Default)]
pub struct GradAccumulator {
    store: GradStore,
    micro_steps: usize,
}

impl GradAccumulator {
    /// An empty accumulator.
    pub fn new() -> Self {
        Self::default()
    }

    /// Add the gradients of `loss` to the running sums.
    pub fn backward(&mut self, loss: &Tensor) -> Result<()> {
        loss.backward_into(&mut self.store)?;
        self.micro_steps += 1;
        Ok(())
    }

    /// Add the gradients of `scale * loss` (for `k` micro-batches, `1/k` turns the sum into the
    /// gradient of the mean loss over the full batch).
    pub fn backward_scaled(&mut self, loss: &Tensor, scale: f64) -> Result<()> {
        if scale == 1.0 {
            return self.backward(loss);
        }
        self.backward(&loss.mul_scalar(scale)?)
    }

    /// Add the gradients that `grad`, the gradient of the loss with respect to `root` (a fused
    /// classifier's logits gradient, the loss's scale already in it), induces. Takes `root`:
    /// handed the last handle on the graph, the walk frees each op's saved tensors as it passes
    /// (`Tensor::backward_consume`).
    pub fn backward_seeded(&mut self, root: Tensor, grad: &Tensor) -> Result<()> {
        root.backward_consume(grad, &mut self.store, None)?;
        self.micro_steps += 1;
        Ok(())
    }

    /// Like `backward`, through `opt` (which may start communicating gradients on the last
    /// micro-batch: see `Optimizer::backward`).
    pub fn backward_with(&mut self, opt: &mut dyn Optimizer, loss: &Tensor, last_micro_step: bool) -> Result<()> {
        opt.backward(loss, &mut self.store, last_micro_step)?;
        self.micro_steps += 1;
        Ok(())
    }

    /// The summed gradients.
    pub fn grads(&self) -> &GradStore {
        &self.store
    }

    /// The summed gradients, writable (to unscale or clip them before the step).
    pub fn grads_mut(&mut self) -> &mut GradStore {
        &mut self.store
    }

    /// Backward passes since the last `zero_grad`.
    pub fn micro_steps(&self) -> usize {
        self.micro_steps
    }

    /// Drop the accumulated gradients (PyTorch's `zero_grad(set_to_none=True)`).
    pub fn zero_grad(&mut self) {
        self.store.clear();
        self.micro_steps = 0;
    }
}
