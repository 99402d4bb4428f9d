//! Pipeline (model) parallelism: a model cut into an ordered list of stages, one per rank, each
//! micro-batch's activations sent forward and their gradients back between neighbouring ranks.
//!
//! - [`schedule`]: GPipe and 1F1B as plain data (per rank, the list of (stage, micro-batch,
//!   forward | backward) actions), the programs of grouped sends and receives the ranks run, and
//!   the checks CI runs on them without GPUs: validity, the bubble on a virtual clock against
//!   `(p - 1) / (m + p - 1)`, held activations, and freedom from point-to-point deadlock;
//! - [`runner`]: one rank's stage and the loop that runs its program over any [`Communicator`]
//!   (NCCL between processes, `testing::ThreadComm` in CI), accumulating the stage's gradients
//!   over the micro-batches for its optimizer;
//! - [`local`]: the single-process variant, every stage on a GPU of this host, activations moved
//!   by peer copies (`Tensor::to_device`);
//! - [`Measure`]: the measured bubble of a run (compute time of every rank against the wall time).
//!
//! Several stages on one GPU are one stage of the pipeline (their forwards composed), so a model
//! of four stage groups runs on two GPUs as two stages of two groups each.
//!
//! ```no_run
//! use ferrograd_dist::pipeline::{Pipeline, PipelineConfig, ScheduleKind, Stage};
//! use ferrograd_dist::ProcessGroup;
//! use ferrograd_core::DType;
//! use std::sync::Arc;
//! # fn stage_for(_: usize) -> Stage { todo!() }
//! # fn adam_for(_: &Stage) -> Box<dyn ferrograd_nn::optim::Optimizer> { todo!() }
//! let pg = ProcessGroup::init()?;
//! let stage = stage_for(pg.rank()); // its layers on pg.device(); the last returns the loss
//! let mut opt = adam_for(&stage);
//! let cfg = PipelineConfig {
//!     schedule: ScheduleKind::OneFOneB,
//!     micro_batches: 8,
//!     boundary: Arc::new(|_stage, _micro| vec![64, 1024]), // [rows, width] between stages
//!     dtype: DType::F32,
//! };
//! let mut pipe = Pipeline::new(pg.comm(), stage, cfg)?;
//! let stats = pipe.step(opt.as_mut())?; // 8 micro-batches forward and back, then Adam
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod local;
pub mod runner;
pub mod schedule;

pub use local::LocalPipeline;
pub use runner::{BoundaryDims, Pipeline, PipelineConfig, Stage, StageForward, StepStats};
pub use schedule::{theoretical_bubble, Action, Pass, Schedule, ScheduleKind, Simulation};

use crate::comm::{Communicator, ReduceOp};
use crate::error::DistResult;
use ferrograd_core::{Device, Tensor};

/// The measured bubble of a run: `1 - (mean compute time of a rank) / (wall time)`, so everything
/// that is not a stage's forward or backward (waiting for a neighbour, messages, the optimizer
/// step, the host) counts as bubble.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Measure {
    pub stages: usize,
    pub micro_batches: usize,
    /// Compute time of each rank, summed over the ranks, milliseconds.
    pub compute_ms_sum: f64,
    pub wall_ms: f64,
}

impl Measure {
    /// Gather every rank's compute time (`Pipeline::take_compute_ms`) over `comm`; `wall_ms` is
    /// the longest rank's.
    pub fn gather(comm: &dyn Communicator, micro_batches: usize, compute_ms: f64, wall_ms: f64) -> DistResult<Measure> {
        // Two tensors of their own: a narrowed view would hand NCCL an offset pointer.
        let scalar = |v: f64| Tensor::from_vec(vec![v], 1, Device::Cpu)?.to_device(comm.device());
        let (sum, max) = (scalar(compute_ms)?, scalar(wall_ms)?);
        comm.all_reduce(&sum, ReduceOp::Sum)?.wait()?;
        comm.all_reduce(&max, ReduceOp::Max)?.wait()?;
        Ok(Measure {
            stages: comm.world_size(),
            micro_batches,
            compute_ms_sum: sum.item_f64()?,
            wall_ms: max.item_f64()?,
        })
    }

    pub fn bubble(&self) -> f64 {
        if self.wall_ms <= 0.0 {
            return 0.0;
        }
        (1.0 - self.compute_ms_sum / (self.stages as f64 * self.wall_ms)).max(0.0)
    }

    pub fn theory(&self) -> f64 {
        theoretical_bubble(self.stages, self.micro_batches)
    }
}
