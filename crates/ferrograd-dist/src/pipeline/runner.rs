//! One rank of a pipeline: its stage (a forward closure over tensors and the parameters it
//! trains), the schedule's program for this rank, and the loop that runs it. Activations go to
//! the next rank and their gradients back through the communicator's point-to-point operations
//! (NCCL: on its communication stream, ordered with compute by events, so the host never waits);
//! each action's input is made a leaf so that its backward yields the gradient to send back.
//! Gradients add up over the micro-batches in one store; `step` then applies this stage's
//! optimizer.
//!
//! Before the first step every rank exchanges one element with each neighbour ([`connect_peers`]):
//! NCCL makes a point-to-point connection on a pair's first message, inside `ncclGroupEnd`, and
//! that blocks the host until the peer's host reaches its own first message on the pair. Left to
//! the first step, it hung GPipe on 2 x H200: stage 0's host blocked posting its last activation
//! (grouped with its first gradient receive, a new direction) until stage 1 posted its first
//! gradient, while stage 1's host waited (a lazily loaded backward kernel synchronises the
//! context) for that very activation. With the connections made, the device-side rendezvous of
//! the programs is all that is left, and `Schedule::check_programs` proves it cannot wait for ever
//! even if a host waits for its device between any two operations. `FERROGRAD_PIPELINE_TRACE=1`
//! prints every operation a rank posts (stderr), to find where a hang stopped.
//!
//! A stage that fails aborts the communicator (`Communicator::abort`) before returning its error,
//! so that ranks waiting on it fail at once with the reason instead of waiting (NCCL: the launcher
//! stops them, and host waits time out).

use super::schedule::{Dir, Msg, Op, Pass, Schedule, ScheduleKind};
use crate::comm::{Communicator, Work};
use crate::error::{DistError, DistResult};
use ferrograd_core::cuda::event::Event;
use ferrograd_core::cuda::CudaDevice;
use ferrograd_core::{DType, Device, GradStore, Tensor};
use ferrograd_nn::optim::Optimizer;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long the connection exchange of [`connect_peers`] may wait for a peer.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(120);

/// Make the point-to-point connections between this rank and each of `peers` before any step
/// needs them (see the module comment): one grouped exchange of one element per pair, the pairs
/// taken in one global order (lowest rank first, then the other) so that the first unfinished
/// pair always has both ranks at it. Every rank of a pair must list the other.
pub fn connect_peers(comm: &dyn Communicator, peers: &[usize], timeout: Duration) -> DistResult<()> {
    let me = comm.rank();
    let mut pairs: Vec<(usize, usize)> = peers.iter().filter(|&&p| p != me).map(|&p| (me.min(p), me.max(p))).collect();
    pairs.sort_unstable();
    pairs.dedup();
    for (a, b) in pairs {
        let peer = if a == me { b } else { a };
        let out = Tensor::from_vec(vec![me as f32], 1, Device::Cpu)?.to_device(comm.device())?;
        let back = Tensor::zeros(1, DType::F32, comm.device())?;
        comm.send_recv(&out, peer, &back, peer)?.synchronize(timeout)?;
        if back.to_vec::<f32>()? != [peer as f32] {
            return Err(DistError::Collective {
                op: "pipeline connect",
                msg: format!("rank {me} got {:?} from rank {peer}", back.to_vec::<f32>()?),
            });
        }
    }
    Ok(())
}

/// A stage's forward: `(input, micro-batch)` to output. The first stage gets `None` and loads its
/// micro-batch itself; the last returns that micro-batch's scalar loss, already weighted as its
/// share of the step's loss (for equal micro-batches of a mean loss: divided by their count).
pub type StageForward = Box<dyn FnMut(Option<&Tensor>, usize) -> ferrograd_core::Result<Tensor> + Send>;

/// The dims of the activation between stage `b` and stage `b + 1` for micro-batch `i`, known on
/// every rank (a receiver allocates its buffer from it, so no shape travels).
pub type BoundaryDims = Arc<dyn Fn(usize, usize) -> Vec<usize> + Send + Sync>;

pub struct Stage {
    params: Vec<(String, Tensor)>,
    pub(crate) forward: StageForward,
}

impl Stage {
    pub fn new(
        params: Vec<(String, Tensor)>,
        forward: impl FnMut(Option<&Tensor>, usize) -> ferrograd_core::Result<Tensor> + Send + 'static,
    ) -> Stage {
        Stage { params, forward: Box::new(forward) }
    }

    pub fn params(&self) -> &[(String, Tensor)] {
        &self.params
    }
}

#[derive(Clone)]
pub struct PipelineConfig {
    pub schedule: ScheduleKind,
    pub micro_batches: usize,
    pub boundary: BoundaryDims,
    /// Element type of the activations and their gradients.
    pub dtype: DType,
}

/// What one step did on this rank.
#[derive(Debug, Default)]
pub struct StepStats {
    /// The last stage: the step's loss (sum of the weighted micro-batch losses), a device scalar.
    pub loss: Option<Tensor>,
    /// Most micro-batches whose activations this stage held at once.
    pub peak_held: usize,
}

pub struct Pipeline {
    comm: Arc<dyn Communicator>,
    stage: Stage,
    cfg: PipelineConfig,
    schedule: Schedule,
    program: Vec<Op>,
    grads: GradStore,
    clock: Clock,
    trace: bool,
}

impl Pipeline {
    /// This rank's part of a pipeline of `comm.world_size()` stages (rank `s` runs stage `s`).
    /// Makes this rank's connections to its neighbours first ([`connect_peers`]): every rank of the
    /// pipeline must call it at the same point.
    pub fn new(comm: Arc<dyn Communicator>, stage: Stage, cfg: PipelineConfig) -> DistResult<Pipeline> {
        Self::with_peers(comm, stage, cfg, &[])
    }

    /// `new`, connecting `extra` peers too (ranks that exchange more than activations with this
    /// one, e.g. the first and last stages of a model with tied embeddings).
    pub fn with_peers(
        comm: Arc<dyn Communicator>,
        stage: Stage,
        cfg: PipelineConfig,
        extra: &[usize],
    ) -> DistResult<Pipeline> {
        let (r, w) = (comm.rank(), comm.world_size());
        let mut peers: Vec<usize> = extra.to_vec();
        peers.extend(r.checked_sub(1));
        peers.extend(Some(r + 1).filter(|&n| n < w));
        connect_peers(comm.as_ref(), &peers, CONNECT_TIMEOUT)?;
        Self::unconnected(comm, stage, cfg)
    }

    /// A pipeline that leaves NCCL's connections to its first step: only for the test that shows
    /// that this hangs (`tests/dist_suite/pipeline.rs`).
    #[doc(hidden)]
    pub fn unconnected(comm: Arc<dyn Communicator>, stage: Stage, cfg: PipelineConfig) -> DistResult<Pipeline> {
        let schedule = Schedule::new(cfg.schedule, comm.world_size(), cfg.micro_batches)?;
        schedule.validate()?;
        let program = schedule.program(comm.rank());
        let clock = Clock::new(comm.device())?;
        let trace = std::env::var("FERROGRAD_PIPELINE_TRACE").is_ok_and(|v| v == "1");
        Ok(Pipeline { comm, stage, cfg, schedule, program, grads: GradStore::default(), clock, trace })
    }

    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    pub fn stage(&self) -> &Stage {
        &self.stage
    }

    pub fn is_last(&self) -> bool {
        self.comm.rank() + 1 == self.comm.world_size()
    }

    /// The gradients accumulated so far (until `step` or `zero_grad`).
    pub fn grads(&self) -> &GradStore {
        &self.grads
    }

    /// The accumulated gradients, to change before the optimizer steps (tied weights).
    pub fn grads_mut(&mut self) -> &mut GradStore {
        &mut self.grads
    }

    pub fn zero_grad(&mut self) {
        self.grads.clear();
    }

    /// This rank's communicator.
    pub fn comm(&self) -> &Arc<dyn Communicator> {
        &self.comm
    }

    /// Run every micro-batch forward and backward, adding this stage's gradients into `grads()`.
    /// On failure the communicator is aborted (every other rank's wait fails with the reason).
    pub fn run_micro_batches(&mut self) -> DistResult<StepStats> {
        match self.run_inner() {
            Ok(s) => Ok(s),
            Err(e) => {
                self.comm.abort(&format!("pipeline stage {}: {e}", self.comm.rank()));
                Err(e)
            }
        }
    }

    /// `run_micro_batches`, then this stage's optimizer step on the summed gradients.
    pub fn step(&mut self, opt: &mut dyn Optimizer) -> DistResult<StepStats> {
        let stats = self.run_micro_batches()?;
        if let Err(e) = opt.step(&self.grads) {
            self.comm.abort(&format!("pipeline stage {} optimizer step: {e}", self.comm.rank()));
            return Err(e.into());
        }
        self.grads.clear();
        Ok(stats)
    }

    /// Time this rank spent computing (forward and backward of its stage) since the last call,
    /// in milliseconds: device time of the compute stream on a GPU (waits for it), host time on
    /// the CPU.
    pub fn take_compute_ms(&mut self) -> DistResult<f64> {
        self.clock.take_ms()
    }

    fn err(&self, msg: String) -> DistError {
        DistError::Collective { op: "pipeline", msg: format!("stage {}: {msg}", self.comm.rank()) }
    }

    fn run_inner(&mut self) -> DistResult<StepStats> {
        let rank = self.comm.rank();
        let device = self.comm.device();
        // Per micro-batch: the input leaf (not on the first stage) and the output, between the
        // forward and the backward.
        let mut held: HashMap<usize, (Option<Tensor>, Tensor)> = HashMap::new();
        // Received tensors by (kind, micro), and outgoing ones waiting for their group.
        let mut inbox: HashMap<(Pass, usize), Tensor> = HashMap::new();
        let mut outbox: HashMap<(Pass, usize), Tensor> = HashMap::new();
        let mut sends: Vec<Work> = vec![];
        let mut loss: Option<Tensor> = None;
        let (mut in_flight, mut peak) = (0usize, 0usize);
        let program = self.program.clone();
        for op in &program {
            if self.trace {
                eprintln!("[pipeline rank {rank}] {op:?}");
            }
            match op {
                Op::Comm(group) => {
                    let mut send: Option<(Tensor, usize)> = None;
                    let mut recv: Option<(Tensor, usize, (Pass, usize))> = None;
                    for m in group {
                        match m.dir {
                            Dir::Send => {
                                let t = outbox
                                    .remove(&(m.kind, m.micro))
                                    .ok_or_else(|| self.err(format!("nothing to {m}")))?;
                                send = Some((t, m.peer));
                            }
                            Dir::Recv => {
                                let dims = self.dims_of(m);
                                let buf = Tensor::zeros(dims, self.cfg.dtype, device)?;
                                recv = Some((buf, m.peer, (m.kind, m.micro)));
                            }
                        }
                    }
                    match (send, recv) {
                        (Some((s, to)), Some((r, from, key))) => {
                            self.comm.send_recv(&s, to, &r, from)?.wait()?;
                            inbox.insert(key, r);
                        }
                        (Some((s, to)), None) => sends.push(self.comm.send(&s, to)?),
                        (None, Some((r, from, key))) => {
                            self.comm.recv(&r, from)?.wait()?;
                            inbox.insert(key, r);
                        }
                        (None, None) => {}
                    }
                }
                Op::Compute(a) => {
                    let timer = self.clock.start()?;
                    match a.pass {
                        Pass::Forward => {
                            let input = match inbox.remove(&(Pass::Forward, a.micro)) {
                                Some(x) => Some(x.requires_grad()),
                                None if rank == 0 => None,
                                None => return Err(self.err(format!("activation {} never arrived", a.micro))),
                            };
                            let out = (self.stage.forward)(input.as_ref(), a.micro)
                                .map_err(|e| self.err(format!("forward of micro-batch {}: {e}", a.micro)))?;
                            if self.is_last() {
                                if out.elem_count() != 1 {
                                    return Err(self.err(format!(
                                        "the last stage must return a scalar loss, got shape {:?}",
                                        out.dims()
                                    )));
                                }
                                let l = out.detach().reshape(())?;
                                loss = Some(match loss {
                                    None => l,
                                    Some(acc) => acc.add(&l)?,
                                });
                            } else {
                                let want = (self.cfg.boundary)(rank, a.micro);
                                if out.dims() != want.as_slice() || out.dtype() != self.cfg.dtype {
                                    return Err(self.err(format!(
                                        "micro-batch {} output is {} {:?}; the pipeline declares {} {want:?}",
                                        a.micro,
                                        out.dtype(),
                                        out.dims(),
                                        self.cfg.dtype
                                    )));
                                }
                                outbox.insert((Pass::Forward, a.micro), out.detach().contiguous()?);
                            }
                            held.insert(a.micro, (input, out));
                            in_flight += 1;
                            peak = peak.max(in_flight);
                        }
                        Pass::Backward => {
                            let (input, out) = held
                                .remove(&a.micro)
                                .ok_or_else(|| self.err(format!("backward of {} before its forward", a.micro)))?;
                            if self.is_last() {
                                out.backward_into(&mut self.grads)
                            } else {
                                let dy = inbox
                                    .remove(&(Pass::Backward, a.micro))
                                    .ok_or_else(|| self.err(format!("gradient {} never arrived", a.micro)))?;
                                out.backward_into_with(&dy, &mut self.grads)
                            }
                            .map_err(|e| self.err(format!("backward of micro-batch {}: {e}", a.micro)))?;
                            if let Some(x) = input {
                                let dx = match self.grads.remove(&x) {
                                    Some(g) => g.contiguous()?,
                                    // The stage ignores its input: its gradient is zero.
                                    None => x.detach().zeros_like()?,
                                };
                                outbox.insert((Pass::Backward, a.micro), dx);
                            }
                            in_flight -= 1;
                        }
                    }
                    self.clock.stop(timer)?;
                }
            }
        }
        // Compute after the step waits for the last sends (device-side; their buffers stay alive
        // until then).
        for w in sends {
            w.wait()?;
        }
        Ok(StepStats { loss, peak_held: peak })
    }

    fn dims_of(&self, m: &Msg) -> Vec<usize> {
        let rank = self.comm.rank();
        // An activation from rank s-1 crosses boundary s-1; a gradient from rank s+1 is that of
        // this stage's output, boundary s.
        let b = if m.kind == Pass::Forward { rank - 1 } else { rank };
        (self.cfg.boundary)(b, m.micro)
    }
}

/// Events are created in the thread's current context: make it this device's.
fn bind(dev: &CudaDevice) -> DistResult<()> {
    dev.context()
        .bind_to_thread()
        .map_err(|e| DistError::Collective { op: "pipeline timing", msg: format!("cuCtxSetCurrent: {e:?}") })
}

/// Compute time of one rank: events on the compute stream on a GPU, the host clock on the CPU.
enum Clock {
    Host { total_ms: f64 },
    Device { dev: Arc<CudaDevice>, pending: Vec<(Event, Event)>, total_ms: f64 },
}

enum Timer {
    Host(Instant),
    Device(Event),
}

impl Clock {
    fn new(device: Device) -> DistResult<Clock> {
        Ok(match device {
            Device::Cpu => Clock::Host { total_ms: 0.0 },
            Device::Cuda(i) => Clock::Device { dev: CudaDevice::get(i)?, pending: vec![], total_ms: 0.0 },
        })
    }

    fn start(&mut self) -> DistResult<Timer> {
        Ok(match self {
            Clock::Host { .. } => Timer::Host(Instant::now()),
            Clock::Device { dev, .. } => {
                // Recorded after the receive's wait: the stream reaches it once the input is there.
                bind(dev)?;
                let e = Event::timing()?;
                e.record(dev.current_cuda_stream())?;
                Timer::Device(e)
            }
        })
    }

    fn stop(&mut self, t: Timer) -> DistResult<()> {
        match (self, t) {
            (Clock::Host { total_ms }, Timer::Host(s)) => *total_ms += s.elapsed().as_secs_f64() * 1e3,
            (Clock::Device { dev, pending, total_ms }, Timer::Device(s)) => {
                bind(dev)?;
                let e = Event::timing()?;
                e.record(dev.current_cuda_stream())?;
                pending.push((s, e));
                // Fold in the pairs that are done, so a long run keeps few events.
                let mut keep = vec![];
                for (a, b) in pending.drain(..) {
                    if b.is_done() {
                        *total_ms += a.elapsed_ms(&b)? as f64;
                    } else {
                        keep.push((a, b));
                    }
                }
                *pending = keep;
            }
            _ => {}
        }
        Ok(())
    }

    fn take_ms(&mut self) -> DistResult<f64> {
        match self {
            Clock::Host { total_ms } => Ok(std::mem::take(total_ms)),
            Clock::Device { pending, total_ms, .. } => {
                for (a, b) in pending.drain(..) {
                    b.synchronize()?;
                    *total_ms += a.elapsed_ms(&b)? as f64;
                }
                Ok(std::mem::take(total_ms))
            }
        }
    }
}
