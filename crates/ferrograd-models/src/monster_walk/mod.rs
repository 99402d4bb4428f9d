//! Monster Walk: fill a device with tensors derived from the order of the Monster group and train a
//! small autoencoder over all of them (`docs/monster-walk.md` is the definition, for users).
//!
//! - `walk`: exact big-integer walk and digit sums (CPU).
//! - `data`: the four resident representations of a copy, built on the target device.
//! - `plan`: how many copies fit, measured from the allocator.
//! - `model`: the 71-47-23-11-5-11-23-47-71 autoencoder and its PyTorch-named weights.
//! - `fused`: the CUDA training step in two kernel launches.
//! - `kernels`: the kernel modules a GPU run launches (compiled at once at its start).
//! - `persistent`: the whole run in one cooperative kernel (`crate::persistent`), the default on a GPU.
//! - `train`: the training run and its report.
//! - `dp`: data parallel under `ferrograd launch` (hooks into the process group, the fused step
//!   with the all-reduce).

pub mod data;
pub mod dp;
pub mod fused;
pub mod kernels;
pub mod model;
pub mod persistent;
pub mod plan;
mod stepper;
pub mod train;
pub mod walk;

pub use data::CopyData;
pub use model::Autoencoder;
pub use plan::{MemoryPlan, PlanRequest};
pub use train::{run, Report, TrainConfig};
