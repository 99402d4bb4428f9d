//! The training run: every copy resident before the first step, one copy (5041 samples) per Adam
//! step, no host transfer or synchronisation inside the loop except one loss read per epoch.
//!
//! On CUDA the autograd path (`fused: false`) is captured as a CUDA graph after three warm-up steps
//! and replayed (`graph`, the default), as PyTorch's twin does: each step is then one copy of the
//! batch into a fixed input buffer and one graph launch. The step count of Adam lives on the
//! device (`adam_step_counted`), so each replay applies its own bias correction; the result equals
//! the eager path's bit for bit.
//!
//! Non-finite losses: on the CPU the loss of every step is read (it costs nothing there); on CUDA
//! only the loss at the end of each epoch is, so the loop never waits for the GPU. When that loss
//! is NaN or infinite, the weights and Adam moments saved at the epoch's start are restored and
//! the epoch is replayed reading every step's loss, which finds the first bad step exactly. By
//! default training then stops with `Error::NonFiniteLoss` naming that step; with
//! `skip_nonfinite` each such step's update is undone instead (as a mixed-precision loss scaler
//! skips steps with infinite gradients) and training goes on. A non-finite loss in the middle of a
//! CUDA epoch that later becomes finite again is not seen (Adam turns a NaN gradient into NaN
//! weights, so in practice the loss stays NaN). Under graph replay this works unchanged: the
//! snapshot and its restore copy into the same tensors the graph reads and writes (the device's
//! Adam step count among them), and the loss tensor each replay overwrites is read as any other.
//!
//! (About 640 lines: the run, its non-finite guard and the guard's tests belong together; the
//! three steps it drives live in `stepper`, the persistent kernel in `persistent`, the
//! data-parallel step in `dp`, the kernel modules it warms in `kernels`.)

use super::data::{CopyData, COPY_BYTES};
pub use super::dp::{DistHooks, TensorHook};
use super::model::Autoencoder;
use super::plan::{human, measure_copy, plan, MemoryPlan, PlanRequest};
use super::stepper::{Autograd, GraphSteps, Stepper};
use super::walk::{ENTRIES, RINGS, SAMPLES, STEPS};
use crate::persistent::{PhaseProfile, Precision};
use ferrograd_core::cuda::CudaDevice;
use ferrograd_core::optim::AdamConfig;
use ferrograd_core::{Device, Error, Result, Tensor};
use ferrograd_nn::checkpoint::LoadOptions;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Debug, Clone)]
pub struct TrainConfig {
    pub plan: PlanRequest,
    pub epochs: usize,
    pub lr: f64,
    /// Samples per step; the default is one whole copy (5041).
    pub batch: usize,
    pub seed: u64,
    pub device: Device,
    pub init: Option<PathBuf>,
    pub save: Option<PathBuf>,
    /// On CUDA, train with the fused two-kernel step (the default) instead of the generic
    /// autograd path (kept for comparison and as the reference).
    pub fused: bool,
    /// On CUDA, replay the autograd path's step as a CUDA graph (the default) instead of running
    /// it op by op.
    pub graph: bool,
    /// With `fused`: run the whole training in one persistent kernel where the GPU and the model
    /// allow (the default), else the fused step, with the reason in the report.
    pub persistent: bool,
    /// The persistent kernel's matrix-product precision (f32 = 3xTF32 by default).
    pub precision: Precision,
    /// Accept NaN or infinite values in the `init` weights (refused by default).
    pub allow_nonfinite: bool,
    /// Undo and skip steps whose loss is not finite instead of stopping at the first one.
    pub skip_nonfinite: bool,
    /// Data parallel over several processes, one GPU each (`ferrograd launch`): each rank fills
    /// its GPU with copies of its own, trains one copy per step, and gradients are averaged
    /// over the ranks every step (see `dp`).
    pub dist: Option<DistHooks>,
}

impl TrainConfig {
    /// The spec's defaults on a GPU: 113 copies, 71 epochs, lr 1e-3, one copy per step.
    pub fn spec_defaults(device: Device) -> TrainConfig {
        TrainConfig {
            plan: PlanRequest::Copies(113),
            epochs: 71,
            lr: 1e-3,
            batch: SAMPLES,
            seed: 0,
            device,
            init: None,
            save: None,
            fused: true,
            graph: true,
            persistent: true,
            precision: Precision::F32,
            allow_nonfinite: false,
            skip_nonfinite: false,
            dist: None,
        }
    }
}

/// What the progress display gets after each epoch.
#[derive(Debug, Clone)]
pub struct EpochStats {
    pub epoch: usize,
    pub epochs: usize,
    pub steps: usize,
    pub loss: f64,
    pub samples_per_s: f64,
    pub device_memory_used: Option<usize>,
}

/// The JSON report: every field docs/monster-walk.md lists.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct Report {
    pub name: String,
    pub tensor_shape: Vec<usize>,
    pub copies: usize,
    pub total_entries: usize,
    pub memory_planned_bytes: usize,
    pub memory_measured_bytes: usize,
    pub device: String,
    pub training_time_s: f64,
    pub samples_per_s: f64,
    pub entries_per_s: f64,
    pub first_loss: f64,
    pub final_loss: f64,
    pub seed: u64,
    pub ferrograd_version: String,
    pub epochs: usize,
    pub steps: usize,
    pub batch: usize,
    pub lr: f64,
    pub parameters: usize,
    pub data_build_time_s: f64,
    /// "fused" (two kernels a step) or "autograd" (the generic op-by-op path).
    pub step_kind: String,
    /// Whether the step was replayed as a CUDA graph.
    #[serde(default)]
    pub cuda_graph: bool,
    /// The persistent kernel's precision (f32 = 3xTF32, tf32, bf16).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub precision: Option<String>,
    /// Why the persistent kernel was not used although it was asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_fallback: Option<String>,
    /// Where a persistent step's time goes (the kernel's own clock).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phases: Option<PhaseProfile>,
    /// Of `steps`, those whose loss was not finite and whose update was undone (`skip_nonfinite`).
    #[serde(default)]
    pub skipped_steps: u64,
    /// Processes (GPUs) that trained together; copies, entries and samples count all of them.
    #[serde(default = "one")]
    pub world_size: usize,
    /// Data parallel: the share of the training time the gradient all-reduces took (device time
    /// on the communication stream over wall time; the step waits for them).
    #[serde(default)]
    pub allreduce_share: Option<f64>,
}

fn one() -> usize {
    1
}

fn memory_used(device: Device) -> Option<usize> {
    match device {
        Device::Cuda(o) => CudaDevice::get(o).ok().map(|d| d.memory_stats().allocated_bytes.current),
        Device::Cpu => None,
    }
}

/// Build the data, train, and report. `on_epoch` drives a progress display.
pub fn run(cfg: &TrainConfig, mut on_epoch: impl FnMut(&EpochStats)) -> Result<(Report, MemoryPlan)> {
    if cfg.epochs == 0 {
        return Err(Error::InvalidArgument("--epochs must be at least 1".into()));
    }
    if cfg.batch == 0 || cfg.batch > SAMPLES {
        return Err(Error::InvalidArgument(format!(
            "--batch {} must be between 1 and {SAMPLES} (one copy's samples: a step never spans two copies)",
            cfg.batch
        )));
    }
    if !(cfg.lr > 0.0 && cfg.lr.is_finite()) {
        return Err(Error::InvalidArgument(format!("--lr {} must be a positive number", cfg.lr)));
    }
    // The plan by arithmetic first: an impossible request fails before anything is built.
    let free = free_bytes(cfg.device)?;
    check_fits(&plan(cfg.plan, COPY_BYTES, free)?, cfg.device)?;
    // The run's kernel modules start compiling now, all at once, while the weights are drawn and
    // the data is built (on a warm kernel cache: a few disk reads); loaded before the timed loop.
    let kernels = match cfg.device {
        Device::Cuda(o) => {
            let dev = CudaDevice::get(o)?;
            let list = super::kernels::modules(cfg, &dev)?;
            drop(dev.warm(&list));
            list
        }
        Device::Cpu => vec![],
    };
    // Weights next: a bad --init file fails before minutes of data building.
    let model = match &cfg.init {
        Some(p) => Autoencoder::load_with(p, cfg.device, LoadOptions { allow_nonfinite: cfg.allow_nonfinite })?,
        None => Autoencoder::init(cfg.seed, cfg.device)?,
    };
    let build_start = Instant::now();
    let (first, copy_bytes) = measure_copy(cfg.device)?;
    let mut mp = plan(cfg.plan, copy_bytes, free)?;
    check_fits(&mp, cfg.device)?;
    let (rank, world) = cfg.dist.as_ref().map_or((0, 1), |d| (d.rank, d.world));
    if let Some(d) = &cfg.dist {
        // Every rank steps once per copy it holds: they must hold as many.
        let n = (d.min)(mp.copies)?;
        mp.planned_bytes = mp.planned_bytes / mp.copies.max(1) * n;
        mp.copies = n;
        for p in model.parameters() {
            (d.broadcast)(&p)?;
        }
    }
    // Rank r holds copies r*n .. (r+1)*n: the ranks together train world x n distinct copies.
    let base = rank * mp.copies;
    let mut copies = Vec::with_capacity(mp.copies);
    if base == 0 {
        copies.push(first);
    } else {
        drop(first);
        copies.push(CopyData::build(base, cfg.device)?);
    }
    for c in 1..mp.copies {
        copies.push(CopyData::build(base + c, cfg.device)?);
    }
    let measured = match cfg.device {
        Device::Cuda(o) => {
            let dev = CudaDevice::get(o)?;
            // Every kernel module of the run loaded now (waiting for the warm start's compiles), so
            // the timed loop measures training only.
            for m in &kernels {
                dev.load_module(m)?;
            }
            dev.synchronize()?;
            copies.len() * copy_bytes
        }
        Device::Cpu => copies.iter().map(|c| c.bytes()).sum(),
    };
    let data_build_time_s = build_start.elapsed().as_secs_f64();

    let batches: Vec<Tensor> = copies
        .iter()
        .map(|c| {
            let x = c.samples()?;
            (0..SAMPLES)
                .step_by(cfg.batch)
                .map(|s| x.narrow(0, s, cfg.batch.min(SAMPLES - s)))
                .collect::<Result<Vec<_>>>()
        })
        .collect::<Result<Vec<_>>>()?
        .into_iter()
        .flatten()
        .collect();
    let adam = AdamConfig { lr: cfg.lr, ..AdamConfig::default() };
    let fused = cfg.fused && cfg.device.is_cuda();
    let graph = !fused && cfg.graph && cfg.device.is_cuda();
    let reduce = cfg.dist.as_ref().map(|d| d.all_reduce_mean.clone());
    let (persistent, step_fallback) = match fused && cfg.persistent {
        // The persistent kernel is single-GPU: it has no point between its steps where the
        // gradients could be all-reduced, so data parallel takes the fused step (`dp::FusedDp`).
        true if reduce.is_some() => (
            None,
            Some(format!(
                "it is single-GPU; data parallel over {world} rank(s) all-reduces the 9,690 gradients between \
                 the fused step's two kernels"
            )),
        ),
        // Undoing single steps needs the host between steps; the persistent kernel has none.
        true if cfg.skip_nonfinite => (None, Some("--skip-nonfinite undoes single steps from the host".to_string())),
        true => {
            match super::persistent::MonsterPersistent::new(&model, cfg.device, cfg.batch.min(SAMPLES), cfg.precision)?
            {
                Ok(p) => (Some(p), None),
                Err(why) => (None, Some(why)),
            }
        }
        false => (None, None),
    };
    if let Some(mut p) = persistent {
        let (copies_n, nb) = (copies.len(), batches.len());
        let o = p.train(&model, &batches, cfg.epochs, &adam, |epoch, loss, secs| {
            on_epoch(&EpochStats {
                epoch,
                epochs: cfg.epochs,
                steps: epoch * nb,
                loss,
                samples_per_s: (epoch * copies_n * SAMPLES) as f64 / secs.max(1e-9),
                device_memory_used: memory_used(cfg.device),
            })
        })?;
        if !o.final_loss.is_finite() {
            return Err(Error::NonFiniteLoss {
                step: o.steps as u64,
                epoch: cfg.epochs,
                loss: o.final_loss,
                hint: "; the persistent kernel reads no loss on the host between steps: rerun with --step fused to \
                       find the first bad step, or pass --skip-nonfinite"
                    .into(),
            });
        }
        if let Some(path) = &cfg.save {
            model.save(path)?;
        }
        let samples = (cfg.epochs * copies.len() * SAMPLES) as f64;
        let report = Report {
            training_time_s: o.training_time_s,
            samples_per_s: samples / o.training_time_s,
            entries_per_s: samples * RINGS as f64 / o.training_time_s,
            first_loss: o.first_loss,
            final_loss: o.final_loss,
            steps: o.steps,
            step_kind: "persistent".into(),
            precision: Some(p.precision().describe().into()),
            phases: Some(o.phases),
            ..report_base(cfg, &copies, &mp, measured, data_build_time_s, &model)
        };
        return Ok((report, mp));
    }
    let mut stepper: Box<dyn Stepper> = match (fused, reduce) {
        (true, None) => Box::new(super::fused::FusedTrainer::new(&model, cfg.device, cfg.batch.min(SAMPLES), adam)?),
        (true, Some(r)) => Box::new(super::dp::FusedDp {
            inner: super::fused::FusedTrainer::new(&model, cfg.device, cfg.batch.min(SAMPLES), adam)?,
            reduce: r,
        }),
        // The autograd step replayed as a CUDA graph: one GPU (the all-reduce is not captured).
        (false, None) if graph => Box::new(GraphSteps::new(&model, adam)?),
        (false, r) => Box::new(Autograd::new(&model, adam, r)?),
    };

    let start = Instant::now();
    let mut g = Guard { step: 0, first_loss: f64::NAN, skipped: 0, skip: cfg.skip_nonfinite, last_finite: None };
    // Host reads are free on the CPU: check every step there (see the module documentation).
    let every_step = !cfg.device.is_cuda();
    for epoch in 0..cfg.epochs {
        let loss = g.epoch(&mut *stepper, &batches, epoch, every_step)?;
        on_epoch(&EpochStats {
            epoch: epoch + 1,
            epochs: cfg.epochs,
            steps: g.step as usize,
            loss,
            samples_per_s: ((epoch + 1) * world * copies.len() * SAMPLES) as f64
                / start.elapsed().as_secs_f64().max(1e-9),
            device_memory_used: memory_used(cfg.device),
        });
    }
    cfg.device.synchronize()?;
    let training_time_s = start.elapsed().as_secs_f64();
    let final_loss = g.last_finite.unwrap_or(f64::NAN);
    stepper.finish(&model)?;
    if let Some(p) = &cfg.save {
        model.save(p)?;
    }
    let samples = (cfg.epochs * world * copies.len() * SAMPLES) as f64;
    let report = Report {
        training_time_s,
        samples_per_s: samples / training_time_s,
        entries_per_s: samples * RINGS as f64 / training_time_s,
        first_loss: g.first_loss,
        final_loss,
        steps: g.step as usize,
        step_kind: if fused { "fused" } else { "autograd" }.into(),
        cuda_graph: graph,
        step_fallback,
        skipped_steps: g.skipped,
        ..report_base(cfg, &copies, &mp, measured, data_build_time_s, &model)
    };
    Ok((report, mp))
}

/// The report's fields that do not depend on how the steps ran.
fn report_base(
    cfg: &TrainConfig,
    copies: &[CopyData],
    mp: &MemoryPlan,
    measured: usize,
    data_build_time_s: f64,
    model: &Autoencoder,
) -> Report {
    let world = cfg.dist.as_ref().map_or(1, |d| d.world);
    Report {
        name: "monster-walk".into(),
        tensor_shape: vec![STEPS, STEPS, RINGS],
        copies: world * copies.len(),
        total_entries: world * copies.len() * ENTRIES,
        memory_planned_bytes: mp.planned_bytes,
        memory_measured_bytes: measured,
        device: describe(cfg.device),
        training_time_s: 0.0,
        samples_per_s: 0.0,
        entries_per_s: 0.0,
        first_loss: f64::NAN,
        final_loss: f64::NAN,
        seed: cfg.seed,
        ferrograd_version: env!("CARGO_PKG_VERSION").into(),
        epochs: cfg.epochs,
        steps: 0,
        batch: cfg.batch,
        lr: cfg.lr,
        parameters: model.parameter_count(),
        data_build_time_s,
        step_kind: String::new(),
        world_size: world,
        allreduce_share: None,
        precision: None,
        step_fallback: None,
        phases: None,
        skipped_steps: 0,
        cuda_graph: false,
    }
}

/// The device's free bytes (CUDA: the driver's figure; CPU: what the host reports available).
fn free_bytes(device: Device) -> Result<Option<usize>> {
    Ok(match device {
        Device::Cuda(o) => Some(CudaDevice::get(o)?.mem_info()?.0),
        Device::Cpu => ferrograd_core::host::host_memory().map(|m| m.available),
    })
}

/// Refuse a plan whose copies and working space cannot fit: `HostOutOfMemory` on the CPU,
/// `OutOfMemory` with the allocator's figures on CUDA, both before anything is built.
pub fn check_fits(mp: &MemoryPlan, device: Device) -> Result<()> {
    let need = mp.planned_bytes.saturating_add(mp.reserve_bytes);
    let what = || {
        format!(
            "monster-walk's plan of {} copies x {} plus {} of working space",
            mp.copies,
            human(mp.copy_bytes_measured),
            human(mp.reserve_bytes)
        )
    };
    ferrograd_core::host::check_fits_on(device, what, need)
}

/// Copies of everything a step changes, to undo steps (see the module documentation).
struct Snapshot {
    tensors: Vec<(Tensor, Tensor)>,
    step: u64,
}

impl Snapshot {
    fn take(s: &dyn Stepper) -> Result<Snapshot> {
        let (live, step) = s.state();
        let tensors = live
            .into_iter()
            .map(|t| {
                let copy = t.zeros_like()?;
                copy.set(&t)?;
                Ok((t, copy))
            })
            .collect::<Result<_>>()?;
        Ok(Snapshot { tensors, step })
    }

    fn restore(&self, s: &mut dyn Stepper) -> Result<()> {
        for (live, copy) in &self.tensors {
            live.set(copy)?;
        }
        s.set_step_count(self.step);
        Ok(())
    }
}

/// Step counting and the non-finite policy of one run.
struct Guard {
    step: u64,
    first_loss: f64,
    skipped: u64,
    skip: bool,
    last_finite: Option<f64>,
}

impl Guard {
    /// One epoch; with `every_step` false the loss is read once at the end and the epoch replayed
    /// step by step only when it is not finite (see the module documentation). Returns the
    /// epoch's last finite loss.
    fn epoch(&mut self, s: &mut dyn Stepper, batches: &[Tensor], epoch: usize, every_step: bool) -> Result<f64> {
        if every_step {
            return self.checked_epoch(s, batches, epoch);
        }
        let at_start = Snapshot::take(s)?;
        let step0 = self.step;
        for x in batches {
            s.step(x)?;
            self.step += 1;
            if self.step == 1 {
                self.first_loss = s.loss()?.item_f64()?;
            }
        }
        // One host read per epoch: the GPU keeps a full epoch of work queued between reads.
        let loss = s.loss()?.item_f64()?;
        if loss.is_finite() {
            self.last_finite = Some(loss);
            return Ok(loss);
        }
        at_start.restore(s)?;
        self.step = step0;
        self.checked_epoch(s, batches, epoch)
    }

    /// One epoch reading every step's loss: stop at the first non-finite one, or undo it.
    /// Returns the last finite loss of the epoch.
    fn checked_epoch(&mut self, s: &mut dyn Stepper, batches: &[Tensor], epoch: usize) -> Result<f64> {
        let mut last = None;
        for x in batches {
            let before = if self.skip { Some(Snapshot::take(s)?) } else { None };
            s.step(x)?;
            self.step += 1;
            let loss = s.loss()?.item_f64()?;
            if self.step == 1 {
                self.first_loss = loss;
            }
            if loss.is_finite() {
                last = Some(loss);
                self.last_finite = Some(loss);
                continue;
            }
            match before {
                Some(b) => {
                    b.restore(s)?;
                    self.skipped += 1;
                }
                None => {
                    return Err(Error::NonFiniteLoss {
                        step: self.step,
                        epoch: epoch + 1,
                        loss,
                        hint: "; the weights or the learning rate diverged (try a lower --lr, check --init), or pass \
                               --skip-nonfinite to skip such steps"
                            .into(),
                    })
                }
            }
        }
        last.ok_or(Error::NonFiniteLoss {
            step: self.step,
            epoch: epoch + 1,
            loss: f64::NAN,
            hint: format!(": every step of epoch {} had a non-finite loss and was undone", epoch + 1),
        })
    }
}

pub fn describe(d: Device) -> String {
    match d {
        Device::Cpu => format!("cpu ({} threads)", rayon_threads()),
        Device::Cuda(o) => match CudaDevice::get(o) {
            Ok(dev) => format!("cuda:{o} ({})", dev.info.name),
            Err(_) => format!("cuda:{o}"),
        },
    }
}

fn rayon_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Write the four representations of one copy as safetensors (`residues` u8, the others f32),
/// atomically, through ferrograd-nn's writer.
pub fn export(copy: usize, path: &std::path::Path) -> Result<()> {
    let c = CopyData::build(copy, Device::Cpu)?;
    let meta = std::collections::HashMap::from([("copy".to_string(), copy.to_string())]);
    let named: Vec<(&str, &Tensor)> = c.named().to_vec();
    Ok(ferrograd_nn::checkpoint::save_safetensors(path, &named, meta)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stepper whose weight counts the steps applied; the batch whose value is `bad` gives a NaN
    /// loss (and, as Adam would, poisons the weight for good unless the step is undone).
    struct Fake {
        w: Tensor,
        step: u64,
        bad: f64,
        last: f64,
    }

    impl Stepper for Fake {
        fn step(&mut self, x: &Tensor) -> Result<()> {
            self.step += 1;
            let poisoned = x.item_f64()? == self.bad || self.w.item_f64()?.is_nan();
            let next = if poisoned { f64::NAN } else { self.w.item_f64()? + 1.0 };
            self.w.set(&Tensor::from_vec(vec![next], 1, Device::Cpu)?)?;
            self.last = next;
            Ok(())
        }
        fn loss(&self) -> Result<Tensor> {
            Tensor::from_vec(vec![self.last], (), Device::Cpu)
        }
        fn state(&self) -> (Vec<Tensor>, u64) {
            (vec![self.w.clone()], self.step)
        }
        fn set_step_count(&mut self, step: u64) {
            self.step = step;
        }
    }

    fn setup(bad: f64, skip: bool) -> Result<(Fake, Vec<Tensor>, Guard)> {
        let w = Tensor::from_vec(vec![0.0f64], 1, Device::Cpu)?;
        let batches = (0..5).map(|i| Tensor::from_vec(vec![i as f64], (), Device::Cpu)).collect::<Result<_>>()?;
        let g = Guard { step: 0, first_loss: f64::NAN, skipped: 0, skip, last_finite: None };
        Ok((Fake { w, step: 0, bad, last: f64::NAN }, batches, g))
    }

    #[test]
    fn the_first_non_finite_step_is_named_in_both_modes() -> Result<()> {
        for every_step in [true, false] {
            let (mut f, b, mut g) = setup(99.0, false)?;
            assert_eq!(g.epoch(&mut f, &b, 0, every_step)?, 5.0);
            assert_eq!(g.first_loss, 1.0);
            // Epoch 2: its third batch (step 8) turns the loss NaN for good; on the CUDA path
            // (`every_step` false) only the epoch's end is read, and the replay finds step 8.
            f.bad = 2.0;
            match g.epoch(&mut f, &b, 1, every_step).unwrap_err() {
                e @ Error::NonFiniteLoss { .. } => {
                    assert!(e.to_string().contains("step 8 (epoch 2)"), "every_step {every_step}: {e}")
                }
                e => panic!("{e}"),
            }
        }
        Ok(())
    }

    #[test]
    fn skipping_undoes_only_the_bad_steps() -> Result<()> {
        for every_step in [true, false] {
            let (mut f, b, mut g) = setup(2.0, true)?;
            let loss = g.epoch(&mut f, &b, 0, every_step)?;
            // Four good steps applied, the bad one undone: the weight counts 4 (steps counts all 5).
            assert_eq!((loss, f.w.item_f64()?, g.skipped, g.step), (4.0, 4.0, 1, 5), "every_step {every_step}");
        }
        // Every batch bad: the epoch is an error, not a silent run of skipped steps.
        let (mut f, b, mut g) = setup(0.0, true)?;
        f.w.set(&Tensor::from_vec(vec![f64::NAN], 1, Device::Cpu)?)?;
        assert!(matches!(g.epoch(&mut f, &b, 0, true), Err(Error::NonFiniteLoss { .. })));
        Ok(())
    }
}
