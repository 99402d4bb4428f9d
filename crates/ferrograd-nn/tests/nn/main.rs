//! ferrograd-nn's tests, one binary (one link) with a module per area. CUDA tests live beside the
//! CPU ones and skip with one printed line when no GPU is usable.

mod amp;
mod checkpoint;
mod checkpoint_files;
mod common;
mod cuda;
mod data;
mod learn;
mod mamba;
mod modules;
mod optim;
mod quant;
mod safetensors_files;
mod trainer;
