//! `gpt train`'s settings: what the command line asks for ([`TrainConfig`]), what a checkpoint must
//! agree on to resume ([`RunSettings`]), and what the run reports it chose ([`RunInfo`]). The run
//! itself is `train.rs`.

use super::config::GptConfig;
use super::dp::GptDist;
use ferrograd_core::Device;
use ferrograd_nn::optim::LrSchedule;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// Micro-batch size: given, or the largest power of two that fits in device memory (measured).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum BatchSize {
    Fixed(usize),
    Auto,
}

/// `Bf16`: f32 master weights, matmuls under a bf16 autocast scope. `F32`: everything in f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Precision {
    Bf16,
    F32,
}

#[derive(Debug, Clone)]
pub struct TrainConfig {
    pub model: GptConfig,
    /// Directory of `train_*.bin` / `val_*.bin` shards.
    pub data: PathBuf,
    /// Checkpoint, log and exported model go here.
    pub out: PathBuf,
    pub device: Device,
    pub steps: u64,
    pub batch: BatchSize,
    /// Tokens per sequence (`T`), at most the model's `n_positions`.
    pub context: usize,
    /// Tokens per optimizer step; a multiple of `B * T` (gradient accumulation). `None`: one micro-batch.
    pub total_batch: Option<usize>,
    pub lr: f64,
    /// The cosine schedule ends at `lr * min_lr_ratio`.
    pub min_lr_ratio: f64,
    /// Warm-up steps; `None`: `min(700, steps / 10)`.
    pub warmup: Option<u64>,
    pub weight_decay: f64,
    /// Clip the global gradient norm to this (0: no clipping).
    pub grad_clip: f64,
    pub precision: Precision,
    pub seed: u64,
    /// Read the loss back and log every this many steps.
    pub log_every: u64,
    /// Validation every this many steps (0: only at the end).
    pub val_every: u64,
    pub val_batches: usize,
    /// Checkpoint every this many steps (0: only at the end).
    pub save_every: u64,
    /// Continue from `out/checkpoint.safetensors`.
    pub resume: bool,
    /// Start from these weights (ours or a Hugging Face file/directory) instead of GPT-2's init.
    pub init: Option<PathBuf>,
    /// Write the initial weights here before the first step (for the PyTorch twin).
    pub save_init: Option<PathBuf>,
    /// On CUDA, capture the step as a CUDA graph after [`GRAPH_WARMUP`] eager steps and replay it
    /// (`--no-graph`: every step eager). Ignored on the CPU.
    pub graph: bool,
    /// Data parallel over the ranks of a launch (`gpt/dp.rs`); `None`: one process.
    pub dist: Option<GptDist>,
    /// Quantization-aware training: the block projections fake-quantized as int8 inference runs
    /// them (`quant::Linears::Qat`), typically a short fine-tune from `init`.
    pub qat: bool,
    /// The MLPs recompute their hidden activation in the backward instead of keeping it
    /// (`Gpt::recompute_gelu`): about 100 MB less a block at 16 x 1024 for GPT-2 124M in bf16, for
    /// one more store in the dz kernel. The default (`gpt train --keep-gelu` turns it off): with
    /// it the step's peak memory is below PyTorch's compiled step's.
    pub recompute_gelu: bool,
}

/// Eager steps (on the graph's side stream and pool) before the step is captured: kernels loaded,
/// cuBLAS workspaces made, the pool grown to what a step needs. They train like any step.
pub const GRAPH_WARMUP: usize = 2;

impl TrainConfig {
    /// The defaults for one GPU: gpt2 (124M) from scratch, 16 x 1024, bf16, lr 6e-4, wd 0.1, clip 1.
    pub fn gpu_defaults(data: PathBuf, out: PathBuf, device: Device) -> TrainConfig {
        TrainConfig {
            model: GptConfig::gpt2(),
            data,
            out,
            device,
            steps: 1000,
            batch: BatchSize::Fixed(16),
            context: 1024,
            total_batch: None,
            lr: 6e-4,
            min_lr_ratio: 0.1,
            warmup: None,
            weight_decay: 0.1,
            grad_clip: 1.0,
            precision: Precision::Bf16,
            seed: 0,
            log_every: 10,
            val_every: 250,
            val_batches: 20,
            save_every: 0,
            resume: false,
            init: None,
            save_init: None,
            graph: true,
            dist: None,
            qat: false,
            recompute_gelu: true,
        }
    }

    pub fn warmup_steps(&self) -> u64 {
        self.warmup.unwrap_or((self.steps / 10).min(700))
    }

    pub fn schedule(&self) -> LrSchedule {
        LrSchedule::WarmupCosine {
            peak: self.lr,
            warmup: self.warmup_steps(),
            total: self.steps,
            min: self.lr * self.min_lr_ratio,
        }
    }
}

/// What must agree between a checkpoint and the run that resumes it (for bit-identical batches
/// and updates); recorded in every checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunSettings {
    pub model: GptConfig,
    pub micro_batch: usize,
    pub context: usize,
    /// Micro-batches per optimizer step over all ranks (so a checkpoint resumes on any number of
    /// GPUs that divides it).
    pub grad_accum: usize,
    pub steps: u64,
    pub lr: f64,
    pub min_lr_ratio: f64,
    pub warmup: u64,
    pub weight_decay: f64,
    pub grad_clip: f64,
    pub precision: Precision,
    pub seed: u64,
}

/// Settings fixed at the start of a run, for the progress display.
#[derive(Debug, Clone, Serialize)]
pub struct RunInfo {
    pub parameters: usize,
    pub micro_batch: usize,
    /// Micro-batches per step on each rank.
    pub grad_accum: usize,
    /// Ranks training together (1: a single process).
    pub world: usize,
    /// Tokens per optimizer step over all ranks.
    pub tokens_per_step: usize,
    pub train_tokens: usize,
    pub val_tokens: Option<usize>,
    /// Step the run starts from (0, or the checkpoint's step).
    pub start_step: u64,
    pub device: String,
    /// bf16 (or f32) dense peak of the device, when known: the MFU denominator.
    pub peak_flops: Option<f64>,
    /// How `--batch auto` chose, when it did.
    pub auto_batch: Option<String>,
    pub notes: Vec<String>,
}
