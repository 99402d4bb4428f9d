//! `gpt train`: the training run. One optimizer step is
//!
//! 1. [`Run::load_inputs`] (host side): the loader's next `k` micro-batches copied into the fixed
//!    `[B, T]` device buffers of [`StepInputs`];
//! 2. [`Run::compute_step`] (device side, no host read): for each micro-batch forward and backward
//!    (loss scaled by `1/k`, gradients summed), clipping by global norm, AdamW; the mean loss and
//!    the gradient norm stay on the device as 0-d tensors.
//!
//! Step 2 touches only tensors that live across steps (parameters, moments, the input buffers), so
//! it is the unit a CUDA graph captures once the runtime can (the learning rate is then the one
//! host value to move into device memory). The loss is read back every `log_every` steps from a
//! device running sum; validation, checkpoints and the log happen between steps.
//!
//! (About 690 lines: the run's setup, its step and its checkpoint and resume share the `Run`
//! state; the training loop itself is in `fit.rs`.)

use super::dp::{rank_world, writes_files, GradSync};
use super::hf;
use super::loader::{LoaderPos, StepInputs, TokenLoader};
use super::model::{Gpt, HfView};
use super::optim::GptAdamW;
use super::startup::StartupLog;
use super::zero::ShardKeys;
use ferrograd_core::cuda::{Capture, CudaDevice, Graph, ShadowSet};
use ferrograd_core::{DType, Device, Error, GradStore, Result, Tensor};
use ferrograd_nn::amp::{autocast, AutocastGuard};
use ferrograd_nn::checkpoint::{self, TrainState};
use ferrograd_nn::optim::{clip_grad_factor, grad_norm, GradAccumulator, LrSchedule, Optimizer};
use std::path::{Path, PathBuf};

pub use super::fit::{peak_flops, train, Event, StepStats, Summary};
pub use super::settings::{BatchSize, Precision, RunInfo, RunSettings, TrainConfig, GRAPH_WARMUP};

/// One step's device work over fixed buffers: what [`Run::compute_step`] runs or captures, on one
/// GPU and on each rank of a data-parallel group alike.
struct StepBody<'a> {
    model: &'a Gpt,
    inputs: &'a StepInputs,
    k: usize,
    clip: f64,
    precision: Precision,
    /// ZeRO-1: the optimizer steps on this rank's shard of the gradient (`zero.rs`).
    shard: Option<&'a ShardKeys>,
}

impl StepBody<'_> {
    /// For each micro-batch the forward with the fused classifier (its logits' gradient, scaled by
    /// `1/k`, formed in the forward) and the backward from the logits; then clipping and `update`.
    /// Data parallel (`sync`): the last micro-batch's backward averages the gradients over the
    /// ranks in buckets as they become final (earlier micro-batches only accumulate: accumulation
    /// communicates once per step), and compute waits for the averages before clipping, so every
    /// rank clips and updates on the same global gradient. ZeRO-1 (`shard`): each rank clips its
    /// shard of the averages by the global norm and updates its shard; `end_step` all-gathers.
    fn run(
        &self,
        accum: &mut GradAccumulator,
        mut sync: Option<&mut (dyn GradSync + 'static)>,
        update: impl FnOnce(&GradStore, Option<&Tensor>) -> Result<()>,
    ) -> Result<(Tensor, Tensor)> {
        // NVTX ranges (a no-op unless a tool listens): an nsys timeline of a step reads as forward,
        // backward (backprop.rs opens its own), gradient sync, clipping and optimizer.
        use ferrograd_core::cuda::nvtx::range;
        let _step = range("gpt step");
        accum.zero_grad();
        let k = self.k;
        let mut total: Option<Tensor> = None;
        {
            let _ac = precision_guard(self.precision)?;
            for i in 0..k {
                let fwd = range("forward");
                let (loss, logits, dlogits) =
                    self.model.loss_and_logits_grad(&self.inputs.x[i], &self.inputs.y[i], 1.0 / k as f64)?;
                drop(fwd);
                memory_phase(&loss, "forward");
                // The logits are the step's one handle on the graph: the walk takes them and
                // frees the activations as it goes (the loss and dlogits hold no graph).
                match sync.as_deref_mut() {
                    Some(s) => s.backward_seeded(logits, &dlogits, accum.grads_mut(), i + 1 == k)?,
                    None => accum.backward_seeded(logits, &dlogits)?,
                }
                memory_phase(&loss, "backward");
                total = Some(match total {
                    Some(s) => s.add(&loss)?,
                    None => loss,
                });
            }
        }
        if let Some(s) = sync.as_deref_mut() {
            let _r = range("gradient sync");
            s.reduce_grads(accum.grads_mut())?;
        }
        let norm = match (sync.as_deref_mut(), self.shard) {
            (Some(s), Some(keys)) => {
                let clipped = range("clip");
                let (norm, shards) = super::zero::clip_shards(s, self.clip)?;
                let store = keys.store(&shards)?;
                drop(clipped);
                let _r = range("optimizer");
                update(&store, None)?;
                norm
            }
            _ => {
                let params: Vec<Tensor> = self.model.params().into_iter().map(|(_, t)| t).collect();
                let clipped = range("clip");
                // On CUDA the factor rides into AdamW, which reads the gradients times it.
                let (norm, factor) = if self.clip > 0.0 {
                    clip_grad_factor(accum.grads_mut(), &params, self.clip)?
                } else {
                    (grad_norm(accum.grads(), &params)?, None)
                };
                drop(clipped);
                let _r = range("optimizer");
                update(accum.grads(), factor.as_ref())?;
                norm
            }
        };
        if let Some(s) = sync {
            s.end_step(accum.grads())?;
        }
        if let Some(t) = &total {
            memory_phase(t, "optimizer");
        }
        accum.zero_grad();
        let loss = total.ok_or_else(|| Error::InvalidArgument("no micro-batches".into()))?;
        Ok((if k > 1 { loss.mul_scalar(1.0 / k as f64)? } else { loss }, norm))
    }
}

/// `FERROGRAD_MEMORY_PHASES=1`: the allocator's allocated bytes (current and peak) after the
/// forward, the backward (each micro-batch's) and the optimizer, the first nine of those, to
/// stderr: where in a step the peak is (`bench/gpt2_torch.py` prints the same with
/// `MEMORY_PHASES=1`).
fn memory_phase(on: &Tensor, phase: &str) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static ENABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    static PRINTED: AtomicUsize = AtomicUsize::new(0);
    if !*ENABLED.get_or_init(|| std::env::var("FERROGRAD_MEMORY_PHASES").is_ok_and(|v| v == "1")) {
        return;
    }
    let n = PRINTED.fetch_add(1, Ordering::Relaxed);
    if n >= 9 {
        return;
    }
    if let Some((current, peak)) = super::fit::memory(on.device()) {
        let g = (1u64 << 30) as f64;
        eprintln!(
            "memory #{} after {phase}: allocated {:.3} GiB, peak {:.3} GiB",
            n + 1,
            current as f64 / g,
            peak as f64 / g
        );
    }
}

pub(crate) fn device_name(device: Device) -> String {
    match device {
        Device::Cpu => "cpu".to_string(),
        Device::Cuda(o) => match CudaDevice::get(o) {
            Ok(d) => format!("cuda:{o} ({})", d.info.name),
            Err(_) => format!("cuda:{o}"),
        },
    }
}

fn json_err(e: serde_json::Error) -> Error {
    Error::InvalidArgument(e.to_string())
}

pub(crate) fn precision_guard(p: Precision) -> Result<Option<AutocastGuard>> {
    Ok(match p {
        Precision::Bf16 => Some(autocast(DType::BF16)?),
        Precision::F32 => None,
    })
}

/// The captured step: its side stream and pool, the warm-up steps taken, then the graph and the
/// `(loss, norm)` tensors each replay overwrites.
struct StepGraph {
    capture: Capture,
    warmups: usize,
    graph: Option<(Graph, (Tensor, Tensor))>,
}

pub struct Run {
    pub cfg: TrainConfig,
    step_graph: Option<StepGraph>,
    pub model: Gpt,
    pub opt: GptAdamW,
    pub schedule: LrSchedule,
    pub train: TokenLoader,
    pub val: Option<TokenLoader>,
    pub inputs: StepInputs,
    accum: GradAccumulator,
    /// Data parallel: averages the gradients over the ranks inside the step body
    /// (`GptDist::grad_sync`).
    sync: Option<Box<dyn GradSync>>,
    pub step: u64,
    pub micro_batch: usize,
    pub grad_accum: usize,
    pub info: RunInfo,
    /// How the last step ran (for the startup breakdown).
    pub(crate) last_step_kind: &'static str,
    /// The projections' bf16 weights, kept by AdamW (see [`Run::shadow_set`]).
    shadows: Option<ShadowSet>,
}

impl Run {
    pub fn checkpoint_path(out: &Path) -> PathBuf {
        out.join("checkpoint.safetensors")
    }

    /// Build the model (GPT-2 init, `--init` weights, or the checkpoint when resuming), the
    /// optimizer and the loaders; choose the micro-batch.
    pub fn new(cfg: TrainConfig) -> Result<Run> {
        Self::new_logged(cfg, &mut StartupLog::off())
    }

    /// [`Run::new`], ending a phase of `startup` after each part (device, model, optimizer, data,
    /// buffers).
    pub fn new_logged(cfg: TrainConfig, startup: &mut StartupLog) -> Result<Run> {
        cfg.model.validate()?;
        if cfg.context == 0 || cfg.context > cfg.model.n_positions {
            return Err(Error::InvalidArgument(format!(
                "--context {} must be between 1 and the model's n_positions {}",
                cfg.context, cfg.model.n_positions
            )));
        }
        if cfg.steps == 0 && cfg.save_init.is_none() {
            return Err(Error::InvalidArgument("--steps must be positive".into()));
        }
        if cfg.log_every == 0 {
            return Err(Error::InvalidArgument("--log-every must be positive".into()));
        }
        if !(cfg.lr.is_finite() && cfg.lr > 0.0) {
            return Err(Error::InvalidArgument(format!("--lr {} must be positive", cfg.lr)));
        }
        if !(0.0..=1.0).contains(&cfg.min_lr_ratio) {
            return Err(Error::InvalidArgument(format!("--min-lr-ratio {} must be in [0, 1]", cfg.min_lr_ratio)));
        }
        if !(cfg.weight_decay >= 0.0 && cfg.grad_clip >= 0.0) {
            return Err(Error::InvalidArgument(format!(
                "--weight-decay {} and --clip {} must be >= 0",
                cfg.weight_decay, cfg.grad_clip
            )));
        }
        let mut notes = vec![];
        if let Device::Cuda(o) = cfg.device {
            let dev = CudaDevice::get(o)?;
            // The run's kernel modules start compiling now, all at once, while the model is built
            // (on a warm kernel cache: a few disk reads).
            drop(dev.warm(&super::kernels::modules(&cfg, &dev)?));
            startup.mark("device open (context, streams, cuBLAS handle)");
        }
        let mut model = Gpt::new(cfg.model, cfg.seed, cfg.device)?;
        startup.mark("model init (weights drawn on the device)");
        model.recompute_gelu = cfg.recompute_gelu;
        if cfg.qat {
            model.linears = super::quant::Linears::Qat;
            notes.push(
                "QAT: int8 fake quantization of the block projections (weights per channel, inputs per token)".into(),
            );
        }
        if let Some(init) = &cfg.init {
            let src = hf::Source::locate(init)?;
            let (file_cfg, _) = hf::read_config(&src)?;
            if file_cfg != cfg.model {
                return Err(Error::InvalidArgument(format!(
                    "--init {}: its config {file_cfg:?} differs from the run's {:?}",
                    init.display(),
                    cfg.model
                )));
            }
            hf::load_weights(&model, &src.weights)?;
            notes.push(format!("weights from {}", init.display()));
            startup.mark("--init weights read");
        }
        // Data parallel: broadcasts rank 0's parameters, so every rank starts from the same weights
        // (a resume below then reads the same file on every rank).
        let sync = cfg.dist.as_ref().map(|d| (d.grad_sync)(model.params())).transpose()?;
        let (rank, world) = rank_world(cfg.dist.as_ref());
        let opt = match sync.as_deref().and_then(|s| s.shard()) {
            Some(parts) => {
                let opt = GptAdamW::sharded(&model, &parts, cfg.lr, cfg.weight_decay)?;
                let mib = |b: usize| b as f64 / (1 << 20) as f64;
                let elems: usize = model.params().iter().map(|(_, t)| t.elem_count()).sum();
                let whole = elems * 2 * DType::F32.size_in_bytes();
                notes.push(format!(
                    "ZeRO-1: rank {rank} keeps AdamW moments for its shard: {:.1} MiB instead of {:.1} MiB \
                     ({:.2}x less); parameters are all-gathered after each step",
                    mib(opt.state_bytes()),
                    mib(whole),
                    whole as f64 / opt.state_bytes().max(1) as f64
                ));
                opt
            }
            None => GptAdamW::new(&model, cfg.lr, cfg.weight_decay)?,
        };
        startup.mark("optimizer state (AdamW moments)");
        let t = cfg.context;
        let (micro_batch, auto_note) = match cfg.batch {
            BatchSize::Fixed(0) => return Err(Error::InvalidArgument("--batch must be positive".into())),
            BatchSize::Fixed(b) => (b, None),
            BatchSize::Auto => {
                let limit = match cfg.total_batch {
                    Some(total) if total.is_multiple_of(t * world) => total / (t * world),
                    Some(total) => {
                        return Err(Error::InvalidArgument(format!(
                            "--total-batch {total} is not a multiple of --context {t} x {world} rank(s)"
                        )))
                    }
                    None => 512,
                };
                let (b, note) = super::autobatch::find_micro_batch(&model, &cfg, limit)?;
                match &cfg.dist {
                    // Every rank must take the same micro-batch: the smallest any rank fits.
                    Some(d) => {
                        let agreed = (d.min)(b)?;
                        (agreed, Some(format!("{note}; {agreed} on every rank (the smallest any fits)")))
                    }
                    None => (b, Some(note)),
                }
            }
        };
        let per_micro = micro_batch * t;
        let total = cfg.total_batch.unwrap_or(per_micro * world);
        if total == 0 || !total.is_multiple_of(per_micro * world) {
            let ranks = if world > 1 { format!(" on each of {world} ranks") } else { String::new() };
            return Err(Error::InvalidArgument(format!(
                "--total-batch {total} tokens is not a multiple of one micro-batch ({micro_batch} x {t} = {per_micro}){ranks}"
            )));
        }
        let grad_accum = total / (per_micro * world);
        let mut train = TokenLoader::new(&cfg.data, "train", micro_batch, t)?;
        train.set_stride(rank, world)?;
        if let Some(d) = &cfg.dist {
            notes.push(format!(
                "data parallel over {world} ranks ({}): rank r reads micro-batches r, r+{world}, ... of the \
                 single-GPU order; {grad_accum} micro-batch(es) per rank per step",
                d.describe
            ));
        }
        let val = match TokenLoader::new(&cfg.data, "val", micro_batch, t) {
            Ok(v) => Some(v),
            Err(e) => {
                notes.push(format!("no validation: {e}"));
                None
            }
        };
        startup.mark("data open (token shards, loaders; --batch auto's search)");
        let inputs = StepInputs::new(grad_accum, micro_batch, t, cfg.device)?;
        let info = RunInfo {
            parameters: cfg.model.num_parameters(),
            micro_batch,
            grad_accum,
            world,
            tokens_per_step: total,
            train_tokens: train.total_tokens(),
            val_tokens: val.as_ref().map(|v| v.total_tokens()),
            start_step: 0,
            device: device_name(cfg.device),
            peak_flops: match cfg.device {
                // The group's peak: every rank's GPU is the same kind.
                Device::Cuda(o) => CudaDevice::get(o)
                    .ok()
                    .and_then(|d| peak_flops(&d.info.name, cfg.precision))
                    .map(|p| p * world as f64),
                Device::Cpu => None,
            },
            auto_batch: auto_note,
            notes,
        };
        let schedule = cfg.schedule();
        let device = cfg.device;
        let graph = cfg.graph;
        let mut run = Run {
            cfg,
            step_graph: None,
            model,
            opt,
            schedule,
            train,
            val,
            inputs,
            accum: GradAccumulator::new(),
            sync,
            step: 0,
            micro_batch,
            grad_accum,
            info,
            last_step_kind: "step",
            shadows: None,
        };
        if run.cfg.resume {
            run.resume()?;
            startup.mark("--resume: checkpoint read");
        }
        run.shadows = run.shadow_set()?;
        if let Device::Cuda(o) = device {
            // The step is captured when asked for and, data parallel, when the communicator's
            // collectives can be recorded with it (NCCL >= 2.9); else every step runs eagerly.
            let capturable = run.sync.as_deref().map_or(Ok(()), |s| s.graph_capturable());
            let (how, capture) = match (graph, capturable) {
                (false, _) => ("eager (--no-graph)".to_string(), false),
                (true, Err(why)) => (format!("eager ({why})"), false),
                (true, Ok(())) if run.opt.is_sharded() => (
                    "one CUDA graph per optimizer step, reduce-scatters and all-gathers captured with it".to_string(),
                    true,
                ),
                (true, Ok(())) if run.sync.is_some() => {
                    ("one CUDA graph per optimizer step, gradient all-reduces captured with it".to_string(), true)
                }
                (true, Ok(())) => ("one CUDA graph per optimizer step".to_string(), true),
            };
            if capture {
                run.step_graph =
                    Some(StepGraph { capture: Capture::new(&CudaDevice::get(o)?)?, warmups: 0, graph: None });
            }
            if run.sync.is_some() {
                run.info.notes.push(format!("step: {how}"));
            }
        }
        startup.mark("step buffers, data-parallel setup, graph pool");
        Ok(run)
    }

    /// Under a bf16 autocast on CUDA, bf16 copies of the block projections' f32 weights and biases
    /// and of the tied embedding that AdamW rewrites as it updates them (`cuda::ShadowSet`), so the
    /// forward reads them instead of casting 97 tensors a step. The same bits as the casts. Not with ZeRO-1 (a rank's AdamW writes only its shard of each weight; the
    /// all-gather writes the rest) or quantized projections; `FERROGRAD_SHADOWS=0` turns it off.
    fn shadow_set(&self) -> Result<Option<ShadowSet>> {
        let off = std::env::var("FERROGRAD_SHADOWS").is_ok_and(|v| v.trim() == "0");
        let float = matches!(self.model.linears, super::quant::Linears::Float);
        if off || !self.cfg.device.is_cuda() || self.cfg.precision != Precision::Bf16 || self.opt.is_sharded() || !float
        {
            return Ok(None);
        }
        // The tied embedding too: the classifier reads it as a master weight (`ops::lm_logits_padded`).
        let mut masters = self.model.projection_params();
        masters.push(self.model.wte.clone());
        Ok(Some(ShadowSet::new(&masters, DType::BF16)?))
    }

    /// How many master weights have a kept bf16 copy (0: the forward casts them; see
    /// `Run::shadow_set`).
    pub fn weight_copies(&self) -> usize {
        self.shadows.as_ref().map_or(0, ShadowSet::len)
    }

    /// Keep bf16 copies of the projections' weights (the default where they apply) or cast them
    /// at every forward: the same bits either way (a test compares them). Before the first step:
    /// a captured step would read the copies' addresses.
    pub fn set_weight_copies(&mut self, on: bool) -> Result<()> {
        if self.step > self.info.start_step {
            return Err(Error::InvalidArgument("set_weight_copies: the run has taken steps".into()));
        }
        self.shadows = None;
        if on {
            self.shadows = self.shadow_set()?;
        }
        Ok(())
    }

    pub fn settings(&self) -> RunSettings {
        RunSettings {
            model: self.cfg.model,
            micro_batch: self.micro_batch,
            context: self.cfg.context,
            grad_accum: self.grad_accum * self.info.world,
            steps: self.cfg.steps,
            lr: self.cfg.lr,
            min_lr_ratio: self.cfg.min_lr_ratio,
            warmup: self.cfg.warmup_steps(),
            weight_decay: self.cfg.weight_decay,
            grad_clip: self.cfg.grad_clip,
            precision: self.cfg.precision,
            seed: self.cfg.seed,
        }
    }

    /// Copy the next `k` micro-batches into the step's input buffers.
    pub fn load_inputs(&mut self) -> Result<()> {
        self.inputs.fill_from(&mut self.train)
    }

    /// One optimizer step on the current input buffers: `(mean loss, gradient norm)` as device
    /// scalars. Reads nothing back to the host. On CUDA the optimizer reads its step count and
    /// learning rate from the device, so the same work replays as a CUDA graph (`cfg.graph`): the
    /// first [`GRAPH_WARMUP`] steps run eagerly on the graph's stream and pool, the next is
    /// captured (all `k` micro-batches, clipping and AdamW: one graph per optimizer step, the
    /// micro-batches reading their fixed buffers `inputs.x[i]`, `inputs.y[i]`) and every step from
    /// then on is one replay. The returned tensors of a replayed step are overwritten by the next.
    /// Data parallel runs the same body; its gradient all-reduces are recorded into the graph with
    /// the rest where the communicator allows (the run's notes say whether the step is captured).
    pub fn compute_step(&mut self) -> Result<(Tensor, Tensor)> {
        self.opt.set_lr(self.schedule.lr_at(self.step));
        let on_device = self.cfg.device.is_cuda();
        if on_device {
            self.opt.prepare_device_step()?;
        }
        let shard = self.opt.shard_keys();
        let Run { model, opt, accum, inputs, cfg, step_graph, sync, .. } = self;
        let (k, clip, precision, shard) = (self.grad_accum, cfg.grad_clip, cfg.precision, shard.as_deref());
        let body = StepBody { model, inputs, k, clip, precision, shard };
        let mut sync = sync.as_deref_mut();
        let mut eager = false;
        let mut kind = "eager";
        let out = match step_graph {
            Some(sg) => {
                // Whether the body itself ran to its end (a capture that fails after it did leaves
                // every host-side state, the gradient averager's included, at a step's end).
                let mut body_done = false;
                let mut run = || {
                    let r = body.run(accum, sync.as_deref_mut(), |g, f| opt.step_device(g, f));
                    body_done = r.is_ok();
                    r
                };
                if sg.warmups < GRAPH_WARMUP {
                    sg.warmups += 1;
                    kind = "eager warm-up on the graph's stream and pool";
                    Some(sg.capture.warmup(run)?)
                } else {
                    kind = "graph replay";
                    if sg.graph.is_none() {
                        kind = "graph capture + first replay";
                        match sg.capture.capture(&mut run) {
                            Ok(g) => sg.graph = Some(g),
                            // Data parallel: the driver or NCCL refused to record the collectives.
                            // Recorded work never ran, so this rank may go on eagerly (its
                            // collectives are the ones the others' graph launches, in order).
                            Err(e) if body_done && sync.is_some() => {
                                eprintln!("ferrograd: the step could not be captured ({e}); every step runs eagerly");
                                eager = true;
                            }
                            Err(e) => return Err(e),
                        }
                    }
                    match &sg.graph {
                        Some((graph, out)) => {
                            graph.replay()?;
                            Some(out.clone())
                        }
                        None => None,
                    }
                }
            }
            None => None,
        };
        let out = match out {
            Some(out) => out,
            None if on_device => body.run(accum, sync, |g, f| opt.step_device(g, f))?,
            None => body.run(accum, sync, |g, f| opt.step_host(g, f))?,
        };
        if eager {
            self.step_graph = None;
        }
        self.last_step_kind = kind;
        if on_device {
            self.opt.count_step();
        }
        self.step += 1;
        Ok(out)
    }

    /// One whole step: inputs, then compute.
    pub fn train_step(&mut self) -> Result<(Tensor, Tensor)> {
        self.load_inputs()?;
        self.compute_step()
    }

    /// Mean loss over the first `val_batches` micro-batches of the validation split.
    pub fn evaluate(&mut self) -> Result<Option<f64>> {
        let c = &self.cfg;
        let sizes = (self.micro_batch, c.context, c.device, c.precision);
        super::fit::val_loss(self.val.as_mut(), c.val_batches, sizes, |x, y| self.model.loss(x, y))
    }

    /// Write `out/checkpoint.safetensors` atomically: weights (Hugging Face names), AdamW moments,
    /// step, loader position and the run's settings. Data parallel: rank 0 writes (every rank
    /// holds the same state), the others wait until it has.
    /// ZeRO-1: every rank first gathers the moment shards (a collective) and rank 0 writes them
    /// whole, the file a single-GPU run writes.
    pub fn save_checkpoint(&mut self) -> Result<PathBuf> {
        if let Some(sync) = self.sync.as_deref() {
            self.opt.gather_state(sync)?;
        }
        let written = self.write_checkpoint();
        self.opt.end_staging(false)?;
        if let Some(d) = &self.cfg.dist {
            // Also when rank 0 failed: it reports its error, the others go on to the same end.
            (d.barrier)()?;
        }
        written
    }

    fn write_checkpoint(&self) -> Result<PathBuf> {
        if !writes_files(self.cfg.dist.as_ref()) {
            return Ok(Self::checkpoint_path(&self.cfg.out));
        }
        std::fs::create_dir_all(&self.cfg.out).map_err(|e| Error::File {
            path: self.cfg.out.display().to_string(),
            msg: format!("creating the output directory: {e}"),
        })?;
        let path = Self::checkpoint_path(&self.cfg.out);
        let mut state = TrainState { step: self.step, ..Default::default() };
        let extra = &mut state.extra;
        extra.insert("gpt_config".into(), serde_json::to_string(&self.cfg.model).map_err(json_err)?);
        extra.insert("run".into(), serde_json::to_string(&self.settings()).map_err(json_err)?);
        extra.insert("loader".into(), serde_json::to_string(&self.train.position()).map_err(json_err)?);
        checkpoint::save(&path, &HfView(&self.model), Some(&self.opt), &state)?;
        Ok(path)
    }

    /// The settings recorded in `out/checkpoint.safetensors` (what `--resume` continues).
    pub fn saved_settings(out: &Path) -> Result<RunSettings> {
        let path = Self::checkpoint_path(out);
        let file_err = |msg: String| Error::File { path: path.display().to_string(), msg };
        if !path.is_file() {
            return Err(file_err(
                "--resume: no checkpoint here (a run writes it at --save-every steps and at its end)".into(),
            ));
        }
        // The header only: the settings are compared before any tensor is read.
        let header = checkpoint::read_safetensors_header(&path)?;
        let saved = header.metadata.get("extra.run").cloned();
        let saved = saved.ok_or_else(|| file_err("not a gpt train checkpoint (no run settings)".into()))?;
        serde_json::from_str(&saved).map_err(|e| file_err(format!("run settings: {e}")))
    }

    /// Read the checkpoint at `path` into the model and the optimizer (staged, under ZeRO-1): the
    /// file straight into device memory (`hf::read_onto`: one read, no host copy), except
    /// the moments that ZeRO-1 stages on the host, which are read there (the device holds only
    /// this rank's parts of them).
    fn read_checkpoint(&mut self, path: &Path) -> Result<TrainState> {
        let device = self.model.wte.device();
        let host_moments = self.opt.is_sharded() && device != Device::Cpu;
        let on_device = |n: &str| !(host_moments && n.starts_with(checkpoint::OPTIM_PREFIX));
        let mut loaded = hf::read_onto(path, device, Some(&on_device))?;
        if host_moments {
            let moments = |n: &str| !on_device(n);
            loaded.tensors.extend(hf::read_onto(path, Device::Cpu, Some(&moments))?.tensors);
        }
        let opts = checkpoint::LoadOptions::default();
        Ok(checkpoint::from_loaded(&loaded, &HfView(&self.model), Some(&mut self.opt), opts)?)
    }

    /// Restore from `out/checkpoint.safetensors`, refusing one made with other settings.
    pub fn resume(&mut self) -> Result<()> {
        let saved = Self::saved_settings(&self.cfg.out)?;
        let path = Self::checkpoint_path(&self.cfg.out);
        let mine = self.settings();
        let same_but_steps = RunSettings { steps: mine.steps, ..saved.clone() };
        if same_but_steps != mine {
            let (a, b) = (
                serde_json::to_value(&same_but_steps).map_err(json_err)?,
                serde_json::to_value(&mine).map_err(json_err)?,
            );
            let diff: Vec<String> = a
                .as_object()
                .into_iter()
                .flatten()
                .filter(|(k, v)| b.get(k.as_str()) != Some(v))
                .map(|(k, v)| format!("{k} {v} (this run: {})", b.get(k.as_str()).unwrap_or(&serde_json::Value::Null)))
                .collect();
            return Err(Error::InvalidArgument(format!(
                "--resume: {} was made with other settings: {}",
                path.display(),
                diff.join(", ")
            )));
        }
        // ZeRO-1: the whole moments are read into the host, then this rank's parts cut out.
        self.opt.stage_for_load()?;
        let state = self.read_checkpoint(&path);
        self.opt.end_staging(state.is_ok())?;
        let state = state?;
        let pos: LoaderPos = state
            .extra
            .get("loader")
            .map(|s| serde_json::from_str(s))
            .transpose()
            .map_err(json_err)?
            .unwrap_or_default();
        self.train.set_position(pos)?;
        if let Some(s) = &self.shadows {
            // The weights were written by the load, not by AdamW.
            s.refresh()?;
        }
        self.step = state.step;
        self.info.start_step = state.step;
        if saved.steps != mine.steps {
            self.info.notes.push(format!(
                "resumed with --steps {} (the checkpoint's run planned {}): the schedule changes",
                mine.steps, saved.steps
            ));
        }
        Ok(())
    }
}
