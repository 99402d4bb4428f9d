//! A small, exactly reproducible data-parallel training run: an MLP regressing a fixed random
//! dataset with AdamW through ferrograd-nn's `Trainer`, each rank reading its slice of every global
//! batch. The same function runs on threads in CI (`testing::ThreadComm`) and on GPUs under
//! `ferrograd launch` (`ferrograd dist mlp`), and its final parameters are compared across world
//! sizes, ZeRO stages and resumes.

use crate::comm::Communicator;
use crate::dp::{DataParallel, DpConfig};
use crate::error::{DistError, DistResult};
use ferrograd_core::optim::AdamConfig;
use ferrograd_core::{DType, Device, Error, Rng, Tensor};
use ferrograd_nn::checkpoint::TrainState;
use ferrograd_nn::trainer::{ProgressMode, Trainer, TrainerConfig};
use ferrograd_nn::{mlp_on, Activation, Module, Sequential};
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Debug, Clone)]
pub struct MlpRun {
    /// Layer widths, input first.
    pub sizes: Vec<usize>,
    /// Rows of the dataset; step s reads global batch s (wrapping around).
    pub samples: usize,
    pub global_batch: usize,
    /// Micro-batches per step (gradient accumulation): the global batch is cut into this many.
    pub micro_steps: usize,
    /// Train until this many optimizer steps have been taken.
    pub steps: u64,
    /// Seeds the data and the weights (rank 0's weights win the broadcast).
    pub seed: u64,
    pub lr: f64,
    pub clip: Option<f64>,
    pub dp: DpConfig,
    /// Write a checkpoint after this step.
    pub save: Option<(u64, PathBuf)>,
    /// Start from this checkpoint.
    pub resume: Option<PathBuf>,
}

impl Default for MlpRun {
    fn default() -> Self {
        MlpRun {
            sizes: vec![16, 64, 64, 8],
            samples: 960,
            global_batch: 48,
            micro_steps: 1,
            steps: 10,
            seed: 0,
            lr: 1e-2,
            clip: None,
            dp: DpConfig::default(),
            save: None,
            resume: None,
        }
    }
}

pub fn adam_config(lr: f64) -> AdamConfig {
    AdamConfig { lr, weight_decay: 0.01, decoupled: true, ..Default::default() }
}

/// The dataset: x ~ N(0, 1), y = tanh(x W) for a fixed random W, on `device`.
pub fn dataset(run: &MlpRun, device: Device) -> DistResult<(Tensor, Tensor)> {
    let (din, dout) = (run.sizes[0], run.sizes[run.sizes.len() - 1]);
    let mut rng = Rng::new(run.seed ^ 0x5eed);
    let x = Tensor::randn_with(&mut rng, 0.0, 1.0, (run.samples, din), DType::F32, device)?;
    let w = Tensor::randn_with(&mut rng, 0.0, 1.0 / (din as f64).sqrt(), (din, dout), DType::F32, device)?;
    let y = x.matmul(&w)?.tanh()?;
    Ok((x, y))
}

/// The weights every run starts from (before the broadcast), seeded per rank so that the
/// broadcast from rank 0 is what makes the ranks agree.
pub fn model(run: &MlpRun, seed: u64, device: Device) -> DistResult<Sequential> {
    if run.sizes.len() < 2 {
        return Err(DistError::Core(Error::InvalidArgument("the MLP needs at least two widths".into())));
    }
    Ok(mlp_on(&run.sizes, Activation::Tanh, &mut Rng::new(seed), device)?)
}

/// Rows of micro-batch `micro` of step `step` (counting from 0) read by `rank` of `world`.
pub fn rows(run: &MlpRun, step: u64, micro: usize, rank: usize, world: usize) -> DistResult<std::ops::Range<usize>> {
    let per_micro = run.global_batch / run.micro_steps.max(1);
    if per_micro * run.micro_steps != run.global_batch || !per_micro.is_multiple_of(world) {
        return Err(DistError::Core(Error::InvalidArgument(format!(
            "a global batch of {} in {} micro-batches does not split over {world} ranks",
            run.global_batch, run.micro_steps
        ))));
    }
    let batches = (run.samples / run.global_batch).max(1) as u64;
    let start = (step % batches) as usize * run.global_batch + micro * per_micro;
    let r = crate::shard_range(per_micro, rank, world)?;
    Ok(start + r.start..start + r.end)
}

/// Train `run` on `comm`; `on_step(step)` is called after every optimizer step (tests and the
/// killed-rank check hook in there). Returns the model and the losses the trainer logged.
pub fn train(
    comm: Arc<dyn Communicator>,
    run: &MlpRun,
    on_step: &mut dyn FnMut(u64) -> DistResult<()>,
) -> DistResult<(Sequential, Vec<f64>)> {
    let (rank, world, device) = (comm.rank(), comm.world_size(), comm.device());
    if run.global_batch == 0 || run.samples < run.global_batch {
        return Err(DistError::Core(Error::InvalidArgument(format!(
            "global batch {} must be between 1 and the {} samples",
            run.global_batch, run.samples
        ))));
    }
    let (x, y) = dataset(run, device)?;
    let net = model(run, run.seed + rank as u64, device)?;
    let opt = DataParallel::with_adam(comm, net.named_parameters(), adam_config(run.lr), run.dp.clone())?;
    let cfg = TrainerConfig {
        max_steps: run.steps,
        log_every: 1,
        grad_accum: run.micro_steps.max(1),
        clip_grad_norm: run.clip,
        progress: ProgressMode::Quiet,
        ..Default::default()
    };
    let mut trainer = Trainer::new(opt, cfg)?;
    if let Some(p) = &run.resume {
        let state = trainer.optimizer.load_checkpoint(p, &net)?;
        trainer.resume(&state)?;
    }
    let mut losses = vec![];
    while trainer.step < run.steps {
        let step = trainer.step;
        let out = trainer.train_step(|micro| {
            let r = rows(run, step, micro, rank, world).map_err(Error::from)?;
            let n = r.len();
            let (xb, yb) = (x.narrow(0, r.start, n)?, y.narrow(0, r.start, n)?);
            Ok((net.forward(&xb)?.sub(&yb)?.sqr()?.mean_all()?, n))
        })?;
        if let Some(l) = out.logged_loss {
            losses.push(l);
        }
        on_step(trainer.step)?;
        if let Some((at, path)) = &run.save {
            if trainer.step == *at {
                let state: TrainState = trainer.state();
                trainer.optimizer.save_checkpoint(path, &net, &state)?;
            }
        }
    }
    Ok((net, losses))
}
