//! The training run: every copy resident before the first step, one copy (5041 samples) per Adam
//! step, no host transfer or synchronisation inside the loop except one loss read per epoch.
//!
//! On CUDA the autograd path (`fused: false`) is captured as a CUDA graph after three warm-up steps
//! and replayed (`graph`, the default), as PyTorch's twin does: each step is then one copy of the
//! batch into a fixed input buffer and one graph launch. The step count of Adam lives on the
//! device (`adam_step_counted`), so each replay applies its own bias correction; the result equals
//! the eager path's bit for bit.

use super::data::CopyData;
use super::model::Autoencoder;
use super::plan::{measure_copy, plan, MemoryPlan, PlanRequest};
use super::walk::{ENTRIES, RINGS, SAMPLES, STEPS};
use ferrograd_core::cuda::{modules, Capture, CudaDevice, Graph};
use ferrograd_core::optim::{adam_step, adam_step_counted, AdamConfig};
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
    /// On CUDA, train with the fused two-kernel step (the default) instead of the generic
    /// autograd path (kept for comparison and as the reference).
    pub fused: bool,
    /// On CUDA, replay the autograd path's step as a CUDA graph (the default) instead of running
    /// it op by op.
    pub graph: bool,
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
    /// Whether the step was replayed as a CUDA graph.
    #[serde(default)]
    pub cuda_graph: bool,
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
    let adam = AdamConfig { lr: cfg.lr, ..AdamConfig::default() };
    let fused = cfg.fused && cfg.device.is_cuda();
    let graph = !fused && cfg.graph && cfg.device.is_cuda();
    let mut stepper: Box<dyn Stepper> = if fused {
        Box::new(super::fused::FusedTrainer::new(&model, cfg.device, cfg.batch.min(SAMPLES), adam)?)
    } else if graph {
        Box::new(GraphSteps::new(&model, adam)?)
    } else {
        Box::new(Autograd::new(&model, adam)?)
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
            samples_per_s: ((epoch + 1) * copies.len() * SAMPLES) as f64 / start.elapsed().as_secs_f64().max(1e-9),
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
        step_kind: if fused { "fused" } else { "autograd" }.into(),
        cuda_graph: graph,
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

/// The generic path: autograd over the model's ops, then the fused multi-tensor Adam.
struct Autograd {
    model: Autoencoder,
    params: Vec<Tensor>,
    m: Vec<Tensor>,
    v: Vec<Tensor>,
    adam: AdamConfig,
    step: u64,
    last: Option<Tensor>,
}

impl Autograd {
    fn new(model: &Autoencoder, adam: AdamConfig) -> Result<Autograd> {
        let params = model.parameters();
        let m = params.iter().map(|p| p.zeros_like()).collect::<Result<_>>()?;
        let v = params.iter().map(|p| p.zeros_like()).collect::<Result<_>>()?;
        Ok(Autograd { model: model.clone(), params, m, v, adam, step: 0, last: None })
    }
}

impl Stepper for Autograd {
    fn step(&mut self, x: &Tensor) -> Result<()> {
        let loss = self.model.loss(x)?;
        let grads = loss.backward()?;
        let g: Vec<Tensor> = self
            .params
            .iter()
            .map(|p| grads.get(p).cloned().ok_or_else(|| Error::Backward("a weight got no gradient".into())))
            .collect::<Result<_>>()?;
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

/// Warm-up steps before the capture (PyTorch's twin takes three too); they train like any step.
const WARMUP_STEPS: usize = 3;

/// The autograd step captured as a CUDA graph, one graph per batch length (the last batch of a
/// copy is shorter when `--batch` does not divide 5041).
struct GraphSteps {
    model: Autoencoder,
    params: Vec<Tensor>,
    m: Vec<Tensor>,
    v: Vec<Tensor>,
    /// Adam's step count, on the device.
    step: Tensor,
    adam: AdamConfig,
    shapes: Vec<ShapeGraph>,
    last: Option<Tensor>,
}

/// What one batch length needs: its fixed input, its capture (side stream and private pool), and
/// once warmed up, the graph and the loss tensor each replay overwrites.
struct ShapeGraph {
    input: Tensor,
    capture: Capture,
    warmups: usize,
    graph: Option<(Graph, Tensor)>,
}

impl GraphSteps {
    fn new(model: &Autoencoder, adam: AdamConfig) -> Result<GraphSteps> {
        let params = model.parameters();
        let device = params.first().map_or(Device::Cpu, |p| p.device());
        let m = params.iter().map(|p| p.zeros_like()).collect::<Result<_>>()?;
        let v = params.iter().map(|p| p.zeros_like()).collect::<Result<_>>()?;
        let step = Tensor::zeros(1, DType::F64, device)?;
        Ok(GraphSteps { model: model.clone(), params, m, v, step, adam, shapes: Vec::new(), last: None })
    }
}

/// Forward, backward and Adam on the fixed input: what is warmed up and captured.
fn autograd_step(
    model: &Autoencoder,
    params: &[Tensor],
    m: &[Tensor],
    v: &[Tensor],
    adam: &AdamConfig,
    step: &Tensor,
    x: &Tensor,
) -> Result<Tensor> {
    let loss = model.loss(x)?;
    let grads = loss.backward()?;
    let g: Vec<Tensor> = params
        .iter()
        .map(|p| grads.get(p).cloned().ok_or_else(|| Error::Backward("a weight got no gradient".into())))
        .collect::<Result<_>>()?;
    adam_step_counted(params, &g, m, v, adam, step)?;
    Ok(loss.detach())
}

impl Stepper for GraphSteps {
    fn step(&mut self, x: &Tensor) -> Result<()> {
        let i = match self.shapes.iter().position(|s| s.input.dims() == x.dims()) {
            Some(i) => i,
            None => {
                let Device::Cuda(o) = x.device() else {
                    return Err(Error::InvalidArgument("CUDA graphs need a CUDA device".into()));
                };
                let capture = Capture::new(&CudaDevice::get(o)?)?;
                self.shapes.push(ShapeGraph { input: x.zeros_like()?, capture, warmups: 0, graph: None });
                self.shapes.len() - 1
            }
        };
        let GraphSteps { model, params, m, v, step, adam, shapes, last } = self;
        let s = &mut shapes[i];
        s.input.set(x)?;
        let input = &s.input;
        let run = || autograd_step(model, params, m, v, adam, step, input);
        if s.warmups < WARMUP_STEPS {
            *last = Some(s.capture.warmup(run)?);
            s.warmups += 1;
            return Ok(());
        }
        if s.graph.is_none() {
            s.graph = Some(s.capture.capture(run)?);
        }
        if let Some((graph, loss)) = &s.graph {
            graph.replay()?;
            *last = Some(loss.clone());
        }
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
