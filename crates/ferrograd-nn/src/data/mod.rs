//! Data loading: the `Dataset` trait, a loader whose background thread assembles (and, for a GPU,
//! pins) batches ahead of the training loop, seeded shuffling, and the transfer/compute overlap
//! benchmark behind `ferrograd bench overlap`.

mod dataset;
mod loader;
mod overlap;
mod shuffle;

pub use dataset::{Dataset, TensorDataset};
pub use loader::{Batch, Batches, DataLoader, LoaderConfig, Shard};
pub use overlap::{measure_overlap, OverlapConfig, OverlapReport};
pub use shuffle::shuffled_order;
