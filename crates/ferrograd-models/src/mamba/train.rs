//! `mamba train`: the Mamba LM on `gpt prepare`'s token shards, with `gpt train`'s pieces: the
//! token loader and fixed step buffers (`gpt::loader`), AdamW in two groups (`GptAdamW`, no decay
//! on norms, biases, `A_log` and `D`, as mamba_ssm's `_no_weight_decay`), the warm-up + cosine
//! schedule, clipping, bf16 autocast, the events and log records of `gpt::fit` (`log.jsonl`),
//! and on CUDA the step (forward with the fused classifier, backward, clipping, AdamW) captured
//! once as a CUDA graph and replayed. One micro-batch per step; no resume.

use super::model::{MambaLm, MambaLmConfig};
use crate::gpt::fit::{fit_loop, fit_run_by_fields, write_summary, FitPlan, FitRun, JsonLog};
use crate::gpt::loader::{StepInputs, TokenLoader};
use crate::gpt::optim::GptAdamW;
use crate::gpt::train::{device_name, precision_guard, Event, Precision, RunInfo, Summary, GRAPH_WARMUP};
use ferrograd_core::cuda::{Capture, CudaDevice, Graph};
use ferrograd_core::{Device, Error, GradStore, Result, Tensor};
use ferrograd_nn::checkpoint::{self, TrainState};
use ferrograd_nn::optim::{clip_grad_factor, grad_norm, GradAccumulator, LrSchedule, Optimizer};
use ferrograd_nn::Module;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Debug, Clone)]
pub struct MambaTrainConfig {
    pub model: MambaLmConfig,
    /// Directory of `train_*.bin` / `val_*.bin` shards (`gpt prepare`).
    pub data: PathBuf,
    /// `log.jsonl` and `checkpoint.safetensors` go here.
    pub out: PathBuf,
    pub device: Device,
    pub steps: u64,
    pub batch: usize,
    pub context: usize,
    pub lr: f64,
    pub min_lr_ratio: f64,
    /// `None`: `min(700, steps / 10)`.
    pub warmup: Option<u64>,
    pub weight_decay: f64,
    pub grad_clip: f64,
    pub precision: Precision,
    pub seed: u64,
    pub log_every: u64,
    /// Validation every this many steps (0: only at the end).
    pub val_every: u64,
    pub val_batches: usize,
    /// On CUDA, replay the step as a CUDA graph after [`GRAPH_WARMUP`] eager steps.
    pub graph: bool,
}

impl MambaTrainConfig {
    /// The small model, 16 x 256 tokens a step, lr 1.5e-3 (mamba's small-model rate), wd 0.1,
    /// clip 1, bf16 autocast on a GPU (f32 on the CPU), 500 steps.
    pub fn defaults(data: PathBuf, out: PathBuf, device: Device) -> MambaTrainConfig {
        MambaTrainConfig {
            model: MambaLmConfig::small(),
            data,
            out,
            device,
            steps: 500,
            batch: 16,
            context: 256,
            lr: 1.5e-3,
            min_lr_ratio: 0.1,
            warmup: None,
            weight_decay: 0.1,
            grad_clip: 1.0,
            precision: if device.is_cuda() { Precision::Bf16 } else { Precision::F32 },
            seed: 0,
            log_every: 10,
            val_every: 250,
            val_batches: 10,
            graph: true,
        }
    }

    pub fn schedule(&self) -> LrSchedule {
        let warmup = self.warmup.unwrap_or((self.steps / 10).min(700));
        LrSchedule::WarmupCosine { peak: self.lr, warmup, total: self.steps, min: self.lr * self.min_lr_ratio }
    }

    fn validate(&self) -> Result<()> {
        self.model.validate()?;
        let bad = |m: String| Err(Error::InvalidArgument(m));
        if self.steps == 0 || self.batch == 0 || self.context == 0 || self.log_every == 0 {
            return bad(format!(
                "--steps {}, --batch {}, --context {} and --log-every {} must be positive",
                self.steps, self.batch, self.context, self.log_every
            ));
        }
        if !(self.lr.is_finite() && self.lr > 0.0 && (0.0..=1.0).contains(&self.min_lr_ratio)) {
            return bad(format!("--lr {} must be positive, --min-lr-ratio {} in [0, 1]", self.lr, self.min_lr_ratio));
        }
        if !(self.weight_decay >= 0.0 && self.grad_clip >= 0.0) {
            return bad(format!("--weight-decay {} and --clip {} must be >= 0", self.weight_decay, self.grad_clip));
        }
        Ok(())
    }
}

/// The captured step: warm-up count, then the graph and the `(loss, norm)` each replay rewrites.
struct StepGraph {
    capture: Capture,
    warmups: usize,
    graph: Option<(Graph, (Tensor, Tensor))>,
}

pub struct MambaRun {
    pub cfg: MambaTrainConfig,
    pub model: MambaLm,
    pub opt: GptAdamW,
    pub schedule: LrSchedule,
    pub train: TokenLoader,
    pub val: Option<TokenLoader>,
    pub inputs: StepInputs,
    accum: GradAccumulator,
    step_graph: Option<StepGraph>,
    pub step: u64,
    pub info: RunInfo,
}

/// One step's device work on the fixed buffers: forward with the fused classifier, backward from
/// the logits, clipping, `update`. Reads nothing back.
fn step_body(
    model: &MambaLm,
    inputs: &StepInputs,
    clip: f64,
    precision: Precision,
    accum: &mut GradAccumulator,
    update: impl FnOnce(&GradStore, Option<&Tensor>) -> Result<()>,
) -> Result<(Tensor, Tensor)> {
    accum.zero_grad();
    let loss = {
        let _ac = precision_guard(precision)?;
        let (loss, logits, dlogits) = model.loss_and_logits_grad(&inputs.x[0], &inputs.y[0], 1.0)?;
        accum.backward_seeded(logits, &dlogits)?;
        loss
    };
    let params = model.parameters();
    // On CUDA the clip factor is applied by the optimizer as it reads the gradients.
    let (norm, factor) = if clip > 0.0 {
        clip_grad_factor(accum.grads_mut(), &params, clip)?
    } else {
        (grad_norm(accum.grads(), &params)?, None)
    };
    update(accum.grads(), factor.as_ref())?;
    accum.zero_grad();
    Ok((loss, norm))
}

impl MambaRun {
    pub fn new(cfg: MambaTrainConfig) -> Result<MambaRun> {
        cfg.validate()?;
        if let Device::Cuda(o) = cfg.device {
            // The run's kernel modules start compiling now, all at once, while the model is built.
            drop(CudaDevice::get(o)?.warm(&super::kernels::modules(&cfg)?));
        }
        let model = MambaLm::new(cfg.model, cfg.seed, cfg.device)?;
        let no_decay = |n: &str, t: &Tensor| t.rank() < 2 || n.ends_with("A_log") || n.ends_with(".D");
        // The checkpoint holds the padded embedding (the model's own view), so its moments stay whole.
        let rows = cfg.model.padded_vocab();
        let opt =
            GptAdamW::with_groups(model.named_parameters(), rows, |n, t| !no_decay(n, t), cfg.lr, cfg.weight_decay)?;
        let train = TokenLoader::new(&cfg.data, "train", cfg.batch, cfg.context)?;
        let mut notes = vec![];
        let val = match TokenLoader::new(&cfg.data, "val", cfg.batch, cfg.context) {
            Ok(v) => Some(v),
            Err(e) => {
                notes.push(format!("no validation: {e}"));
                None
            }
        };
        let inputs = StepInputs::new(1, cfg.batch, cfg.context, cfg.device)?;
        let info = RunInfo {
            parameters: cfg.model.num_parameters(),
            micro_batch: cfg.batch,
            grad_accum: 1,
            world: 1,
            tokens_per_step: cfg.batch * cfg.context,
            train_tokens: train.total_tokens(),
            val_tokens: val.as_ref().map(|v| v.total_tokens()),
            start_step: 0,
            device: device_name(cfg.device),
            peak_flops: match cfg.device {
                Device::Cuda(o) => {
                    CudaDevice::get(o).ok().and_then(|d| crate::gpt::train::peak_flops(&d.info.name, cfg.precision))
                }
                Device::Cpu => None,
            },
            auto_batch: None,
            notes,
        };
        let step_graph = match cfg.device {
            Device::Cuda(o) if cfg.graph => {
                Some(StepGraph { capture: Capture::new(&CudaDevice::get(o)?)?, warmups: 0, graph: None })
            }
            _ => None,
        };
        let schedule = cfg.schedule();
        Ok(MambaRun {
            cfg,
            model,
            opt,
            schedule,
            train,
            val,
            inputs,
            accum: GradAccumulator::new(),
            step_graph,
            step: 0,
            info,
        })
    }

    /// The next micro-batch into the step buffers, then one optimizer step: `(loss, gradient
    /// norm)` as device scalars (a replayed step's are overwritten by the next replay).
    pub fn train_step(&mut self) -> Result<(Tensor, Tensor)> {
        self.inputs.fill_from(&mut self.train)?;
        self.opt.set_lr(self.schedule.lr_at(self.step));
        let on_device = self.cfg.device.is_cuda();
        if on_device {
            self.opt.prepare_device_step()?;
        }
        let MambaRun { model, opt, accum, inputs, cfg, step_graph, .. } = self;
        let (clip, precision) = (cfg.grad_clip, cfg.precision);
        let out = match step_graph {
            Some(sg) => {
                let mut run = || step_body(model, inputs, clip, precision, accum, |g, f| opt.step_device(g, f));
                if sg.warmups < GRAPH_WARMUP {
                    sg.warmups += 1;
                    sg.capture.warmup(run)?
                } else {
                    if sg.graph.is_none() {
                        sg.graph = Some(sg.capture.capture(&mut run)?);
                    }
                    let Some((graph, out)) = &sg.graph else { unreachable!("the graph was just captured") };
                    graph.replay()?;
                    out.clone()
                }
            }
            None if on_device => step_body(model, inputs, clip, precision, accum, |g, f| opt.step_device(g, f))?,
            None => step_body(model, inputs, clip, precision, accum, |g, f| opt.step_host(g, f))?,
        };
        if on_device {
            self.opt.count_step();
        }
        self.step += 1;
        Ok(out)
    }

    /// Mean loss over the first `val_batches` micro-batches of the validation split.
    pub fn evaluate(&mut self) -> Result<Option<f64>> {
        let c = &self.cfg;
        let sizes = (c.batch, c.context, c.device, c.precision);
        crate::gpt::fit::val_loss(self.val.as_mut(), c.val_batches, sizes, |x, y| self.model.loss(x, y))
    }

    /// `out/checkpoint.safetensors`: the weights (mamba_ssm's names), AdamW's moments, the step.
    pub fn save_checkpoint(&self) -> Result<PathBuf> {
        std::fs::create_dir_all(&self.cfg.out).map_err(|e| Error::File {
            path: self.cfg.out.display().to_string(),
            msg: format!("creating the output directory: {e}"),
        })?;
        let path = self.cfg.out.join("checkpoint.safetensors");
        let mut state = TrainState { step: self.step, ..Default::default() };
        let cfg = serde_json::to_string(&self.cfg.model).map_err(|e| Error::InvalidArgument(e.to_string()))?;
        state.extra.insert("mamba_config".into(), cfg);
        checkpoint::save(&path, &self.model, Some(&self.opt), &state)?;
        Ok(path)
    }
}

impl FitRun for MambaRun {
    fit_run_by_fields!(MambaRun);
}

/// Train as `cfg` says, reporting through `on_event` (`gpt train`'s events), in `gpt train`'s
/// loop (`gpt::fit::fit_loop`: a checkpoint at the end); the log lines are `gpt train`'s records
/// (`kind` start / train / val / summary).
pub fn train(cfg: MambaTrainConfig, started: Instant, mut on_event: impl FnMut(Event<'_>)) -> Result<Summary> {
    let mut run = MambaRun::new(cfg)?;
    on_event(Event::Started(&run.info));
    let mut log = JsonLog::open(&run.cfg.out, false, true)?;
    let model_json = serde_json::to_value(run.cfg.model).map_err(|e| Error::InvalidArgument(e.to_string()))?;
    log.write(serde_json::json!({ "kind": "start", "model": model_json, "info": &run.info }))?;
    let mut summary = Summary { log: log.path.clone(), ..Default::default() };
    let mut plan = FitPlan {
        steps: run.cfg.steps,
        log_every: run.cfg.log_every,
        val_every: run.cfg.val_every,
        save_every: 0,
        device: run.cfg.device,
        flops_per_token: run.cfg.model.flops_per_token(),
        startup: crate::gpt::startup::StartupLog::new(started, run.cfg.device),
    };
    fit_loop(&mut run, &mut plan, &mut log, &mut summary, &mut on_event)?;
    write_summary(&mut log, &summary)?;
    Ok(summary)
}
