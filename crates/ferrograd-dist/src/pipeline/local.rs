//! The single-process pipeline: every stage in this process on a device of its own (GPUs of one
//! host), activations and their gradients moved between devices with `Tensor::to_device` (a
//! GPU-to-GPU copy where the pair has peer access, `cuda/peer.rs`; through the host otherwise).
//! One host thread issues every stage's work in a valid interleaving of the schedule's per-stage
//! lists; launches and peer copies are asynchronous, so the devices run concurrently as far as
//! the schedule lets them. No communicator, no NCCL: the choice for one host that needs no
//! processes (PyTorch's `Pipe` of old), and the reference the multi-process runner is compared with.

use super::runner::Stage;
use super::schedule::{Action, Pass, Schedule, ScheduleKind};
use crate::error::{DistError, DistResult};
use ferrograd_core::{Device, GradStore, Tensor};
use ferrograd_nn::optim::Optimizer;
use std::collections::HashMap;

pub struct LocalPipeline {
    stages: Vec<(Device, Stage)>,
    schedule: Schedule,
    order: Vec<Action>,
    grads: Vec<GradStore>,
}

impl LocalPipeline {
    /// Stage `s` runs on `stages[s].0`; its parameters must live there.
    pub fn new(stages: Vec<(Device, Stage)>, kind: ScheduleKind, micro_batches: usize) -> DistResult<LocalPipeline> {
        for (s, (d, st)) in stages.iter().enumerate() {
            if let Some((n, p)) = st.params().iter().find(|(_, p)| p.device() != *d) {
                return Err(DistError::Collective {
                    op: "pipeline",
                    msg: format!("stage {s} runs on {d} but its parameter {n} is on {}", p.device()),
                });
            }
        }
        let schedule = Schedule::new(kind, stages.len(), micro_batches)?;
        let order = interleave(&schedule)?;
        let grads = stages.iter().map(|_| GradStore::default()).collect();
        Ok(LocalPipeline { stages, schedule, order, grads })
    }

    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// The accumulated gradients of stage `s`.
    pub fn grads(&self, s: usize) -> Option<&GradStore> {
        self.grads.get(s)
    }

    /// Stage `s`'s accumulated gradients, to change before the optimizers step (tied weights).
    pub fn grads_mut(&mut self, s: usize) -> Option<&mut GradStore> {
        self.grads.get_mut(s)
    }

    /// Forget the accumulated gradients of every stage.
    pub fn zero_grad(&mut self) {
        self.grads.iter_mut().for_each(GradStore::clear);
    }

    /// Every micro-batch forward and backward; returns the step's loss (on the last device).
    pub fn run_micro_batches(&mut self) -> DistResult<Tensor> {
        let p = self.stages.len();
        let err = |s: usize, msg: String| DistError::Collective { op: "pipeline", msg: format!("stage {s}: {msg}") };
        // (stage, micro) -> (input leaf, output) between forward and backward.
        let mut held: HashMap<(usize, usize), (Option<Tensor>, Tensor)> = HashMap::new();
        // Gradients of stage inputs, waiting for the stage before them.
        let mut back: HashMap<(usize, usize), Tensor> = HashMap::new();
        let mut loss: Option<Tensor> = None;
        for &a in &self.order {
            let (s, i) = (a.stage, a.micro);
            let dev = self.stages[s].0;
            match a.pass {
                Pass::Forward => {
                    let input = match s {
                        0 => None,
                        _ => {
                            let (_, prev) = held.get(&(s - 1, i)).ok_or_else(|| err(s, format!("no input {i}")))?;
                            Some(prev.detach().to_device(dev)?.requires_grad())
                        }
                    };
                    let out = (self.stages[s].1.forward)(input.as_ref(), i)
                        .map_err(|e| err(s, format!("forward of micro-batch {i}: {e}")))?;
                    if s + 1 == p {
                        let l = out.detach().reshape(())?;
                        loss = Some(match loss {
                            None => l,
                            Some(acc) => acc.add(&l)?,
                        });
                    }
                    held.insert((s, i), (input, out));
                }
                Pass::Backward => {
                    let (input, out) = held.remove(&(s, i)).ok_or_else(|| err(s, format!("no forward of {i}")))?;
                    let grads = &mut self.grads[s];
                    if s + 1 == p {
                        out.backward_into(grads)
                    } else {
                        let dy = back.remove(&(s + 1, i)).ok_or_else(|| err(s, format!("no gradient {i}")))?;
                        out.backward_into_with(&dy.to_device(dev)?, grads)
                    }
                    .map_err(|e| err(s, format!("backward of micro-batch {i}: {e}")))?;
                    if let Some(x) = input {
                        let dx = match grads.remove(&x) {
                            Some(g) => g,
                            None => x.detach().zeros_like()?,
                        };
                        back.insert((s, i), dx);
                    }
                }
            }
        }
        loss.ok_or_else(|| err(p - 1, "no micro-batch ran".into()))
    }

    /// `run_micro_batches`, then each stage's optimizer (`opts[s]`) on its summed gradients.
    pub fn step(&mut self, opts: &mut [&mut dyn Optimizer]) -> DistResult<Tensor> {
        if opts.len() != self.stages.len() {
            return Err(DistError::Collective {
                op: "pipeline",
                msg: format!("{} optimizers for {} stages", opts.len(), self.stages.len()),
            });
        }
        let loss = self.run_micro_batches()?;
        for (opt, g) in opts.iter_mut().zip(&mut self.grads) {
            opt.step(g)?;
            g.clear();
        }
        Ok(loss)
    }
}

/// One valid global order of the schedule's actions: rounds in which every stage whose next
/// action's input is ready runs it (the order the virtual clock of `Schedule::simulate` runs them
/// with equal costs), so consecutive actions mostly belong to different devices.
fn interleave(s: &Schedule) -> DistResult<Vec<Action>> {
    let p = s.stages;
    let mut next = vec![0usize; p];
    let mut done = std::collections::HashSet::new();
    let mut order = vec![];
    loop {
        let ready: Vec<Action> = (0..p)
            .filter_map(|st| s.per_stage[st].get(next[st]).copied())
            .filter(|&a| s.dependency(a).is_none_or(|d| done.contains(&d)))
            .collect();
        if ready.is_empty() {
            break;
        }
        for a in ready {
            next[a.stage] += 1;
            done.insert(a);
            order.push(a);
        }
    }
    if (0..p).any(|st| next[st] < s.per_stage[st].len()) {
        return Err(DistError::Collective { op: "pipeline schedule", msg: "the schedule deadlocks".into() });
    }
    Ok(order)
}
