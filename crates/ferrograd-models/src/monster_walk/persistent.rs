//! Monster Walk on the persistent kernel (`crate::persistent`): the autoencoder as an MLP spec,
//! the whole run (epochs x batches steps, one copy per step, in order: the fused step's
//! semantics) in one launch, and the epoch progress from the loss ring while it runs.

use super::model::{Autoencoder, LAYERS};
use crate::persistent::trainer::{layout_for, specialized};
use crate::persistent::{MlpSpec, PersistentMlp, PhaseProfile, Precision};
use ferrograd_core::cuda::modules::Module;
use ferrograd_core::optim::AdamConfig;
use ferrograd_core::{Device, Result, Tensor};

/// 71-47-23-11-5-11-23-47-71, ReLU after every layer but the last.
pub fn spec() -> Result<MlpSpec> {
    let mut widths = vec![LAYERS[0].0];
    widths.extend(LAYERS.iter().map(|&(_, out)| out));
    let relu = (0..LAYERS.len()).map(|l| l + 1 < LAYERS.len()).collect();
    MlpSpec::new(widths, relu)
}

/// SMs of the GPU `ferrograd kernels --precompile` prepares Monster Walk's persistent kernel for:
/// the H100 (SXM) and the H200. The kernel is specialized to its layout, which depends on the
/// SM count; on another GPU the first run compiles its own (once: the disk cache keeps it).
pub const PRECOMPILE_SMS: usize = 132;

/// The persistent kernel's modules (each precision) for Monster Walk's default batch (one copy,
/// 5,041 rows) on a GPU of `sms` SMs.
pub fn modules_for(sms: usize) -> Result<Vec<&'static Module>> {
    let layout = layout_for(&spec()?, sms, super::walk::SAMPLES);
    Ok([Precision::F32, Precision::Tf32, Precision::Bf16].into_iter().map(|p| specialized(p, &layout)).collect())
}

/// The run, as the report needs it.
#[derive(Clone, Debug)]
pub struct Outcome {
    pub training_time_s: f64,
    pub steps: usize,
    pub first_loss: f64,
    pub final_loss: f64,
    pub phases: PhaseProfile,
}

pub struct MonsterPersistent {
    inner: PersistentMlp,
}

impl MonsterPersistent {
    /// Upload `model` for batches of at most `batch_rows` rows; `Ok(Err(reason))` where the
    /// persistent kernel cannot run here (the caller falls back to the fused step).
    pub fn new(
        model: &Autoencoder,
        device: Device,
        batch_rows: usize,
        precision: Precision,
    ) -> Result<std::result::Result<MonsterPersistent, String>> {
        let spec = spec()?;
        if let Some(why) = PersistentMlp::unavailable(&spec, device, batch_rows, precision)? {
            return Ok(Err(why));
        }
        let inner = PersistentMlp::new(spec, &model.weight_pairs()?, device, batch_rows, precision)?;
        Ok(Ok(MonsterPersistent { inner }))
    }

    /// `epochs` passes over `batches` in one launch; `on_epoch(epoch, loss, seconds)` after each
    /// epoch's last step, while the kernel runs. The trained weights go back into `model`.
    pub fn train(
        &mut self,
        model: &Autoencoder,
        batches: &[Tensor],
        epochs: usize,
        adam: &AdamConfig,
        mut on_epoch: impl FnMut(usize, f64, f64),
    ) -> Result<Outcome> {
        let pairs: Vec<(Tensor, Option<Tensor>)> = batches.iter().map(|x| (x.clone(), None)).collect();
        let nb = batches.len();
        let steps = epochs * nb;
        let start = std::time::Instant::now();
        let run = self.inner.train(&pairs, steps, adam, nb, |s, loss| {
            on_epoch((s + 1) / nb.max(1), loss as f64, start.elapsed().as_secs_f64())
        })?;
        self.inner.write_into(&model.weight_pairs()?)?;
        Ok(Outcome {
            training_time_s: run.seconds,
            steps,
            first_loss: run.losses.first().copied().unwrap_or(f32::NAN) as f64,
            final_loss: run.losses.last().copied().unwrap_or(f32::NAN) as f64,
            phases: run.phases,
        })
    }

    pub fn precision(&self) -> Precision {
        self.inner.precision()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_spec_is_the_autoencoder() -> Result<()> {
        let s = spec()?;
        assert_eq!(s.widths(), [71, 47, 23, 11, 5, 11, 23, 47, 71]);
        assert_eq!(s.parameter_count(), 9_690);
        assert_eq!(s.relu().iter().filter(|&&r| r).count(), 7);
        assert!(!s.relu()[7]);
        Ok(())
    }
}
