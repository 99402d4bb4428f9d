//! Data-parallel training: every rank holds the whole model, reads its own slice of each global
//! batch, and steps on the gradient averaged over all ranks, so that N GPUs take exactly the steps
//! one would on the global batch.
//!
//! `DataParallel` is an `Optimizer` (ferrograd-nn's trait) wrapping either any optimizer, whose
//! state every rank keeps whole ("replicated"), or AdamW with its moments sharded over the ranks
//! (ZeRO-1). At construction it broadcasts the parameters from rank 0 and packs them into buckets
//! (`bucket.rs`). Then, per optimizer step:
//!
//! 1. `backward(loss, grads, last_micro_step)`: on earlier micro-batches a plain backward that
//!    accumulates locally (no communication); on the last, backward with a hook: as each
//!    parameter's gradient becomes final it is copied into its bucket slot (in the communication
//!    dtype, f32 or bf16), and each full bucket is all-reduced (ZeRO-1: reduce-scattered) on the
//!    communication stream while the walk goes on.
//! 2. `reduce_grads(grads)` (the Trainer calls it; `step` does it when nobody did): compute waits
//!    for the buckets; replicated, each parameter's averaged gradient goes into `grads` as a view
//!    of its bucket, so loss scaling and clipping see what every rank sees.
//! 3. `step(grads)`: replicated, the inner optimizer steps (identically on every rank); ZeRO-1,
//!    AdamW updates this rank's shard of each bucket, the shards are all-gathered and written
//!    back into the parameters.
//!
//! `save_checkpoint`/`load_checkpoint` (dp/checkpoint.rs) write files that a single-process AdamW
//! would write, so runs resume on any number of GPUs.
//!
//! Parameters that no rank's loss used get a zero gradient (every rank must take the same step).
//! The loss scaler (f16) works with the replicated mode; with ZeRO-1 it would check only local
//! gradients, so use bf16 there.

mod checkpoint;
mod shard;
mod zero;

use crate::bucket::{BucketPlan, Readiness};
use crate::comm::{Communicator, ReduceOp, Work};
use crate::error::{DistError, DistResult};
use ferrograd_core::backprop::LeafHook;
use ferrograd_core::optim::AdamConfig;
use ferrograd_core::{no_grad, DType, Error, GradStore, Result, Tensor, TensorId};
use ferrograd_nn::optim::{Adam, Optimizer};
use std::collections::HashMap;
use std::sync::Arc;
use zero::ZeroState;

pub use shard::ShardPart;

/// PyTorch DDP's default bucket size.
pub const DEFAULT_BUCKET_BYTES: usize = 25 << 20;

#[derive(Debug, Clone, PartialEq)]
pub struct DpConfig {
    /// Gradient bytes per bucket (in `comm_dtype`).
    pub bucket_bytes: usize,
    /// What gradients travel as: F32, or BF16 (half the bytes; averaged in bf16, then widened
    /// back to f32 for the optimizer).
    pub comm_dtype: DType,
    /// 0: every rank keeps the whole optimizer state; 1: ZeRO-1, AdamW's moments sharded.
    pub zero: u8,
}

impl Default for DpConfig {
    fn default() -> Self {
        DpConfig { bucket_bytes: DEFAULT_BUCKET_BYTES, comm_dtype: DType::F32, zero: 0 }
    }
}

/// When a bucket's communication was launched (for tests and overlap reports).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchRecord {
    pub bucket: usize,
    /// Parameters whose gradients were final at that point.
    pub grads_final: usize,
    /// Launched from inside the backward walk (overlapping it), not after it.
    pub during_backward: bool,
}

enum Mode {
    Replicated(Box<dyn Optimizer>),
    Zero(ZeroState),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// No communication this step yet.
    Idle,
    /// Buckets launched (some or all).
    Launched,
    /// Compute ordered after every bucket; replicated gradients available.
    Reduced,
}

pub struct DataParallel {
    comm: Arc<dyn Communicator>,
    cfg: DpConfig,
    params: Vec<(String, Tensor)>,
    index: HashMap<TensorId, usize>,
    plan: BucketPlan,
    /// One flat buffer per bucket, in `cfg.comm_dtype`.
    bufs: Vec<Tensor>,
    ready: Readiness,
    works: Vec<Option<Work>>,
    phase: Phase,
    /// f32 averaged gradients per bucket once reduced (replicated: whole buckets; ZeRO: shards).
    reduced: Vec<Tensor>,
    mode: Mode,
    /// [`DataParallel::shard_sync`]: the caller's optimizer steps on this rank's shard.
    shard: Option<shard::ShardSync>,
    log: Vec<LaunchRecord>,
    finals: usize,
    in_backward: bool,
}

fn invalid(msg: String) -> DistError {
    DistError::Core(Error::InvalidArgument(msg))
}

impl DataParallel {
    /// Replicated data parallel around `inner` (any optimizer), over `inner.params()`.
    pub fn new(comm: Arc<dyn Communicator>, inner: Box<dyn Optimizer>, cfg: DpConfig) -> DistResult<DataParallel> {
        if cfg.zero != 0 {
            return Err(invalid(format!(
                "ZeRO-{} shards the optimizer's state: build it with DataParallel::zero1 or with_adam",
                cfg.zero
            )));
        }
        let params = inner.params().to_vec();
        Self::build(comm, params, cfg, |_, _| Ok(Mode::Replicated(inner)))
    }

    /// Gradient averaging only, for a training loop that keeps its own optimizer (GPT's two-group
    /// AdamW): `backward` and `reduce_grads` as always, then the caller's optimizer steps on the
    /// averaged gradients, then `step` here, which updates nothing and ends the step (the next
    /// last micro-step may communicate again). Broadcasts `params` from rank 0 like `new`.
    pub fn grad_sync(
        comm: Arc<dyn Communicator>,
        params: Vec<(String, Tensor)>,
        cfg: DpConfig,
    ) -> DistResult<DataParallel> {
        Self::new(comm, Box::new(NoUpdate { params }), cfg)
    }

    /// ZeRO-1: AdamW (or Adam, per `adam.decoupled`) with its moments sharded over the ranks.
    pub fn zero1(
        comm: Arc<dyn Communicator>,
        params: Vec<(String, Tensor)>,
        adam: AdamConfig,
        cfg: DpConfig,
    ) -> DistResult<DataParallel> {
        // Adam's own checks of the hyper-parameters.
        Adam::new(vec![], adam)?;
        let cfg = DpConfig { zero: 1, ..cfg };
        Self::build(comm, params, cfg, |plan, dp| Ok(Mode::Zero(ZeroState::new(plan, dp, adam)?)))
    }

    /// Adam(W) per `cfg.zero`: replicated (0) or ZeRO-1 (1). The one-line way in.
    pub fn with_adam(
        comm: Arc<dyn Communicator>,
        params: Vec<(String, Tensor)>,
        adam: AdamConfig,
        cfg: DpConfig,
    ) -> DistResult<DataParallel> {
        match cfg.zero {
            0 => Self::new(comm, Box::new(Adam::new(params, adam)?), cfg),
            1 => Self::zero1(comm, params, adam, cfg),
            z => Err(invalid(format!("ZeRO stage {z} is not implemented (0 or 1)"))),
        }
    }

    fn build(
        comm: Arc<dyn Communicator>,
        params: Vec<(String, Tensor)>,
        cfg: DpConfig,
        mode: impl FnOnce(&BucketPlan, &DataParallel) -> DistResult<Mode>,
    ) -> DistResult<DataParallel> {
        let _g = no_grad();
        if !matches!(cfg.comm_dtype, DType::F32 | DType::BF16 | DType::F16) {
            return Err(invalid(format!("gradients travel as f32, bf16 or f16, not {}", cfg.comm_dtype)));
        }
        if cfg.bucket_bytes == 0 {
            return Err(invalid("the bucket size must be positive".into()));
        }
        if params.is_empty() {
            return Err(invalid("data parallel over no parameters".into()));
        }
        let device = comm.device();
        let mut index = HashMap::new();
        for (i, (name, p)) in params.iter().enumerate() {
            if p.dtype() != DType::F32 || !p.is_contiguous() {
                return Err(invalid(format!(
                    "parameter {name} must be contiguous f32, is {} {:?}",
                    p.dtype(),
                    p.dims()
                )));
            }
            if p.device() != device {
                return Err(DistError::Collective {
                    op: "data parallel",
                    msg: format!("parameter {name} is on {}, rank {} trains on {device}", p.device(), comm.rank()),
                });
            }
            if index.insert(p.id(), i).is_some() {
                return Err(invalid(format!("parameter {name} is listed twice")));
            }
        }
        // Rank 0's initial values everywhere.
        let works = params.iter().map(|(_, p)| comm.broadcast(p, 0)).collect::<DistResult<Vec<_>>>()?;
        for w in works {
            w.wait()?;
        }
        let numels: Vec<usize> = params.iter().map(|(_, p)| p.elem_count()).collect();
        let plan = BucketPlan::new(&numels, cfg.comm_dtype.size_in_bytes(), cfg.bucket_bytes, comm.world_size());
        let bufs =
            plan.buckets.iter().map(|b| Tensor::zeros(b.len, cfg.comm_dtype, device)).collect::<Result<Vec<_>>>()?;
        let nb = plan.buckets.len();
        let mut dp = DataParallel {
            comm,
            cfg,
            params,
            index,
            ready: Readiness::new(&plan),
            plan: plan.clone(),
            bufs,
            works: (0..nb).map(|_| None).collect(),
            phase: Phase::Idle,
            reduced: vec![],
            mode: Mode::Replicated(Box::new(Adam::new(vec![], AdamConfig::default())?)),
            shard: None,
            log: vec![],
            finals: 0,
            in_backward: false,
        };
        dp.mode = mode(&plan, &dp)?;
        Ok(dp)
    }

    pub fn comm(&self) -> &Arc<dyn Communicator> {
        &self.comm
    }

    pub fn config(&self) -> &DpConfig {
        &self.cfg
    }

    pub fn plan(&self) -> &BucketPlan {
        &self.plan
    }

    /// Bucket launches of the last step, in launch order.
    pub fn launch_log(&self) -> &[LaunchRecord] {
        &self.log
    }

    /// The wrapped optimizer (replicated mode).
    pub fn inner(&self) -> Option<&dyn Optimizer> {
        match &self.mode {
            Mode::Replicated(o) => Some(&**o),
            Mode::Zero(_) => None,
        }
    }

    /// Buckets are reduce-scattered and each rank keeps only its shard of the averages (ZeRO-1,
    /// with the optimizer here or the caller's).
    fn is_zero(&self) -> bool {
        matches!(self.mode, Mode::Zero(_)) || self.shard.is_some()
    }

    fn start_step(&mut self) {
        self.ready = Readiness::new(&self.plan);
        self.log.clear();
        self.finals = 0;
        self.reduced.clear();
    }

    /// Copy parameter `p`'s gradient `g` (or zeros) into its bucket slot.
    fn copy_in(&mut self, p: usize, g: Option<&Tensor>) -> DistResult<()> {
        let slot = self.plan.slots[p].clone();
        let dst = self.bufs[slot.bucket].narrow(0, slot.offset, slot.numel)?;
        let (name, param) = &self.params[p];
        let src = match g {
            Some(g) => {
                if g.dims() != param.dims() {
                    return Err(DistError::Core(Error::Shape {
                        op: "data parallel",
                        msg: format!("gradient of {name} has shape {:?}, parameter {:?}", g.dims(), param.dims()),
                    }));
                }
                let g = if g.dtype() == self.cfg.comm_dtype { g.clone() } else { g.to_dtype(self.cfg.comm_dtype)? };
                g.contiguous()?.reshape(slot.numel)?
            }
            None => Tensor::zeros(slot.numel, self.cfg.comm_dtype, self.comm.device())?,
        };
        dst.set(&src)?;
        Ok(())
    }

    fn launch(&mut self, b: usize) -> DistResult<()> {
        let w = if self.is_zero() {
            self.comm.reduce_scatter(&self.bufs[b], ReduceOp::Avg)?
        } else {
            self.comm.all_reduce(&self.bufs[b], ReduceOp::Avg)?
        };
        self.works[b] = Some(w);
        self.log.push(LaunchRecord { bucket: b, grads_final: self.finals, during_backward: self.in_backward });
        Ok(())
    }

    /// The backward hook: `leaf`'s gradient `g` is final.
    fn on_grad(&mut self, leaf: &Tensor, g: &Tensor) -> DistResult<()> {
        let Some(&p) = self.index.get(&leaf.id()) else { return Ok(()) };
        self.copy_in(p, Some(g))?;
        self.finals += 1;
        for b in self.ready.param_ready(&self.plan, p) {
            self.launch(b)?;
        }
        Ok(())
    }

    /// Slots the walk did not fill (parameters unused by this micro-batch: their gradient from
    /// earlier micro-batches, or zeros), then every bucket not launched yet, in order.
    fn flush(&mut self, grads: &GradStore) -> DistResult<()> {
        let (missing, rest) = self.ready.finish();
        for p in missing {
            let g = grads.get(&self.params[p].1).cloned();
            self.copy_in(p, g.as_ref())?;
        }
        for b in rest {
            self.launch(b)?;
        }
        self.phase = Phase::Launched;
        Ok(())
    }

    /// Launch every bucket from `grads` if `backward` did not.
    fn ensure_launched(&mut self, grads: &GradStore) -> DistResult<()> {
        if self.phase == Phase::Idle {
            self.start_step();
            self.flush(grads)?;
        }
        Ok(())
    }

    /// Order compute after every bucket and widen the averaged gradients to f32.
    fn wait_all(&mut self, grads: &GradStore) -> DistResult<()> {
        self.ensure_launched(grads)?;
        if self.phase == Phase::Reduced {
            return Ok(());
        }
        let _g = no_grad();
        for w in self.works.iter_mut() {
            if let Some(w) = w.take() {
                w.wait()?;
            }
        }
        let (rank, zero) = (self.comm.rank(), self.is_zero());
        self.reduced = (0..self.bufs.len())
            .map(|b| {
                let part = if zero {
                    let sl = self.plan.shard_len(b);
                    self.bufs[b].narrow(0, rank * sl, sl)?
                } else {
                    self.bufs[b].clone()
                };
                if part.dtype() == DType::F32 {
                    Ok(part)
                } else {
                    part.to_dtype(DType::F32)
                }
            })
            .collect::<Result<_>>()?;
        self.phase = Phase::Reduced;
        Ok(())
    }

    /// Put each parameter's averaged gradient into `grads` (replicated mode).
    fn insert_reduced(&self, grads: &mut GradStore) -> DistResult<()> {
        let _g = no_grad();
        for (p, (_, param)) in self.params.iter().enumerate() {
            let s = &self.plan.slots[p];
            let g = self.reduced[s.bucket].narrow(0, s.offset, s.numel)?.reshape(param.dims())?;
            grads.insert(param, g);
        }
        Ok(())
    }

    fn dp_backward(&mut self, loss: &Tensor, grads: &mut GradStore, last: bool) -> DistResult<()> {
        self.dp_walk(grads, last, |store, hook| match hook {
            Some(h) => loss.backward_into_with_hook(store, h),
            None => loss.backward_into(store),
        })
    }

    /// One micro-step's backward through `walk` (which runs the hook it is given on each final
    /// leaf gradient): plain on earlier micro-steps, with the bucket hook on the last.
    fn dp_walk(
        &mut self,
        grads: &mut GradStore,
        last: bool,
        walk: impl FnOnce(&mut GradStore, Option<LeafHook>) -> Result<()>,
    ) -> DistResult<()> {
        if !last {
            return Ok(walk(grads, None)?);
        }
        if self.phase != Phase::Idle {
            return Err(invalid(
                "backward of a last micro-step again before step: gradients of this step are already being averaged"
                    .into(),
            ));
        }
        self.start_step();
        self.in_backward = true;
        let mut hook_err: Option<DistError> = None;
        let walked = walk(
            grads,
            Some(&mut |leaf, g| {
                self.on_grad(leaf, g).map_err(|e| {
                    let msg = e.to_string();
                    hook_err = Some(e);
                    Error::Backward(msg)
                })
            }),
        );
        self.in_backward = false;
        if let Some(e) = hook_err {
            return Err(e);
        }
        walked?;
        self.flush(grads)
    }

    /// `Optimizer::backward` for a walk seeded with a given gradient: `seed` is the gradient of
    /// the (already scaled) loss with respect to `root`, as a fused classifier forms it for the
    /// logits. On the last micro-step each bucket is averaged as soon as its gradients are final.
    /// Takes `root` (see `Tensor::backward_consume`: the walk frees the graph as it goes).
    pub fn backward_seeded(&mut self, root: Tensor, seed: &Tensor, grads: &mut GradStore, last: bool) -> Result<()> {
        Ok(self.dp_walk(grads, last, |store, hook| root.backward_consume(seed, store, hook))?)
    }

    fn dp_step(&mut self, grads: &GradStore) -> DistResult<()> {
        let already = self.phase == Phase::Reduced;
        self.wait_all(grads)?;
        let result = match &mut self.mode {
            Mode::Replicated(_) if self.shard.is_some() => self.gather_params(),
            Mode::Replicated(_) if already => self.step_inner(grads),
            Mode::Replicated(_) => {
                let mut g = grads.clone();
                self.insert_reduced(&mut g)?;
                self.step_inner(&g)
            }
            Mode::Zero(_) => self.step_zero(),
        };
        self.phase = Phase::Idle;
        self.reduced.clear();
        result
    }

    fn step_inner(&mut self, grads: &GradStore) -> DistResult<()> {
        match &mut self.mode {
            Mode::Replicated(o) => Ok(o.step(grads)?),
            Mode::Zero(_) => Ok(()),
        }
    }

    fn step_zero(&mut self) -> DistResult<()> {
        let Mode::Zero(z) = &mut self.mode else { return Ok(()) };
        z.step(&self.comm, &self.plan, &self.params, &self.bufs, &self.reduced)
    }

    fn dp_clip(&mut self, grads: &mut GradStore, max_norm: f64) -> DistResult<Tensor> {
        if max_norm.is_nan() || max_norm < 0.0 {
            return Err(invalid(format!("clip_grad_norm: max_norm {max_norm} < 0")));
        }
        self.wait_all(grads)?;
        if let Mode::Zero(z) = &mut self.mode {
            return z.clip(&self.comm, &mut self.reduced, max_norm);
        }
        if self.shard.is_some() {
            return Err(invalid("shard_sync: the caller's optimizer clips its own shard".into()));
        }
        self.insert_reduced(grads)?;
        let params: Vec<Tensor> = self.params.iter().map(|(_, p)| p.clone()).collect();
        Ok(ferrograd_nn::optim::clip_grad_norm(grads, &params, max_norm)?)
    }
}

impl Optimizer for DataParallel {
    fn step(&mut self, grads: &GradStore) -> Result<()> {
        Ok(self.dp_step(grads)?)
    }

    fn lr(&self) -> f64 {
        match &self.mode {
            Mode::Replicated(o) => o.lr(),
            Mode::Zero(z) => z.adam.lr,
        }
    }

    fn set_lr(&mut self, lr: f64) {
        match &mut self.mode {
            Mode::Replicated(o) => o.set_lr(lr),
            Mode::Zero(z) => z.adam.lr = lr,
        }
    }

    fn params(&self) -> &[(String, Tensor)] {
        &self.params
    }

    fn step_count(&self) -> u64 {
        match &self.mode {
            Mode::Replicated(o) => o.step_count(),
            Mode::Zero(z) => z.steps,
        }
    }

    fn kind(&self) -> &'static str {
        match &self.mode {
            Mode::Replicated(o) => o.kind(),
            Mode::Zero(z) if z.adam.decoupled => "adamw",
            Mode::Zero(_) => "adam",
        }
    }

    fn state_tensors(&self) -> Vec<(String, Tensor)> {
        match &self.mode {
            Mode::Replicated(o) => o.state_tensors(),
            Mode::Zero(z) => z.state_tensors(self.comm.rank()),
        }
    }

    fn state_meta(&self) -> serde_json::Value {
        match &self.mode {
            Mode::Replicated(o) => o.state_meta(),
            Mode::Zero(z) => serde_json::json!({ "steps": z.steps, "lr": z.adam.lr }),
        }
    }

    fn load_state_meta(&mut self, meta: &serde_json::Value) -> Result<()> {
        match &mut self.mode {
            Mode::Replicated(o) => o.load_state_meta(meta),
            Mode::Zero(z) => z.load_meta(meta),
        }
    }

    fn backward(&mut self, loss: &Tensor, grads: &mut GradStore, last_micro_step: bool) -> Result<()> {
        Ok(self.dp_backward(loss, grads, last_micro_step)?)
    }

    fn reduce_grads(&mut self, grads: &mut GradStore) -> Result<()> {
        self.wait_all(grads)?;
        if !self.is_zero() {
            self.insert_reduced(grads)?;
        }
        Ok(())
    }

    fn clip_grad_norm(&mut self, grads: &mut GradStore, max_norm: f64) -> Result<Tensor> {
        Ok(self.dp_clip(grads, max_norm)?)
    }
}

/// The inner "optimizer" of [`DataParallel::grad_sync`]: it owns the parameter list (for the
/// buckets) and updates nothing; the caller's optimizer does.
struct NoUpdate {
    params: Vec<(String, Tensor)>,
}

impl Optimizer for NoUpdate {
    fn step(&mut self, _grads: &GradStore) -> Result<()> {
        Ok(())
    }
    fn lr(&self) -> f64 {
        0.0
    }
    fn set_lr(&mut self, _lr: f64) {}
    fn params(&self) -> &[(String, Tensor)] {
        &self.params
    }
    fn step_count(&self) -> u64 {
        0
    }
    fn kind(&self) -> &'static str {
        "grad-sync"
    }
    fn state_tensors(&self) -> Vec<(String, Tensor)> {
        vec![]
    }
    fn state_meta(&self) -> serde_json::Value {
        serde_json::json!({})
    }
    fn load_state_meta(&mut self, _meta: &serde_json::Value) -> Result<()> {
        Ok(())
    }
}
