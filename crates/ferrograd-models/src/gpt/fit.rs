//! The training loop of `gpt train` around a [`Run`]: steps, the loss read back every
//! `log_every` steps, throughput and MFU, validation and checkpoints between steps, the JSON-lines
//! log (`out/log.jsonl`), and the exported model at the end.

use super::dp::{mean_over_ranks, writes_files};
use super::hf;
use super::loader::{LoaderPos, StepInputs, TokenLoader};
use super::startup::StartupLog;
use super::train::{precision_guard, Precision, Run, RunInfo, TrainConfig};
use ferrograd_core::cuda::CudaDevice;
use ferrograd_core::{Device, Error, Result, Tensor};
use ferrograd_nn::optim::Optimizer;
use serde::Serialize;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// One logged step.
#[derive(Debug, Clone, Serialize)]
pub struct StepStats {
    pub step: u64,
    /// Mean loss over the steps since the last log.
    pub loss: f64,
    pub lr: f64,
    pub grad_norm: f64,
    pub tokens_per_s: f64,
    pub mfu: Option<f64>,
    /// Bytes ferrograd's allocator holds now and at most, on a GPU.
    pub mem_bytes: Option<usize>,
    pub peak_mem_bytes: Option<usize>,
    pub elapsed_s: f64,
}

pub enum Event<'a> {
    Started(&'a RunInfo),
    /// After every step (no host read): for a progress bar's position.
    Progress(u64),
    Logged(&'a StepStats),
    Validated {
        step: u64,
        loss: f64,
    },
    Saved {
        step: u64,
        path: &'a Path,
    },
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Summary {
    pub steps: u64,
    pub first_loss: Option<f64>,
    pub final_loss: Option<f64>,
    pub final_val_loss: Option<f64>,
    /// Tokens per second from the end of the warm-up steps to the end.
    pub tokens_per_s: f64,
    pub mfu: Option<f64>,
    pub peak_mem_bytes: Option<usize>,
    /// From the caller's `started` to the end of the first step.
    pub startup_s: f64,
    pub train_s: f64,
    pub checkpoint: Option<PathBuf>,
    pub exported: Option<PathBuf>,
    pub log: PathBuf,
}

/// The bf16 (or f32) dense peak FLOP/s of a GPU by its name, for MFU; `None` when unknown.
pub fn peak_flops(name: &str, precision: Precision) -> Option<f64> {
    let n = name.to_ascii_uppercase();
    let (bf16, f32) = if n.contains("H200") || (n.contains("H100") && !n.contains("PCIE") && !n.contains("NVL")) {
        (989.4e12, 66.9e12)
    } else if n.contains("H100") && n.contains("NVL") {
        (835.0e12, 60.0e12)
    } else if n.contains("H100") {
        (756.0e12, 51.2e12)
    } else if n.contains("A100") {
        (312.0e12, 19.5e12)
    } else if n.contains("L40S") {
        (362.0e12, 91.6e12)
    } else if n.contains("RTX 4090") {
        (165.2e12, 82.6e12)
    } else {
        return None;
    };
    Some(if precision == Precision::Bf16 { bf16 } else { f32 })
}

/// (allocated now, peak) of ferrograd's allocator on a GPU.
pub(crate) fn memory(device: Device) -> Option<(usize, usize)> {
    let Device::Cuda(o) = device else { return None };
    let s = CudaDevice::get(o).ok()?.memory_stats();
    Some((s.allocated_bytes.current, s.allocated_bytes.peak))
}

fn json_err(e: serde_json::Error) -> Error {
    Error::InvalidArgument(e.to_string())
}

/// Appends JSON lines to `out/log.jsonl` (data parallel: on rank 0 only; `file` is `None` on
/// the others).
pub(crate) struct JsonLog {
    file: Option<std::fs::File>,
    pub(crate) path: PathBuf,
}

impl JsonLog {
    pub(crate) fn open(out: &Path, append: bool, enabled: bool) -> Result<JsonLog> {
        if !enabled {
            return Ok(JsonLog { file: None, path: out.join("log.jsonl") });
        }
        std::fs::create_dir_all(out)
            .map_err(|e| Error::File { path: out.display().to_string(), msg: format!("creating: {e}") })?;
        let path = out.join("log.jsonl");
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(append)
            .write(true)
            .truncate(!append)
            .open(&path)
            .map_err(|e| Error::File { path: path.display().to_string(), msg: format!("opening the log: {e}") })?;
        Ok(JsonLog { file: Some(file), path })
    }

    pub(crate) fn write(&mut self, v: serde_json::Value) -> Result<()> {
        let Some(file) = self.file.as_mut() else { return Ok(()) };
        writeln!(file, "{v}")
            .map_err(|e| Error::File { path: self.path.display().to_string(), msg: format!("writing the log: {e}") })
    }
}

/// Train as `cfg` says, reporting through `on_event`. `started` is when the process started (for
/// the startup time).
pub fn train(cfg: TrainConfig, started: Instant, mut on_event: impl FnMut(Event<'_>)) -> Result<Summary> {
    let mut startup = StartupLog::new(started, cfg.device);
    startup.mark("process start to training (arguments, device choice)");
    let mut run = Run::new_logged(cfg, &mut startup)?;
    let writer = writes_files(run.cfg.dist.as_ref());
    if let (Some(p), true) = (&run.cfg.save_init, writer) {
        if run.step != 0 {
            return Err(Error::InvalidArgument(
                "--save-init writes the initial weights; it cannot follow --resume".into(),
            ));
        }
        hf::save_weights(&run.model, p)?;
        run.info.notes.push(format!("initial weights written to {}", p.display()));
    }
    on_event(Event::Started(&run.info));
    let mut log = JsonLog::open(&run.cfg.out, run.cfg.resume, writer)?;
    log.write(serde_json::json!({ "kind": "start", "settings": run.settings(), "info": &run.info }))?;
    let mut summary = Summary { log: log.path.clone(), ..Default::default() };
    startup.mark("--save-init, the log");
    let mut plan = FitPlan {
        steps: run.cfg.steps,
        log_every: run.cfg.log_every,
        val_every: run.cfg.val_every,
        save_every: run.cfg.save_every,
        device: run.cfg.device,
        flops_per_token: run.cfg.model.flops_per_token(run.cfg.context),
        startup,
    };
    fit_loop(&mut run, &mut plan, &mut log, &mut summary, &mut on_event)?;
    if run.step > 0 && writer {
        let dir = run.cfg.out.join("model");
        hf::save_pretrained(&run.model, &dir)?;
        summary.exported = Some(dir);
    }
    write_summary(&mut log, &summary)?;
    Ok(summary)
}

/// What the shared training loop ([`fit_loop`]) needs of a run: `gpt train`'s [`Run`] and `mamba
/// train`'s `MambaRun` step, evaluate and checkpoint their own way; the loop around them (log
/// windows, throughput and MFU, the steady-state clock, validation and checkpoints between steps,
/// the summary's figures) is one.
pub(crate) trait FitRun {
    /// The next batch, then one optimizer step: `(loss, gradient norm)` as device scalars.
    fn train_step(&mut self) -> Result<(Tensor, Tensor)>;
    /// Optimizer steps taken so far (a resumed run counts the earlier ones).
    fn steps_done(&self) -> u64;
    /// How the last step ran (eager, a warm-up before a capture, the capture, a replay), for the
    /// startup breakdown.
    fn last_step_kind(&self) -> &'static str {
        "step"
    }
    /// The learning rate of the step just taken.
    fn lr(&self) -> f64;
    fn info(&self) -> &RunInfo;
    /// Mean validation loss, or `None` without a validation split.
    fn evaluate(&mut self) -> Result<Option<f64>>;
    fn save_checkpoint(&mut self) -> Result<PathBuf>;
    /// A window of summed losses as every process should report it (data parallel: the mean over
    /// the ranks).
    fn window_loss(&self, w: Tensor) -> Result<Tensor> {
        Ok(w)
    }
}

/// Mean loss over the first `n` micro-batches `[batch, context]` of the validation split `val`
/// (from its start, under `precision`, no gradients): the losses are summed on the device and
/// read back once. `None` without a split or with `n == 0`. Both runs' `evaluate`.
pub(crate) fn val_loss(
    val: Option<&mut TokenLoader>,
    n: usize,
    (batch, context, device, precision): (usize, usize, Device, Precision),
    loss: impl Fn(&Tensor, &Tensor) -> Result<Tensor>,
) -> Result<Option<f64>> {
    let Some(val) = val else { return Ok(None) };
    if n == 0 {
        return Ok(None);
    }
    val.set_position(LoaderPos::default())?;
    let _g = ferrograd_core::no_grad();
    let _ac = precision_guard(precision)?;
    let bufs = StepInputs::new(1, batch, context, device)?;
    let mut sum: Option<Tensor> = None;
    for _ in 0..n {
        bufs.fill_from(val)?;
        let l = loss(&bufs.x[0], &bufs.y[0])?;
        sum = Some(match sum {
            Some(s) => s.add(&l)?,
            None => l,
        });
    }
    Ok(sum.map(|s| s.item_f64()).transpose()?.map(|s| s / n as f64))
}

/// Steps the startup breakdown lists: the eager warm-ups, the capture and the first replay.
const STARTUP_STEPS: u64 = super::settings::GRAPH_WARMUP as u64 + 2;

/// The loop's settings.
pub(crate) struct FitPlan {
    pub steps: u64,
    pub log_every: u64,
    /// Validation every this many steps (0: only at the end).
    pub val_every: u64,
    /// A checkpoint every this many steps (0: only at the end).
    pub save_every: u64,
    pub device: Device,
    pub flops_per_token: f64,
    /// The start's phases from the process start (the summary's startup time runs from it to the
    /// first step's end); the first steps add theirs.
    pub startup: StartupLog,
}

/// [`FitRun`]'s methods for a run type with the fields `step`, `opt` and `info` and inherent
/// `train_step`, `evaluate` and `save_checkpoint` (both runs are written that way).
macro_rules! fit_run_by_fields {
    ($run:ty) => {
        fn train_step(&mut self) -> Result<(Tensor, Tensor)> {
            <$run>::train_step(self)
        }
        fn steps_done(&self) -> u64 {
            self.step
        }
        fn lr(&self) -> f64 {
            self.opt.lr()
        }
        fn info(&self) -> &RunInfo {
            &self.info
        }
        fn evaluate(&mut self) -> Result<Option<f64>> {
            <$run>::evaluate(self)
        }
        fn save_checkpoint(&mut self) -> Result<PathBuf> {
            <$run>::save_checkpoint(self)
        }
    };
}
pub(crate) use fit_run_by_fields;

impl FitRun for Run {
    fit_run_by_fields!(Run);
    fn last_step_kind(&self) -> &'static str {
        self.last_step_kind
    }
    fn window_loss(&self, w: Tensor) -> Result<Tensor> {
        mean_over_ranks(self.cfg.dist.as_ref(), w)
    }
}

/// Steps until `plan.steps`: the loss summed on the device and read back every `log_every`
/// steps (a `train` record and [`Event::Logged`]; a non-finite mean stops the run), validation
/// and checkpoints between steps (their time left out of the throughput), and the summary's
/// steps, times, tokens/s (from the end of the warm-up steps), MFU and peak memory.
/// FERROGRAD_PROFILE=1 prints the device time per kernel over the steady steps.
pub(crate) fn fit_loop<R: FitRun>(
    run: &mut R,
    plan: &mut FitPlan,
    log: &mut JsonLog,
    summary: &mut Summary,
    on_event: &mut impl FnMut(Event<'_>),
) -> Result<()> {
    let device = plan.device;
    let (steps, tokens_per_step, start_step) = (plan.steps, run.info().tokens_per_step, run.info().start_step);
    let skip = (steps / 10).clamp(1, 10).min(steps.saturating_sub(1));
    let t0 = Instant::now();
    let mut window: Option<Tensor> = None;
    let (mut window_steps, mut window_start) = (0u64, Instant::now());
    let mut steady: Option<(u64, Instant)> = None;
    // Time spent validating and checkpointing, left out of the throughput.
    let mut paused = std::time::Duration::ZERO;
    while run.steps_done() < steps {
        let (loss, norm) = run.train_step()?;
        let step = run.steps_done();
        window = Some(match window.take() {
            Some(w) => w.add(&loss)?,
            None => loss,
        });
        window_steps += 1;
        on_event(Event::Progress(step));
        if step == start_step + 1 {
            device.synchronize()?;
            summary.startup_s = plan.startup.elapsed_s();
        }
        // The breakdown follows the steps up to the first replay of a captured step.
        if plan.startup.is_on() && step <= start_step + STARTUP_STEPS {
            plan.startup.mark(format!("step {} ({})", step - start_step, run.last_step_kind()));
            if step == start_step + STARTUP_STEPS || step == steps {
                plan.startup.print_once();
            }
        }
        if step == start_step + skip.max(1) && steady.is_none() {
            device.synchronize()?;
            steady = Some((step, Instant::now()));
            if device.is_cuda() {
                ferrograd_core::cuda::profile::reset();
            }
        }
        let last = step == steps;
        if step.is_multiple_of(plan.log_every) || last {
            let mean = window.take().map(|w| run.window_loss(w)).transpose()?;
            let sum = mean.map(|w| w.item_f64()).transpose()?.unwrap_or(f64::NAN);
            let secs = window_start.elapsed().as_secs_f64();
            let tps = (window_steps as usize * tokens_per_step) as f64 / secs.max(1e-9);
            let mem = memory(device);
            let stats = StepStats {
                step,
                loss: sum / window_steps as f64,
                lr: run.lr(),
                grad_norm: norm.item_f64()?,
                tokens_per_s: tps,
                mfu: run.info().peak_flops.map(|p| tps * plan.flops_per_token / p),
                mem_bytes: mem.map(|m| m.0),
                peak_mem_bytes: mem.map(|m| m.1),
                elapsed_s: t0.elapsed().as_secs_f64(),
            };
            if !stats.loss.is_finite() {
                return Err(Error::InvalidArgument(format!(
                    "the loss became {} at step {step}; try a lower --lr or --precision f32",
                    stats.loss
                )));
            }
            summary.first_loss.get_or_insert(stats.loss);
            summary.final_loss = Some(stats.loss);
            let mut line = serde_json::to_value(&stats).map_err(json_err)?;
            line["kind"] = "train".into();
            log.write(line)?;
            on_event(Event::Logged(&stats));
            (window_steps, window_start) = (0, Instant::now());
        }
        if last && device.is_cuda() && ferrograd_core::cuda::profile::enabled() {
            // FERROGRAD_PROFILE=1: device time per kernel over the steady steps, before validation.
            let n = steady.map_or(step, |(s0, _)| step.saturating_sub(s0));
            eprint!("{}", ferrograd_core::cuda::profile::report_table(n)?);
        }
        let pause = Instant::now();
        if (plan.val_every > 0 && step.is_multiple_of(plan.val_every)) || last {
            if let Some(v) = run.evaluate()? {
                summary.final_val_loss = Some(v);
                log.write(serde_json::json!({ "kind": "val", "step": step, "val_loss": v }))?;
                on_event(Event::Validated { step, loss: v });
            }
            window_start = Instant::now();
        }
        if (plan.save_every > 0 && step.is_multiple_of(plan.save_every)) || last {
            let p = run.save_checkpoint()?;
            on_event(Event::Saved { step, path: &p });
            summary.checkpoint = Some(p);
            window_start = Instant::now();
        }
        if steady.is_some() {
            paused += pause.elapsed();
        }
    }
    device.synchronize()?;
    summary.train_s = t0.elapsed().as_secs_f64();
    summary.steps = run.steps_done() - start_step;
    if let Some((s0, i0)) = steady {
        let n = run.steps_done().saturating_sub(s0);
        if n > 0 {
            let secs = i0.elapsed().saturating_sub(paused).as_secs_f64();
            summary.tokens_per_s = (n as usize * tokens_per_step) as f64 / secs.max(1e-9);
        }
    }
    if summary.tokens_per_s == 0.0 && summary.train_s > 0.0 {
        summary.tokens_per_s = (summary.steps as usize * tokens_per_step) as f64 / summary.train_s;
    }
    summary.mfu = run.info().peak_flops.map(|p| summary.tokens_per_s * plan.flops_per_token / p);
    summary.peak_mem_bytes = memory(device).map(|m| m.1);
    Ok(())
}

/// The closing `summary` record of `log.jsonl`.
pub(crate) fn write_summary(log: &mut JsonLog, summary: &Summary) -> Result<()> {
    let mut line = serde_json::to_value(summary).map_err(json_err)?;
    line["kind"] = "summary".into();
    log.write(line)
}
