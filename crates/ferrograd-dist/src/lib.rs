//! ferrograd-dist: training on several GPUs, one process per GPU, over NCCL.
//!
//! - [`env`](mod@env): rank, world size and local rank from `ferrograd launch`, torchrun or Slurm;
//! - [`rendezvous`]: rank 0 serves the NCCL id over TCP at `MASTER_ADDR:MASTER_PORT`;
//! - [`nccl`]: NCCL, loaded at run time, behind the [`Communicator`] trait, on its own stream;
//! - [`ProcessGroup`]: all of the above from the environment in one call;
//! - [`DataParallel`]: an optimizer wrapper that averages gradients in buckets while backward
//!   runs (optionally in bf16), or shards AdamW's state with ZeRO-1, and checkpoints that resume
//!   on any number of GPUs;
//! - [`pipeline`]: pipeline (model) parallelism, GPipe and 1F1B schedules over send/recv;
//! - [`testing`]: an in-process communicator over threads, the test scaffolding that lets all of
//!   this be tested without GPUs.
//!
//! ```no_run
//! use ferrograd_dist::{DataParallel, DpConfig, ProcessGroup};
//! use ferrograd_nn::optim::{AdamConfig, Optimizer};
//! # fn model_params(_: ferrograd_core::Device) -> Vec<(String, ferrograd_core::Tensor)> { vec![] }
//! # fn loss_of(_: usize) -> ferrograd_core::Result<ferrograd_core::Tensor> { todo!() }
//! let pg = ProcessGroup::init()?; // world of 1 without launcher variables
//! let params = model_params(pg.device());
//! let adam = AdamConfig { lr: 6e-4, weight_decay: 0.1, decoupled: true, ..Default::default() };
//! let mut opt = DataParallel::with_adam(pg.comm(), params, adam, DpConfig::default())?;
//! let mut grads = ferrograd_core::GradStore::default();
//! opt.backward(&loss_of(pg.rank())?, &mut grads, true)?; // all-reduces during backward
//! opt.step(&grads)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod bucket;
pub mod comm;
pub mod dp;
pub mod env;
pub mod error;
pub mod group;
pub mod nccl;
pub mod pipeline;
pub mod rendezvous;
pub mod testing;
pub mod workload;

pub use comm::{CommStats, Communicator, ReduceOp, Solo, Work};
pub use dp::{DataParallel, DpConfig, LaunchRecord};
pub use env::{DistEnv, Launcher};
pub use error::{DistError, DistResult};
pub use group::ProcessGroup;

/// The slice `[rank * n / world, (rank + 1) * n / world)` of `n` items; `n` must split evenly
/// (unequal slices would weigh samples unequally once gradients are averaged).
pub fn shard_range(n: usize, rank: usize, world: usize) -> DistResult<std::ops::Range<usize>> {
    ferrograd_nn::data::Shard { rank, world }.range(n).map_err(DistError::from)
}
