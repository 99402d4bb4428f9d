//! Dynamic loss scaling for f16 training (PyTorch's `GradScaler`). f16 gradients underflow below
//! 6e-8, so the loss is multiplied by a large power of two before backward and the gradients are
//! divided by it before the optimizer step. When a gradient overflows to inf/nan the step is
//! skipped and the scale halves; after `growth_interval` clean steps in a row it doubles. Scales
//! are powers of two, so scaling and unscaling are exact.
//!
//! Finding an overflow costs one host read per step: `sum(g * 0)` over all gradients is 0 when
//! every element is finite and NaN otherwise (inf * 0 = NaN), reduced on the device to one scalar.

use crate::optim::Optimizer;
use ferrograd_core::{no_grad, DType, Error, GradStore, Result, Tensor};
use serde::{Deserialize, Serialize};

/// [`GradScaler`]'s settings, PyTorch's defaults (`init_scale` 65536, growth 2, backoff 0.5,
/// interval 2000).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GradScalerConfig {
    /// The first scale (a power of two keeps scaling exact).
    pub init_scale: f64,
    /// Multiplies the scale after `growth_interval` clean steps (> 1).
    pub growth_factor: f64,
    /// Multiplies the scale after an overflow (in `(0, 1)`).
    pub backoff_factor: f64,
    /// Clean steps in a row before the scale grows.
    pub growth_interval: u64,
    /// A disabled scaler passes losses and steps through unchanged (bf16 needs no scaling).
    pub enabled: bool,
}

impl Default for GradScalerConfig {
    fn default() -> Self {
        GradScalerConfig {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            enabled: true,
        }
    }
}

/// What a checkpoint needs to resume the scaler.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct GradScalerState {
    /// The current scale.
    pub scale: f64,
    /// Clean steps since the last change of scale.
    pub growth_tracker: u64,
    /// Steps skipped so far because of inf/nan gradients.
    pub skipped: u64,
}

/// Dynamic loss scaling for f16 training (`torch.amp.GradScaler`); see the module documentation.
/// ```
/// use ferrograd_core::{DType, Device, Tensor};
/// use ferrograd_nn::amp::{GradScaler, GradScalerConfig};
/// use ferrograd_nn::optim::{Optimizer, Sgd};
/// let w = Tensor::ones(3, DType::F32, Device::Cpu)?.requires_grad();
/// let mut opt = Sgd::new(vec![("w".into(), w.clone())], Default::default())?;
/// let mut scaler = GradScaler::new(GradScalerConfig::default())?;
/// let loss = w.sqr()?.sum_all()?;
/// let mut grads = scaler.scale_loss(&loss)?.backward()?; // gradients are scaled by 65536
/// assert!(scaler.step(&mut opt, &mut grads)?); // unscaled, finite: the optimizer stepped
/// # Ok::<(), ferrograd_core::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct GradScaler {
    /// Its settings.
    pub config: GradScalerConfig,
    state: GradScalerState,
    /// `Some(found_inf)` once this step's gradients have been unscaled.
    unscaled: Option<bool>,
}

impl GradScaler {
    /// A scaler; [`ferrograd_core::Error::InvalidArgument`] for a non-positive or non-finite initial
    /// scale, a growth factor not above 1, a backoff outside `(0, 1)` or a zero interval.
    pub fn new(config: GradScalerConfig) -> Result<Self> {
        let ok = config.init_scale > 0.0
            && config.init_scale.is_finite()
            && config.growth_factor > 1.0
            && config.backoff_factor > 0.0
            && config.backoff_factor < 1.0
            && config.growth_interval > 0;
        if !ok {
            return Err(Error::InvalidArgument(format!("GradScaler: bad config {config:?}")));
        }
        let state = GradScalerState { scale: config.init_scale, growth_tracker: 0, skipped: 0 };
        Ok(GradScaler { config, state, unscaled: None })
    }

    /// The current scale (1 when disabled).
    pub fn scale(&self) -> f64 {
        if self.config.enabled {
            self.state.scale
        } else {
            1.0
        }
    }

    /// What a checkpoint saves (`scaler.state_dict()`).
    pub fn state(&self) -> GradScalerState {
        self.state
    }

    /// Restore a saved state (`scaler.load_state_dict()`); errors on a non-positive or non-finite scale.
    pub fn load_state(&mut self, state: GradScalerState) -> Result<()> {
        if !(state.scale > 0.0 && state.scale.is_finite()) {
            return Err(Error::InvalidArgument(format!("GradScaler: bad saved scale {}", state.scale)));
        }
        self.state = state;
        self.unscaled = None;
        Ok(())
    }

    /// `loss * scale`: call backward on this.
    pub fn scale_loss(&self, loss: &Tensor) -> Result<Tensor> {
        if !self.config.enabled {
            return Ok(loss.clone());
        }
        loss.mul_scalar(self.state.scale)
    }

    /// Divide the gradients of `params` by the scale (do this before clipping) and report whether
    /// any of them holds an inf or nan. At most once per step; later calls return the first answer.
    pub fn unscale(&mut self, grads: &mut GradStore, params: &[Tensor]) -> Result<bool> {
        if let Some(found) = self.unscaled {
            return Ok(found);
        }
        let found = if self.config.enabled { unscale_and_check(grads, params, 1.0 / self.state.scale)? } else { false };
        self.unscaled = Some(found);
        Ok(found)
    }

    /// Unscale (unless done already), step the optimizer when every gradient is finite, and
    /// update the scale. Returns whether the optimizer stepped.
    pub fn step(&mut self, opt: &mut dyn Optimizer, grads: &mut GradStore) -> Result<bool> {
        let params: Vec<Tensor> = opt.params().iter().map(|(_, p)| p.clone()).collect();
        let found_inf = self.unscale(grads, &params)?;
        if !found_inf {
            opt.step(grads)?;
        }
        self.update(found_inf);
        Ok(!found_inf)
    }

    /// Back off after an overflow, grow after `growth_interval` clean steps.
    pub fn update(&mut self, found_inf: bool) {
        self.unscaled = None;
        if !self.config.enabled {
            return;
        }
        let s = &mut self.state;
        if found_inf {
            s.scale *= self.config.backoff_factor;
            s.growth_tracker = 0;
            s.skipped += 1;
        } else {
            s.growth_tracker += 1;
            if s.growth_tracker >= self.config.growth_interval {
                let grown = s.scale * self.config.growth_factor;
                // Never grow into inf: that would poison every later loss.
                if grown.is_finite() && grown <= f32::MAX as f64 {
                    s.scale = grown;
                }
                s.growth_tracker = 0;
            }
        }
    }
}

/// Multiply each gradient by `inv_scale` in place (in the store) and return whether any element
/// is not finite, with one host read.
fn unscale_and_check(grads: &mut GradStore, params: &[Tensor], inv_scale: f64) -> Result<bool> {
    let _g = no_grad();
    let mut probes = Vec::new();
    for p in params {
        let Some(g) = grads.get(p) else { continue };
        let g = g.mul_scalar(inv_scale)?;
        probes.push(g.mul_scalar(0.0)?.to_dtype(DType::F32)?.sum_all()?);
        grads.insert(p, g);
    }
    if probes.is_empty() {
        return Ok(false);
    }
    let probe = Tensor::stack(&probes, 0)?.sum_all()?.item_f64()?;
    Ok(!probe.is_finite())
}
