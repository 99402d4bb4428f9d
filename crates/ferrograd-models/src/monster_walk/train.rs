//! The training run: every copy resident before the first step, one copy (5041 samples) per Adam
//! step, no host transfer or synchronisation inside the loop except one loss read per epoch.

use super::data::CopyData;
use super::model::Autoencoder;
use super::plan::{measure_copy, plan, MemoryPlan, PlanRequest};
use super::walk::{ENTRIES, RINGS, SAMPLES, STEPS};
use ferrograd_core::cuda::{modules, CudaDevice};
use ferrograd_core::optim::{adam_step, AdamConfig};
use ferrograd_core::{DType, Device, Error, Result, Tensor};
use std::path::PathBuf;
use std::sync::Arc;
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
    /// Data parallel over several processes, one GPU each (`ferrograd launch`): each rank fills
    /// its GPU with copies of its own, trains one copy per step, and gradients are averaged
    /// over the ranks every step.
    pub dist: Option<DistHooks>,
}

/// An in-place operation on a device tensor across the ranks.
pub type TensorHook = Arc<dyn Fn(&Tensor) -> Result<()> + Send + Sync>;

/// What a data-parallel run needs from the process group (`ferrograd-dist` provides it; this
/// crate stays free of NCCL).
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

/// The JSON report: every field MONSTER_WALK.md lists, and a few more.
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
    if cfg.batch == 0 {
        return Err(Error::InvalidArgument("--batch must be at least 1".into()));
    }
    if !(cfg.lr > 0.0 && cfg.lr.is_finite()) {
        return Err(Error::InvalidArgument(format!("--lr {} must be a positive number", cfg.lr)));
    }
    // Weights first: a bad --init file fails before minutes of data building.
    let model = match &cfg.init {
        Some(p) => Autoencoder::load(p, cfg.device)?,
        None => Autoencoder::init(cfg.seed, cfg.device)?,
    };
    let build_start = Instant::now();
    let free = match cfg.device {
        Device::Cuda(o) => Some(CudaDevice::get(o)?.mem_info()?.0),
        Device::Cpu => None,
    };
    let (first, copy_bytes) = measure_copy(cfg.device)?;
    let mut mp = plan(cfg.plan, copy_bytes, free)?;
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
            // Compile or load every kernel now, so the timed loop measures training only.
            for m in modules::ALL {
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
    let reduce = cfg.dist.as_ref().map(|d| d.all_reduce_mean.clone());
    let mut stepper: Box<dyn Stepper> = match (fused, reduce) {
        (true, None) => Box::new(super::fused::FusedTrainer::new(&model, cfg.device, cfg.batch.min(SAMPLES), adam)?),
        (true, Some(r)) => Box::new(FusedDp {
            inner: super::fused::FusedTrainer::new(&model, cfg.device, cfg.batch.min(SAMPLES), adam)?,
            reduce: r,
        }),
        (false, r) => Box::new(Autograd::new(&model, adam, r)?),
    };

    let start = Instant::now();
    let mut step = 0u64;
    let mut first_loss = f64::NAN;
    for epoch in 0..cfg.epochs {
        for x in &batches {
            stepper.step(x)?;
            step += 1;
            if step == 1 {
                first_loss = stepper.loss()?.item_f64()?;
            }
        }
        // One host read per epoch: the GPU keeps a full epoch of work queued between reads.
        let loss = stepper.loss()?.item_f64()?;
        on_epoch(&EpochStats {
            epoch: epoch + 1,
            epochs: cfg.epochs,
            steps: (epoch + 1) * batches.len(),
            loss,
            samples_per_s: ((epoch + 1) * world * copies.len() * SAMPLES) as f64
                / start.elapsed().as_secs_f64().max(1e-9),
            device_memory_used: memory_used(cfg.device),
        });
    }
    cfg.device.synchronize()?;
    let training_time_s = start.elapsed().as_secs_f64();
    let final_loss = stepper.loss()?.item_f64()?;
    stepper.finish(&model)?;
    if let Some(p) = &cfg.save {
        model.save(p)?;
    }
    let samples = (cfg.epochs * world * copies.len() * SAMPLES) as f64;
    let report = Report {
        name: "monster-walk".into(),
        tensor_shape: vec![STEPS, STEPS, RINGS],
        copies: world * copies.len(),
        total_entries: world * copies.len() * ENTRIES,
        memory_planned_bytes: mp.planned_bytes,
        memory_measured_bytes: measured,
        device: describe(cfg.device),
        training_time_s,
        samples_per_s: samples / training_time_s,
        entries_per_s: samples * RINGS as f64 / training_time_s,
        first_loss,
        final_loss,
        seed: cfg.seed,
        ferrograd_version: env!("CARGO_PKG_VERSION").into(),
        epochs: cfg.epochs,
        steps: step as usize,
        batch: cfg.batch,
        lr: cfg.lr,
        parameters: model.parameter_count(),
        data_build_time_s,
        step_kind: if fused { "fused" } else { "autograd" }.into(),
        world_size: world,
        allreduce_share: None,
    };
    Ok((report, mp))
}

/// One optimizer step over a batch, and the loss it saw.
trait Stepper {
    fn step(&mut self, x: &Tensor) -> Result<()>;
    fn loss(&self) -> Result<Tensor>;
    /// Leave the trained weights in the model's tensors.
    fn finish(&self, model: &Autoencoder) -> Result<()>;
}

impl Stepper for super::fused::FusedTrainer {
    fn step(&mut self, x: &Tensor) -> Result<()> {
        super::fused::FusedTrainer::step(self, x)
    }
    fn loss(&self) -> Result<Tensor> {
        Ok(super::fused::FusedTrainer::loss(self).clone())
    }
    fn finish(&self, model: &Autoencoder) -> Result<()> {
        self.write_back(model)
    }
}

/// The fused step with the gradients averaged over the ranks between its two kernels.
struct FusedDp {
    inner: super::fused::FusedTrainer,
    reduce: Reduce,
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
}

type Reduce = TensorHook;

/// The generic path: autograd over the model's ops, then the fused multi-tensor Adam (with the
/// gradients averaged over ranks first when data parallel).
struct Autograd {
    model: Autoencoder,
    params: Vec<Tensor>,
    m: Vec<Tensor>,
    v: Vec<Tensor>,
    adam: AdamConfig,
    step: u64,
    last: Option<Tensor>,
    reduce: Option<Reduce>,
}

impl Autograd {
    fn new(model: &Autoencoder, adam: AdamConfig, reduce: Option<Reduce>) -> Result<Autograd> {
        let params = model.parameters();
        let m = params.iter().map(|p| p.zeros_like()).collect::<Result<_>>()?;
        let v = params.iter().map(|p| p.zeros_like()).collect::<Result<_>>()?;
        Ok(Autograd { model: model.clone(), params, m, v, adam, step: 0, last: None, reduce })
    }
}

impl Stepper for Autograd {
    fn step(&mut self, x: &Tensor) -> Result<()> {
        let loss = self.model.loss(x)?;
        let grads = loss.backward()?;
        let mut g: Vec<Tensor> = self
            .params
            .iter()
            .map(|p| grads.get(p).cloned().ok_or_else(|| Error::Backward("a weight got no gradient".into())))
            .collect::<Result<_>>()?;
        if let Some(reduce) = &self.reduce {
            let flat = g.iter().map(|t| t.flatten_all()).collect::<Result<Vec<_>>>()?;
            let flat = Tensor::cat(&flat, 0)?;
            reduce(&flat)?;
            let mut off = 0;
            for (t, p) in g.iter_mut().zip(&self.params) {
                *t = flat.narrow(0, off, p.elem_count())?.reshape(p.dims())?;
                off += p.elem_count();
            }
        }
        self.step += 1;
        adam_step(&self.params, &g, &self.m, &self.v, &self.adam, self.step)?;
        self.last = Some(loss.detach());
        Ok(())
    }
    fn loss(&self) -> Result<Tensor> {
        self.last.clone().ok_or_else(|| Error::InvalidArgument("no step taken yet".into()))
    }
    fn finish(&self, _model: &Autoencoder) -> Result<()> {
        Ok(())
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

/// Write the four representations of one copy as safetensors (`residues` u8, the others f32).
pub fn export(copy: usize, path: &std::path::Path) -> Result<()> {
    let c = CopyData::build(copy, Device::Cpu)?;
    let host: Vec<(&str, Vec<u8>, Vec<usize>, safetensors::Dtype)> = c
        .named()
        .iter()
        .map(|(n, t)| {
            let (bytes, dt) = match t.dtype() {
                DType::U8 => (t.to_vec::<u8>()?, safetensors::Dtype::U8),
                _ => (t.to_vec::<f32>()?.iter().flat_map(|x| x.to_le_bytes()).collect(), safetensors::Dtype::F32),
            };
            Ok((*n, bytes, t.dims().to_vec(), dt))
        })
        .collect::<Result<_>>()?;
    let views = host
        .iter()
        .map(|(n, b, s, dt)| {
            safetensors::tensor::TensorView::new(*dt, s.clone(), b)
                .map(|v| (n.to_string(), v))
                .map_err(|e| super::model::file_err(path, e.to_string()))
        })
        .collect::<Result<Vec<_>>>()?;
    let meta = std::collections::HashMap::from([("copy".to_string(), copy.to_string())]);
    let bytes = safetensors::serialize(views, Some(meta)).map_err(|e| super::model::file_err(path, e.to_string()))?;
    super::model::write_atomic(path, &bytes)
}
