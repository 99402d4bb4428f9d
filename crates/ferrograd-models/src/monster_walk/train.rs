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
    let mp = plan(cfg.plan, copy_bytes, free)?;
    let mut copies = Vec::with_capacity(mp.copies);
    copies.push(first);
    for c in 1..mp.copies {
        copies.push(CopyData::build(c, cfg.device)?);
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
    let params = model.parameters();
    let m: Vec<Tensor> = params.iter().map(|p| p.zeros_like()).collect::<Result<_>>()?;
    let v: Vec<Tensor> = params.iter().map(|p| p.zeros_like()).collect::<Result<_>>()?;
    let adam = AdamConfig { lr: cfg.lr, ..AdamConfig::default() };

    let start = Instant::now();
    let mut step = 0u64;
    let mut first_loss = f64::NAN;
    let mut last = None;
    for epoch in 0..cfg.epochs {
        for x in &batches {
            let loss = model.loss(x)?;
            let grads = loss.backward()?;
            let g: Vec<Tensor> = params
                .iter()
                .map(|p| grads.get(p).cloned().ok_or_else(|| Error::Backward("a weight got no gradient".into())))
                .collect::<Result<_>>()?;
            step += 1;
            adam_step(&params, &g, &m, &v, &adam, step)?;
            if step == 1 {
                first_loss = loss.item_f64()?;
            }
            last = Some(loss.detach());
        }
        // One host read per epoch: the GPU keeps a full epoch of work queued between reads.
        let loss = last.as_ref().map(|l| l.item_f64()).transpose()?.unwrap_or(f64::NAN);
        let done = (epoch + 1) * batches.len();
        on_epoch(&EpochStats {
            epoch: epoch + 1,
            epochs: cfg.epochs,
            steps: done,
            loss,
            samples_per_s: ((epoch + 1) * copies.len() * SAMPLES) as f64 / start.elapsed().as_secs_f64().max(1e-9),
            device_memory_used: memory_used(cfg.device),
        });
    }
    cfg.device.synchronize()?;
    let training_time_s = start.elapsed().as_secs_f64();
    let final_loss = last.map(|l| l.item_f64()).transpose()?.unwrap_or(f64::NAN);
    if let Some(p) = &cfg.save {
        model.save(p)?;
    }
    let samples = (cfg.epochs * copies.len() * SAMPLES) as f64;
    let report = Report {
        name: "monster-walk".into(),
        tensor_shape: vec![STEPS, STEPS, RINGS],
        copies: copies.len(),
        total_entries: copies.len() * ENTRIES,
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
    };
    Ok((report, mp))
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
