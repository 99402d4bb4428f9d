//! GPT-2, trained end to end on real text (issue 13).
//!
//! - `config`: the four published sizes and small ones; parameter count, FLOPs per token.
//! - `model`: the model with Hugging Face `GPT2LMHeadModel` names and layouts, padded vocabulary.
//! - `ops`: its building blocks, one function each, where fused kernels slot in.
//! - `hf`: reading and writing Hugging Face checkpoints (`save_pretrained` directories).
//! - `tokenizer`, `shards`, `prepare`, `loader`: text to llm.c token shards to batches.
//! - `optim`: AdamW in two groups (decay on matrices only).
//! - `train`: one run's state and step (accumulation, schedule, clipping, validation,
//!   checkpoints, resume); `fit`: the loop, its log and summary; `autobatch`: `--batch auto`;
//!   `dp`: data parallel over several GPUs (hooks from `ferrograd-dist`); `zero`: ZeRO-1, the
//!   AdamW of `optim` over this rank's shard; `startup`: where the start of a run goes
//!   (`FERROGRAD_PROFILE=1`).
//! - `sample`: generation with a KV cache, temperature and top-k.
//! - `quant`: int8 projections (W8A16, W8A8), the int8 weights file, QAT (issue 18).

mod autobatch;
pub mod config;
pub mod dp;
pub(crate) mod fit;
pub mod hf;
pub mod kernels;
pub mod loader;
pub mod model;
pub mod ops;
pub mod optim;
pub mod pipeline;
pub mod prepare;
pub mod quant;
pub mod sample;
pub mod settings;
pub mod shards;
pub mod startup;
pub mod tokenizer;
pub mod train;
mod zero;

pub use config::{GptConfig, EOT, GPT2_VOCAB};
pub use model::{Gpt, HfView};
pub use tokenizer::Tokenizer;
