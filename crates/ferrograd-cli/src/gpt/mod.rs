//! `ferrograd gpt ...`: GPT-2 on real text. `prepare` turns text files into token shards, `train`
//! trains (GPU or CPU), `sample` generates from a checkpoint, `logits` prints a checkpoint's logits
//! for a prompt (the Hugging Face check), `plot` draws loss curves from JSON-lines logs, `quantize`
//! writes an int8 weights file and `eval` prints validation perplexity in float, bf16 and int8.

pub(crate) mod dist;
mod pipeline;
mod plot;
mod prepare;
mod quant;
mod sample;
pub(crate) mod train;

use crate::CliResult;
use clap::{Args, Subcommand};
use std::io::Write;

#[derive(Args, Debug)]
pub struct GptArgs {
    #[command(subcommand)]
    pub command: GptCommand,
}

#[derive(Subcommand, Debug)]
pub enum GptCommand {
    /// Tokenize UTF-8 text files (GPT-2 tokenizer) into llm.c train/val token shards.
    Prepare(prepare::PrepareArgs),
    /// Train GPT-2 on token shards (defaults: gpt2 124M from scratch, 16 x 1024, bf16 on a GPU).
    Train(Box<train::TrainArgs>),
    /// Continue a prompt with a trained model or a Hugging Face save_pretrained directory.
    Sample(sample::SampleArgs),
    /// Quantize a checkpoint's block projections to int8 (per output channel) into a safetensors file.
    Quantize(quant::QuantizeArgs),
    /// Validation loss and perplexity of a checkpoint: f32, bf16, int8 W8A16 and W8A8.
    Eval(quant::EvalArgs),
    /// Write a model's logits for a prompt to a safetensors file (checks against Hugging Face).
    Logits(sample::LogitsArgs),
    /// Draw the loss curves of one or more JSON-lines logs (ours or the PyTorch twin's) as a PNG.
    Plot(plot::PlotArgs),
}

pub fn run(a: GptArgs, out: &mut dyn Write) -> CliResult<()> {
    match a.command {
        GptCommand::Prepare(a) => prepare::run(a, out),
        GptCommand::Train(a) => train::run(*a, out),
        GptCommand::Sample(a) => sample::run(a, out),
        GptCommand::Logits(a) => sample::logits(a, out),
        GptCommand::Quantize(a) => quant::quantize(a, out),
        GptCommand::Eval(a) => quant::eval(a, out),
        GptCommand::Plot(a) => plot::run(a, out),
    }
}

/// What to try after running out of GPU memory in a `gpt` command.
pub fn oom_hint(c: &GptCommand) -> &'static str {
    match c {
        GptCommand::Train(_) => {
            "try a smaller micro-batch (--batch 8, or --batch auto to find the largest that fits) and keep the \
             step size with --total-batch, or a shorter --context"
        }
        GptCommand::Sample(_) | GptCommand::Logits(_) | GptCommand::Eval(_) => {
            "try a smaller model or run on the CPU (--device cpu)"
        }
        _ => "free memory held by other processes (nvidia-smi lists them)",
    }
}

/// `1.23 GiB`
pub(crate) fn human_bytes(b: usize) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    format!("{v:.1} {}", UNITS[u])
}

/// `512.3K`
pub(crate) fn human_count(v: f64) -> String {
    if v >= 1e6 {
        format!("{:.2}M", v / 1e6)
    } else if v >= 1e3 {
        format!("{:.1}K", v / 1e3)
    } else {
        format!("{v:.0}")
    }
}
