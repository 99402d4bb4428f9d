//! Optimizers over core's fused multi-tensor steps (`ferrograd_core::optim`): on CUDA a step is
//! one kernel launch per 40 parameters, never a chain of small ops per parameter. Each optimizer
//! owns its parameter handles (leaf variables, updated in place so they keep their identity) and
//! its state tensors, which checkpoints save by name.

mod accumulate;
mod adam;
mod clip;
mod schedule;
mod sgd;

pub use accumulate::GradAccumulator;
pub use adam::{adamw, Adam};
pub use clip::{clip_grad_factor, clip_grad_norm, grad_norm};
pub use ferrograd_core::optim::{AdamConfig, SgdConfig};
pub use schedule::LrSchedule;
pub use sgd::Sgd;

use ferrograd_core::{DType, Error, GradStore, Result, Tensor};

/// An optimizer over named parameters (`torch.optim.Optimizer`): [`Sgd`], [`Adam`] (and AdamW via
/// [`adamw`]), and `ferrograd_dist::DataParallel` wrapping one of them. Gradients come in a
/// [`GradStore`] (`loss.backward()`), not in the parameters.
pub trait Optimizer {
    /// Update every parameter that has a gradient in `grads`; parameters without one are left
    /// alone (PyTorch skips parameters whose `.grad` is None).
    fn step(&mut self, grads: &GradStore) -> Result<()>;

    /// The current learning rate.
    fn lr(&self) -> f64;
    /// Set the learning rate for the next steps (what [`LrSchedule::apply`] calls).
    fn set_lr(&mut self, lr: f64);

    /// The parameters this optimizer updates, with their names.
    fn params(&self) -> &[(String, Tensor)];

    /// Steps taken so far.
    fn step_count(&self) -> u64;

    /// Short name ("sgd", "adam", "adamw"); a checkpoint refuses to load another kind's state.
    fn kind(&self) -> &'static str;

    /// State tensors named `<param>.<slot>` (`0.weight.m`). They are the live buffers: writing
    /// into them with `Tensor::set` restores state.
    fn state_tensors(&self) -> Vec<(String, Tensor)>;

    /// Everything else the optimizer needs to resume (step count, learning rate, flags).
    fn state_meta(&self) -> serde_json::Value;
    /// Restore what [`Optimizer::state_meta`] saved; errors on missing or malformed entries.
    fn load_state_meta(&mut self, meta: &serde_json::Value) -> Result<()>;

    /// The backward pass of one micro-batch, adding into `grads`; `last_micro_step` marks the
    /// last micro-batch before `step`. A data-parallel optimizer (`ferrograd-dist`) overrides it
    /// to start averaging gradients across GPUs during the walk of the last micro-batch only.
    fn backward(&mut self, loss: &Tensor, grads: &mut GradStore, last_micro_step: bool) -> Result<()> {
        let _ = last_micro_step;
        loss.backward_into(grads)
    }

    /// Make `grads` the gradients `step` will apply (data parallel: wait for the average over all
    /// GPUs and put it in the store), so that unscaling and clipping see them. Nothing to do for
    /// a single process.
    fn reduce_grads(&mut self, grads: &mut GradStore) -> Result<()> {
        let _ = grads;
        Ok(())
    }

    /// Clip the gradients `step` will apply to a global L2 norm of `max_norm`; returns the norm
    /// before clipping (a device scalar). A sharded optimizer overrides it to clip its shards.
    fn clip_grad_norm(&mut self, grads: &mut GradStore, max_norm: f64) -> Result<Tensor> {
        let params: Vec<Tensor> = self.params().iter().map(|(_, p)| p.clone()).collect();
        clip_grad_norm(grads, &params, max_norm)
    }
}

/// Indices of the parameters that have a gradient, and those gradients as contiguous f32 (the
/// fused steps need flat buffers; gradients of broadcast parameters can arrive as strided views).
pub(crate) fn gather_grads(params: &[(String, Tensor)], grads: &GradStore) -> Result<(Vec<usize>, Vec<Tensor>)> {
    let mut idx = Vec::new();
    let mut gs = Vec::new();
    for (i, (name, p)) in params.iter().enumerate() {
        let Some(g) = grads.get(p) else { continue };
        if g.dims() != p.dims() {
            return Err(Error::Shape {
                op: "optimizer step",
                msg: format!("gradient of {name} has shape {:?}, parameter {:?}", g.dims(), p.dims()),
            });
        }
        let g = if g.dtype() == DType::F32 { g.contiguous()? } else { g.to_dtype(DType::F32)? };
        idx.push(i);
        gs.push(g);
    }
    Ok((idx, gs))
}

/// Parameters must be f32 (the fused steps' dtype, and the master-weight dtype under autocast).
pub(crate) fn check_params(params: &[(String, Tensor)]) -> Result<()> {
    for (name, p) in params {
        if p.dtype() != DType::F32 {
            return Err(Error::InvalidArgument(format!(
                "parameter {name} is {}: optimizers update f32 parameters",
                p.dtype()
            )));
        }
        if !p.is_contiguous() {
            return Err(Error::InvalidArgument(format!("parameter {name} is not contiguous")));
        }
    }
    Ok(())
}

/// Read a number from optimizer metadata, naming the key when it is missing.
pub(crate) fn meta_f64(meta: &serde_json::Value, key: &str) -> Result<f64> {
    meta.get(key)
        .and_then(|v| v.as_f64())
        .ok_or_else(|| Error::InvalidArgument(format!("optimizer state: missing or bad {key:?}")))
}

pub(crate) fn meta_u64(meta: &serde_json::Value, key: &str) -> Result<u64> {
    meta.get(key)
        .and_then(|v| v.as_u64())
        .ok_or_else(|| Error::InvalidArgument(format!("optimizer state: missing or bad {key:?}")))
}
