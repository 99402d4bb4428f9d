//! Learning-rate schedules as pure functions of the step index (counting from 0 for the first
//! optimizer step), so resuming from a checkpoint needs only the step.

use super::Optimizer;
use serde::{Deserialize, Serialize};

/// A learning rate per step (PyTorch's `LambdaLR` with the usual warm-up shapes).
///
/// ```
/// use ferrograd_nn::optim::LrSchedule;
/// let s = LrSchedule::WarmupCosine { peak: 6e-4, warmup: 10, total: 100, min: 6e-5 };
/// assert!((s.lr_at(0) - 6e-5).abs() < 1e-12); // (0 + 1) / 10 of the peak
/// assert!((s.lr_at(9) - 6e-4).abs() < 1e-12);
/// assert!((s.lr_at(100) - 6e-5).abs() < 1e-12);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum LrSchedule {
    /// The same rate at every step.
    Constant {
        /// The rate.
        lr: f64,
    },
    /// `peak * (step + 1) / warmup` during warmup, then linear from `peak` (at `warmup`) to `end`
    /// (at `total`), then `end`.
    WarmupLinear {
        /// Rate at the end of warm-up.
        peak: f64,
        /// Warm-up steps.
        warmup: u64,
        /// Step at which the decay ends.
        total: u64,
        /// Final rate.
        end: f64,
    },
    /// The same warmup, then half a cosine from `peak` down to `min` at `total`, then `min`.
    WarmupCosine {
        /// Rate at the end of warm-up.
        peak: f64,
        /// Warm-up steps.
        warmup: u64,
        /// Step at which the decay ends.
        total: u64,
        /// Final rate.
        min: f64,
    },
}

impl LrSchedule {
    /// The rate of optimizer step `step` (0 for the first step).
    pub fn lr_at(&self, step: u64) -> f64 {
        let warm = |peak: f64, warmup: u64| (step < warmup).then(|| peak * (step + 1) as f64 / warmup as f64);
        let progress = |warmup: u64, total: u64| {
            if total <= warmup {
                1.0
            } else {
                ((step.saturating_sub(warmup)) as f64 / (total - warmup) as f64).clamp(0.0, 1.0)
            }
        };
        match *self {
            LrSchedule::Constant { lr } => lr,
            LrSchedule::WarmupLinear { peak, warmup, total, end } => {
                warm(peak, warmup).unwrap_or_else(|| peak + (end - peak) * progress(warmup, total))
            }
            LrSchedule::WarmupCosine { peak, warmup, total, min } => warm(peak, warmup).unwrap_or_else(|| {
                min + 0.5 * (peak - min) * (1.0 + (std::f64::consts::PI * progress(warmup, total)).cos())
            }),
        }
    }

    /// Set the optimizer's learning rate for step `step`.
    pub fn apply(&self, opt: &mut dyn Optimizer, step: u64) {
        opt.set_lr(self.lr_at(step));
    }
}
