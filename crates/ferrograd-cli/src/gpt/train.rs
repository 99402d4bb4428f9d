//! `gpt train`: flags to a `TrainConfig`, a progress bar (or lines), the summary, `summary.json`
//! and `loss.png` beside the checkpoint.
//!
//! Defaults: on a GPU GPT-2 124M from scratch, micro-batch 16 x 1024, bf16 autocast; on the CPU a
//! small model (4 layers, 4 heads, 128 channels, context 128, micro-batch 8) that trains in minutes.
//! With `--resume` the checkpoint's settings are the defaults; flags given still apply and a
//! mismatch that would change the run is refused.

use super::{human_bytes, human_count};
use crate::CliResult;
use clap::{Args, ValueEnum};
use ferrograd_core::Device;
use ferrograd_models::gpt::hf;
use ferrograd_models::gpt::train::{train, BatchSize, Event, Precision, Run, StepStats, TrainConfig};
use ferrograd_models::gpt::GptConfig;
use indicatif::{ProgressBar, ProgressStyle};
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::time::Instant;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PrecisionArg {
    /// f32 master weights, matmuls in bf16 (autocast)
    Bf16,
    /// everything in f32 (no TF32)
    F32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ProgressArg {
    /// a bar on a terminal, lines otherwise
    Auto,
    Bar,
    Lines,
    Quiet,
}

#[derive(Args, Debug)]
pub struct TrainArgs {
    /// Directory of token shards (train_*.bin, val_*.bin), from `gpt prepare`.
    #[arg(long, default_value = "data/shakespeare")]
    pub data: PathBuf,
    /// Directory for checkpoint.safetensors, log.jsonl, loss.png, summary.json and model/.
    #[arg(long, default_value = "runs/gpt")]
    pub out: PathBuf,
    /// Model size: gpt2 (124M), gpt2-medium, gpt2-large, gpt2-xl (default gpt2 on a GPU).
    #[arg(long)]
    pub model: Option<String>,
    /// Transformer blocks (overrides --model).
    #[arg(long)]
    pub layers: Option<usize>,
    /// Attention heads (overrides --model).
    #[arg(long)]
    pub heads: Option<usize>,
    /// Channels, n_embd (overrides --model).
    #[arg(long)]
    pub dim: Option<usize>,
    /// Tokens per sequence (default 1024 on a GPU, 128 on the CPU).
    #[arg(long)]
    pub context: Option<usize>,
    /// Optimizer steps (default 1000 on a GPU, 200 on the CPU).
    #[arg(long)]
    pub steps: Option<u64>,
    /// Sequences per micro-batch, or `auto` for the largest power of two that fits (GPU).
    #[arg(long, value_parser = parse_batch)]
    pub batch: Option<BatchSize>,
    /// Tokens per optimizer step, a multiple of batch x context (gradient accumulation).
    #[arg(long)]
    pub total_batch: Option<usize>,
    /// Peak learning rate (AdamW, betas 0.9/0.95).
    #[arg(long)]
    pub lr: Option<f64>,
    /// Warm-up steps (default min(700, steps/10)), then cosine decay to lr x --min-lr-ratio.
    #[arg(long)]
    pub warmup: Option<u64>,
    #[arg(long)]
    pub min_lr_ratio: Option<f64>,
    /// Decoupled weight decay on matrices and embeddings (not on biases and norms).
    #[arg(long)]
    pub weight_decay: Option<f64>,
    /// Clip the global gradient norm to this (0: off).
    #[arg(long)]
    pub clip: Option<f64>,
    /// bf16 (default on a GPU) or f32 (default on the CPU).
    #[arg(long, value_enum)]
    pub precision: Option<PrecisionArg>,
    /// cpu, cuda or cuda:N (default: the best device).
    #[arg(long)]
    pub device: Option<Device>,
    /// Seed of the initial weights.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Read the loss back and log every N steps.
    #[arg(long, default_value_t = 10)]
    pub log_every: u64,
    /// Validation loss every N steps (0: only at the end).
    #[arg(long, default_value_t = 250)]
    pub val_every: u64,
    /// Micro-batches of the val split each validation averages.
    #[arg(long, default_value_t = 20)]
    pub val_batches: usize,
    /// Checkpoint every N steps (0: only at the end).
    #[arg(long, default_value_t = 0)]
    pub save_every: u64,
    /// Continue from OUT/checkpoint.safetensors, bit for bit.
    #[arg(long)]
    pub resume: bool,
    /// Start from these weights: a .safetensors file (ours or Hugging Face's) or a save_pretrained directory.
    #[arg(long, conflicts_with = "resume")]
    pub init: Option<PathBuf>,
    /// Write the initial weights (Hugging Face names) here before the first step; with --steps 0, only that.
    #[arg(long, value_name = "FILE", conflicts_with = "resume")]
    pub save_init: Option<PathBuf>,
    /// Run every step eagerly instead of replaying it as a CUDA graph (CUDA only).
    #[arg(long)]
    pub no_graph: bool,
    /// Quantization-aware training: the block projections fake-quantized to int8 (weights per
    /// output channel, inputs per token) as `gpt quantize` / `gpt eval` run them; usually a short
    /// fine-tune from --init.
    #[arg(long)]
    pub qat: bool,
    /// Keep each MLP's hidden activation (GELU of its pre-activation) from the forward for the
    /// backward. By default it is not kept: the backward's dz kernel writes it again as it reads
    /// the pre-activation (about 100 MB a block less for GPT-2 124M at 16 x 1024 in bf16, for
    /// under 1% of the tokens per second on an H200).
    #[arg(long, conflicts_with = "recompute_gelu")]
    pub keep_gelu: bool,
    /// The default (see --keep-gelu); accepted for the scripts that asked for it.
    #[arg(long)]
    pub recompute_gelu: bool,
    #[arg(long, value_enum, default_value = "auto")]
    pub progress: ProgressArg,
    /// Under `ferrograd launch`: gradients travel between GPUs as f32 or bf16.
    #[arg(long, default_value = "f32", value_parser = crate::bench::allreduce::parse_dtype)]
    pub comm_dtype: ferrograd_core::DType,
    /// Under `ferrograd launch`: gradient bucket size in MiB (all-reduced while backward runs).
    #[arg(long, default_value_t = 25.0)]
    pub bucket_mib: f64,
    /// Under `ferrograd launch`: 1 for ZeRO-1: gradients reduce-scattered, each GPU runs AdamW on
    /// its 1/N of the parameters (moments for those only: optimizer memory / N), then the
    /// parameters are all-gathered. Checkpoints stay plain (they resume with or without it).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=1), conflicts_with = "pipeline")]
    pub zero: u8,
    /// Pipeline parallel: cut the blocks into N even stage groups (embeddings with the first; ln_f,
    /// head and loss with the last) over the ranks of `ferrograd launch` (N / ranks groups per GPU),
    /// or N stages in this process; f32, `gpt/pipeline.rs`.
    #[arg(long, value_parser = crate::parse_count, conflicts_with_all = ["resume", "init", "save_init"])]
    pub pipeline: Option<usize>,
    /// With --pipeline: micro-batches (of --batch sequences) per step.
    #[arg(long, value_parser = crate::parse_count, default_value_t = 8, requires = "pipeline")]
    pub micro_batches: usize,
    /// With --pipeline: gpipe or 1f1b.
    #[arg(long, default_value = "1f1b", requires = "pipeline")]
    pub schedule: String,
}

fn parse_batch(s: &str) -> Result<BatchSize, String> {
    if s.eq_ignore_ascii_case("auto") {
        return Ok(BatchSize::Auto);
    }
    match s.parse::<usize>() {
        Ok(n) if n > 0 => Ok(BatchSize::Fixed(n)),
        _ => Err(format!("`{s}`: expected a positive number of sequences or `auto`")),
    }
}

/// The small model the CPU trains by default.
fn cpu_model() -> GptConfig {
    GptConfig { n_positions: 256, n_layer: 4, n_head: 4, n_embd: 128, ..GptConfig::gpt2() }
}

fn config(a: &TrainArgs, device: Device) -> CliResult<(TrainConfig, Vec<String>)> {
    let mut notes = vec![];
    let on_cpu = device.is_cpu();
    let mut c = TrainConfig::gpu_defaults(a.data.clone(), a.out.clone(), device);
    if a.resume {
        let s = Run::saved_settings(&a.out)?;
        c.model = s.model;
        c.batch = BatchSize::Fixed(s.micro_batch);
        c.context = s.context;
        c.total_batch = Some(s.micro_batch * s.context * s.grad_accum);
        c.steps = s.steps;
        c.lr = s.lr;
        c.min_lr_ratio = s.min_lr_ratio;
        c.warmup = Some(s.warmup);
        c.weight_decay = s.weight_decay;
        c.grad_clip = s.grad_clip;
        c.precision = s.precision;
        c.seed = s.seed;
    } else if let Some(init) = &a.init {
        let (m, note) = hf::read_config(&hf::Source::locate(init)?)?;
        c.model = m;
        c.context = c.context.min(m.n_positions);
        notes.push(format!("--init {}: {note}", init.display()));
    } else if on_cpu && a.model.is_none() {
        c.model = cpu_model();
        c.context = 128;
        c.batch = BatchSize::Fixed(8);
        c.steps = 200;
        c.precision = Precision::F32;
        let shaped = a.layers.is_some() || a.heads.is_some() || a.dim.is_some() || a.context.is_some();
        let sized = shaped || a.batch.is_some() || a.steps.is_some();
        if !sized {
            notes.push(
                "no GPU: training a small model (4 layers, 4 heads, dim 128, context 128, batch 8, 200 steps) so that \
             the CPU finishes in minutes; --model/--layers/--heads/--dim/--context/--batch/--steps change it"
                    .into(),
            );
        }
    }
    if let Some(m) = &a.model {
        c.model = GptConfig::preset(m)?;
    }
    let sized = a.layers.is_some() || a.heads.is_some() || a.dim.is_some();
    if (a.resume || a.init.is_some()) && (sized || a.model.is_some()) {
        return Err("--model/--layers/--heads/--dim cannot change the shape of a resumed or --init model".into());
    }
    c.model.n_layer = a.layers.unwrap_or(c.model.n_layer);
    c.model.n_head = a.heads.unwrap_or(c.model.n_head);
    c.model.n_embd = a.dim.unwrap_or(c.model.n_embd);
    if let Some(t) = a.context {
        if t > c.model.n_positions && !a.resume && a.init.is_none() {
            c.model.n_positions = t;
        }
        c.context = t;
    }
    c.steps = a.steps.unwrap_or(c.steps);
    c.batch = a.batch.unwrap_or(c.batch);
    c.total_batch = a.total_batch.or(c.total_batch);
    c.lr = a.lr.unwrap_or(c.lr);
    c.warmup = a.warmup.or(c.warmup);
    c.min_lr_ratio = a.min_lr_ratio.unwrap_or(c.min_lr_ratio);
    c.weight_decay = a.weight_decay.unwrap_or(c.weight_decay);
    c.grad_clip = a.clip.unwrap_or(c.grad_clip);
    c.precision = match a.precision {
        Some(PrecisionArg::Bf16) => Precision::Bf16,
        Some(PrecisionArg::F32) => Precision::F32,
        None if on_cpu && !a.resume => Precision::F32,
        None => c.precision,
    };
    c.seed = a.seed.unwrap_or(c.seed);
    c.log_every = a.log_every;
    c.val_every = a.val_every;
    c.val_batches = a.val_batches;
    c.save_every = a.save_every;
    c.resume = a.resume;
    c.init = a.init.clone();
    c.save_init = a.save_init.clone();
    // A replayed CUDA graph records no per-kernel times, and the profile divides by every steady
    // step: profiling runs the steps eagerly, so its table is each step's kernels.
    let profiling = crate::profiling_on(device);
    if profiling && !a.no_graph {
        notes.push(crate::PROFILE_EAGER_NOTE.into());
    }
    c.graph = !a.no_graph && !profiling;
    c.qat = a.qat;
    c.recompute_gelu = !a.keep_gelu;
    Ok((c, notes))
}

pub(crate) fn stats_line(s: &StepStats, steps: u64) -> String {
    let mfu = s.mfu.map(|m| format!(" | MFU {:.1}%", 100.0 * m)).unwrap_or_default();
    let mem = s.mem_bytes.map(|m| format!(" | mem {}", human_bytes(m))).unwrap_or_default();
    format!(
        "step {}/{steps} | loss {:.4} | lr {:.2e} | norm {:.3} | {} tok/s{mfu}{mem}",
        s.step,
        s.loss,
        s.lr,
        s.grad_norm,
        human_count(s.tokens_per_s)
    )
}

pub fn run(a: TrainArgs, out: &mut dyn Write) -> CliResult<()> {
    let started = Instant::now();
    if !(a.bucket_mib > 0.0 && a.bucket_mib <= (1u64 << 20) as f64) {
        return Err(format!("--bucket-mib {} must be a positive number of MiB, at most 1048576", a.bucket_mib).into());
    }
    // Under `ferrograd launch`: data parallel, this process on cuda:LOCAL_RANK.
    let pg = crate::monster_dist::group()?;
    let (device, why) = crate::monster_dist::device_for(pg.as_ref(), a.device)?;
    let (mut cfg, notes) = config(&a, device)?;
    if a.pipeline.is_some() {
        return super::pipeline::run(&a, &cfg, pg, out);
    }
    let main_rank = pg.as_ref().is_none_or(|p| p.is_main());
    if let Some(pg) = &pg {
        let dp = ferrograd_dist::DpConfig {
            bucket_bytes: (a.bucket_mib * (1 << 20) as f64) as usize,
            comm_dtype: a.comm_dtype,
            zero: a.zero,
        };
        cfg.dist = Some(super::dist::hooks(pg.comm(), dp));
    } else if a.zero == 1 {
        writeln!(
            out,
            "--zero 1: one process (no `ferrograd launch` group), nothing to shard; AdamW keeps its whole state"
        )?;
    }
    // Other ranks say nothing but errors: rank 0 speaks for the group.
    let a = if main_rank { a } else { TrainArgs { progress: ProgressArg::Quiet, ..a } };
    for n in notes.iter().filter(|_| main_rank) {
        writeln!(out, "{n}")?;
    }
    let steps = cfg.steps;
    let out_dir = cfg.out.clone();
    let precision = cfg.precision;
    let mode = match a.progress {
        ProgressArg::Auto if std::io::stderr().is_terminal() => ProgressArg::Bar,
        ProgressArg::Auto => ProgressArg::Lines,
        m => m,
    };
    let bar = if mode == ProgressArg::Bar { ProgressBar::new(steps) } else { ProgressBar::hidden() };
    if let Ok(style) = ProgressStyle::with_template("{bar:30} {pos}/{len} [{elapsed_precise}<{eta_precise}] {msg}") {
        bar.set_style(style);
    }
    let mut lines: Vec<String> = vec![];
    let mut io_err: Option<std::io::Error> = None;
    let mut say = |out: &mut dyn Write, bar: &ProgressBar, s: String| {
        if mode == ProgressArg::Bar {
            bar.println(&s);
        } else if mode == ProgressArg::Lines {
            if let Err(e) = writeln!(out, "{s}") {
                io_err.get_or_insert(e);
            }
        }
        lines.push(s);
    };
    let summary = train(cfg, started, |e| match e {
        Event::Started(info) => {
            bar.set_position(info.start_step);
            let mut s = format!(
                "gpt train on {} ({why}): {:.1}M parameters, micro-batch {} x {} (x{} accumulation{} = {} tokens/step), {}",
                info.device,
                info.parameters as f64 / 1e6,
                info.micro_batch,
                info.tokens_per_step / (info.micro_batch * info.grad_accum * info.world).max(1),
                info.grad_accum,
                if info.world > 1 { format!(" x {} GPUs", info.world) } else { String::new() },
                info.tokens_per_step,
                if precision == Precision::Bf16 { "bf16 autocast" } else { "f32" },
            );
            s.push_str(&format!(
                "; data: {} train tokens{}",
                info.train_tokens,
                info.val_tokens.map(|v| format!(", {v} val")).unwrap_or_default()
            ));
            if info.start_step > 0 {
                s.push_str(&format!("; resuming at step {}", info.start_step));
            }
            let mut msgs = vec![s];
            msgs.extend(info.auto_batch.clone());
            msgs.extend(info.notes.iter().cloned());
            for m in msgs {
                say(&mut *out, &bar, m);
            }
        }
        Event::Progress(step) => bar.set_position(step),
        Event::Logged(s) => {
            if mode == ProgressArg::Bar {
                let mfu = s.mfu.map(|m| format!(" | MFU {:.1}%", 100.0 * m)).unwrap_or_default();
                let mem = s.mem_bytes.map(|m| format!(" | {}", human_bytes(m))).unwrap_or_default();
                bar.set_message(format!("loss {:.4} | {} tok/s{mfu}{mem}", s.loss, human_count(s.tokens_per_s)));
            } else {
                say(&mut *out, &bar, stats_line(s, steps));
            }
        }
        Event::Validated { step, loss } => say(&mut *out, &bar, format!("step {step}/{steps} | val loss {loss:.4}")),
        Event::Saved { .. } => {}
    });
    bar.finish_and_clear();
    if let Some(e) = io_err {
        return Err(e.into());
    }
    let s = summary?;
    if !main_rank {
        return Ok(());
    }
    if mode == ProgressArg::Bar {
        // The bar showed the lines as they came; keep the record on stdout too.
        for l in &lines {
            writeln!(out, "{l}")?;
        }
    }
    let fmt = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.4}"));
    writeln!(
        out,
        "done: {} steps in {:.1} s | loss {} -> {} | val {} | {} tok/s{} | peak mem {} | first step after {:.2} s",
        s.steps,
        s.train_s,
        fmt(s.first_loss),
        fmt(s.final_loss),
        fmt(s.final_val_loss),
        human_count(s.tokens_per_s),
        s.mfu.map(|m| format!(" (MFU {:.1}%)", 100.0 * m)).unwrap_or_default(),
        s.peak_mem_bytes.map_or("-".to_string(), human_bytes),
        s.startup_s
    )?;
    let summary_path = out_dir.join("summary.json");
    let json = serde_json::to_string_pretty(&s)?;
    ferrograd_nn::checkpoint::write_atomic(&summary_path, json.as_bytes())
        .map_err(|e| format!("writing {}: {e}", summary_path.display()))?;
    let png = out_dir.join("loss.png");
    match super::plot::draw(std::slice::from_ref(&s.log), &[], &png, "GPT training loss") {
        Ok(()) => writeln!(out, "wrote {}", png.display())?,
        Err(e) => writeln!(out, "no loss plot: {e}")?,
    }
    if let Some(c) = &s.checkpoint {
        writeln!(out, "checkpoint {} (resume with --resume)", c.display())?;
    }
    if let Some(d) = &s.exported {
        writeln!(
            out,
            "model {} (GPT2LMHeadModel.from_pretrained reads it; so does `gpt sample --checkpoint`)",
            d.display()
        )?;
    }
    writeln!(out, "log {} | summary {}", s.log.display(), summary_path.display())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_parses() {
        assert_eq!(parse_batch("auto"), Ok(BatchSize::Auto));
        assert_eq!(parse_batch("16"), Ok(BatchSize::Fixed(16)));
        assert!(parse_batch("0").is_err() && parse_batch("x").is_err());
    }

    /// Profiling on a GPU turns the step's CUDA graph off (replays record no per-kernel times, and
    /// the table divides by every step), with a note; `--no-graph` needs no note.
    #[test]
    fn profiling_runs_the_steps_eagerly() {
        let parse = |extra: &[&str]| {
            let args: Vec<&str> = ["gpt-train", "--data", "d", "--out", "o"].iter().chain(extra).copied().collect();
            crate::parse_args::<TrainArgs>(&args)
        };
        let graph_and_note = |a: &TrainArgs| {
            let (c, notes) = config(a, Device::Cuda(0)).expect("config");
            (c.graph, notes.iter().any(|n| n.starts_with("--profile")))
        };
        let (profiled, profiled_no_graph) =
            crate::with_profiling(true, || (graph_and_note(&parse(&[])), graph_and_note(&parse(&["--no-graph"]))));
        assert_eq!(profiled, (false, true));
        assert_eq!(profiled_no_graph, (false, false));
        let (plain, no_graph) =
            crate::with_profiling(false, || (graph_and_note(&parse(&[])), graph_and_note(&parse(&["--no-graph"]))));
        assert_eq!(plain, (true, false));
        assert_eq!(no_graph, (false, false));
    }
}
