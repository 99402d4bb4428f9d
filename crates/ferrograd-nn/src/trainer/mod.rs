//! A training-loop helper. `Trainer::train_step` runs one optimizer step over `grad_accum`
//! micro-batches (learning-rate schedule, loss scaling, accumulation, clipping, the step itself);
//! `Trainer::fit` feeds it from a `DataLoader` until `max_steps`. Losses stay on the device and
//! are summed there; the host reads the mean only every `log_every` steps, so logging does not
//! stall the GPU queue.

mod log;

pub use log::ProgressMode;

use crate::amp::{GradScaler, GradScalerState};
use crate::checkpoint::TrainState;
use crate::data::{Batch, DataLoader};
use crate::optim::{GradAccumulator, LrSchedule, Optimizer};
use ferrograd_core::{Device, Error, Result, Tensor};
use log::StepLog;
use std::path::PathBuf;

/// What a [`Trainer`] runs (defaults: 1000 steps, log every 10, no accumulation, no clipping,
/// no schedule).
#[derive(Debug, Clone)]
pub struct TrainerConfig {
    /// Optimizer steps [`Trainer::fit`] runs to.
    pub max_steps: u64,
    /// Read the loss to the host (and log) every this many steps.
    pub log_every: u64,
    /// Micro-batches per optimizer step; each micro-batch loss is scaled by `1/grad_accum`.
    pub grad_accum: usize,
    /// Clip the global gradient norm to this before each step.
    pub clip_grad_norm: Option<f64>,
    /// Learning rate per step.
    pub schedule: Option<LrSchedule>,
    /// Progress output on stdout.
    pub progress: ProgressMode,
    /// Append one JSON object per logged step to this file.
    pub json_log: Option<PathBuf>,
}

impl Default for TrainerConfig {
    fn default() -> Self {
        TrainerConfig {
            max_steps: 1000,
            log_every: 10,
            grad_accum: 1,
            clip_grad_norm: None,
            schedule: None,
            progress: ProgressMode::Auto,
            json_log: None,
        }
    }
}

/// What one `train_step` did.
#[derive(Debug, Clone)]
pub struct StepOutcome {
    /// The step number just completed (1 for the first).
    pub step: u64,
    /// Mean micro-batch loss, still on the device.
    pub loss: Tensor,
    /// Global gradient norm before clipping, when clipping is on.
    pub grad_norm: Option<Tensor>,
    /// False when the loss scaler skipped the update (inf/nan gradients).
    pub stepped: bool,
    /// Mean loss over the last logging window, when this step logged.
    pub logged_loss: Option<f64>,
}

/// What `fit` ran.
#[derive(Debug, Clone, Default)]
pub struct FitSummary {
    /// Steps run by this call.
    pub steps: u64,
    /// `(step, mean loss of the window ending there)` for every logged step.
    pub losses: Vec<(u64, f64)>,
    /// Samples consumed.
    pub samples: usize,
    /// Wall time.
    pub seconds: f64,
}

/// A training loop (see the module documentation): owns the optimizer, an optional loss scaler
/// and the step count.
pub struct Trainer<O: Optimizer> {
    /// Its settings.
    pub config: TrainerConfig,
    /// The optimizer.
    pub optimizer: O,
    /// Loss scaling for f16 (`None`: none).
    pub scaler: Option<GradScaler>,
    /// Optimizer steps completed.
    pub step: u64,
    /// Loader position of the next micro-batch (for resuming).
    pub epoch: u64,
    /// Index of the next micro-batch in `epoch`.
    pub next_batch: usize,
    accum: GradAccumulator,
    log: StepLog,
}

impl<O: Optimizer> Trainer<O> {
    /// A trainer at step 0; errors when `grad_accum` or `log_every` is 0.
    pub fn new(optimizer: O, config: TrainerConfig) -> Result<Self> {
        if config.grad_accum == 0 || config.log_every == 0 {
            return Err(Error::InvalidArgument("Trainer: grad_accum and log_every must be positive".into()));
        }
        // Device memory is reported for the device the parameters live on.
        let device = optimizer.params().first().map_or(Device::Cpu, |(_, p)| p.device());
        let log = StepLog::new(&config, device)?;
        Ok(Trainer {
            config,
            optimizer,
            scaler: None,
            step: 0,
            epoch: 0,
            next_batch: 0,
            accum: GradAccumulator::new(),
            log,
        })
    }

    /// Use dynamic loss scaling (f16 training).
    pub fn with_scaler(mut self, scaler: GradScaler) -> Self {
        self.scaler = Some(scaler);
        self
    }

    /// One optimizer step. `micro(i)` runs the forward pass of micro-batch `i` and returns its
    /// (unscaled) loss and its number of samples.
    pub fn train_step(&mut self, mut micro: impl FnMut(usize) -> Result<(Tensor, usize)>) -> Result<StepOutcome> {
        if let Some(s) = &self.config.schedule {
            s.apply(&mut self.optimizer, self.step);
        }
        self.accum.zero_grad();
        let k = self.config.grad_accum;
        let mut loss_sum: Option<Tensor> = None;
        let mut samples = 0;
        for i in 0..k {
            let (loss, n) = micro(i)?;
            samples += n;
            let scaled = loss.mul_scalar(1.0 / k as f64)?;
            let scaled = match &self.scaler {
                Some(s) => s.scale_loss(&scaled)?,
                None => scaled,
            };
            self.accum.backward_with(&mut self.optimizer, &scaled, i + 1 == k)?;
            let l = loss.detach();
            loss_sum = Some(match loss_sum {
                Some(s) => s.add(&l)?,
                None => l,
            });
        }
        let loss = loss_sum.ok_or_else(|| Error::InvalidArgument("train_step: no micro-batches".into()))?;
        let loss = if k > 1 { loss.mul_scalar(1.0 / k as f64)? } else { loss };
        let params: Vec<Tensor> = self.optimizer.params().iter().map(|(_, p)| p.clone()).collect();
        let grads = self.accum.grads_mut();
        // Data parallel: the averaged gradients, before unscaling and clipping look at them.
        self.optimizer.reduce_grads(grads)?;
        if let Some(s) = self.scaler.as_mut() {
            // Clipping must see true gradient magnitudes.
            s.unscale(grads, &params)?;
        }
        let grad_norm = match self.config.clip_grad_norm {
            Some(max) => Some(self.optimizer.clip_grad_norm(grads, max)?),
            None => None,
        };
        let stepped = match self.scaler.as_mut() {
            Some(s) => s.step(&mut self.optimizer, grads)?,
            None => {
                self.optimizer.step(grads)?;
                true
            }
        };
        self.step += 1;
        let logged_loss = self.log.on_step(self.step, &loss, samples, self.optimizer.lr(), &self.config)?;
        Ok(StepOutcome { step: self.step, loss, grad_norm, stepped, logged_loss })
    }

    /// Train until `config.max_steps`, drawing micro-batches from `loader` from the current
    /// position (`epoch`, `next_batch`) on; `loss_fn` maps a batch to its loss.
    pub fn fit(
        &mut self,
        loader: &DataLoader,
        mut loss_fn: impl FnMut(&Batch) -> Result<Tensor>,
    ) -> Result<FitSummary> {
        if loader.is_empty() {
            return Err(Error::InvalidArgument("fit: the loader yields no batches".into()));
        }
        let start = std::time::Instant::now();
        let mut summary = FitSummary::default();
        let (mut epoch, mut next) = (self.epoch, self.next_batch);
        let mut it = loader.epoch_from(epoch, next);
        while self.step < self.config.max_steps {
            let out = self.train_step(|_| {
                let batch = loop {
                    match it.next() {
                        Some(b) => break b?,
                        None => {
                            epoch += 1;
                            it = loader.epoch(epoch);
                        }
                    }
                };
                (epoch, next) = (batch.epoch, batch.index + 1);
                Ok((loss_fn(&batch)?, batch.len()))
            })?;
            (self.epoch, self.next_batch) = (epoch, next);
            summary.samples += self.log.last_samples();
            if let Some(l) = out.logged_loss {
                summary.losses.push((out.step, l));
            }
            summary.steps += 1;
        }
        self.log.finish();
        summary.seconds = start.elapsed().as_secs_f64();
        Ok(summary)
    }

    /// Step, loader position and scaler state, for `checkpoint::save` (add generator states to
    /// `rngs` before saving).
    pub fn state(&self) -> TrainState {
        let mut s = TrainState { step: self.step, ..Default::default() };
        s.extra.insert("epoch".into(), self.epoch.to_string());
        s.extra.insert("next_batch".into(), self.next_batch.to_string());
        if let Some(sc) = &self.scaler {
            s.extra.insert("grad_scaler".into(), serde_json::json!(sc.state()).to_string());
        }
        s
    }

    /// Continue from a state read by `checkpoint::load`.
    pub fn resume(&mut self, state: &TrainState) -> Result<()> {
        let num = |k: &str| -> Result<u64> {
            state
                .extra
                .get(k)
                .map_or(Ok(0), |v| v.parse().map_err(|e| Error::InvalidArgument(format!("train state {k}={v:?}: {e}"))))
        };
        self.step = state.step;
        self.epoch = num("epoch")?;
        self.next_batch = num("next_batch")? as usize;
        if let (Some(sc), Some(js)) = (self.scaler.as_mut(), state.extra.get("grad_scaler")) {
            let st: GradScalerState = serde_json::from_str(js)
                .map_err(|e| Error::InvalidArgument(format!("train state grad_scaler: {e}")))?;
            sc.load_state(st)?;
        }
        Ok(())
    }
}
