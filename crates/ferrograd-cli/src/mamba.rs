//! `ferrograd mamba train`: the small Mamba language model (`ferrograd_models::mamba`) on
//! `gpt prepare`'s token shards. Lines of `gpt train`'s format, `log.jsonl` (`gpt plot` draws it),
//! `summary.json` and `checkpoint.safetensors` in `--out`.

use crate::gpt::human_count;
use crate::gpt::train::{stats_line, PrecisionArg};
use crate::CliResult;
use clap::{Args, Subcommand};
use ferrograd_core::Device;
use ferrograd_models::gpt::train::{Event, Precision};
use ferrograd_models::mamba::train::{train, MambaTrainConfig};
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Args, Debug)]
pub struct MambaArgs {
    #[command(subcommand)]
    pub command: MambaCommand,
}

#[derive(Subcommand, Debug)]
pub enum MambaCommand {
    /// Train a small Mamba LM on token shards (default 4 blocks x 256, 16 x 256 tokens, 500 steps).
    Train(TrainArgs),
}

#[derive(Args, Debug)]
pub struct TrainArgs {
    /// Directory of token shards (train_*.bin, val_*.bin), from `gpt prepare`.
    #[arg(long, default_value = "data/shakespeare")]
    pub data: PathBuf,
    /// Directory for checkpoint.safetensors, log.jsonl and summary.json.
    #[arg(long, default_value = "runs/mamba")]
    pub out: PathBuf,
    /// Mamba blocks.
    #[arg(long)]
    pub layers: Option<usize>,
    /// Model width (d_model).
    #[arg(long)]
    pub dim: Option<usize>,
    /// SSM state size (d_state).
    #[arg(long)]
    pub state: Option<usize>,
    /// Tokens per sequence.
    #[arg(long)]
    pub context: Option<usize>,
    /// Sequences per step.
    #[arg(long)]
    pub batch: Option<usize>,
    #[arg(long)]
    pub steps: Option<u64>,
    /// Peak learning rate (AdamW, betas 0.9/0.95; warm-up then cosine).
    #[arg(long)]
    pub lr: Option<f64>,
    #[arg(long)]
    pub warmup: Option<u64>,
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
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[arg(long, default_value_t = 10)]
    pub log_every: u64,
    /// Validation loss every N steps (0: only at the end).
    #[arg(long, default_value_t = 250)]
    pub val_every: u64,
    #[arg(long, default_value_t = 10)]
    pub val_batches: usize,
    /// Run every step eagerly instead of replaying it as a CUDA graph.
    #[arg(long)]
    pub no_graph: bool,
}

pub fn run(a: MambaArgs, out: &mut dyn Write) -> CliResult<()> {
    match a.command {
        MambaCommand::Train(t) => train_cmd(t, out),
    }
}

/// The run's configuration, and the note to print when `--profile` turns the CUDA graph off.
fn config(a: &TrainArgs, device: Device) -> (MambaTrainConfig, Option<&'static str>) {
    let mut c = MambaTrainConfig::defaults(a.data.clone(), a.out.clone(), device);
    c.model.n_layer = a.layers.unwrap_or(c.model.n_layer);
    c.model.d_model = a.dim.unwrap_or(c.model.d_model);
    c.model.d_state = a.state.unwrap_or(c.model.d_state);
    c.context = a.context.unwrap_or(c.context);
    c.batch = a.batch.unwrap_or(c.batch);
    c.steps = a.steps.unwrap_or(c.steps);
    c.lr = a.lr.unwrap_or(c.lr);
    c.warmup = a.warmup.or(c.warmup);
    c.weight_decay = a.weight_decay.unwrap_or(c.weight_decay);
    c.grad_clip = a.clip.unwrap_or(c.grad_clip);
    c.precision = match a.precision {
        Some(PrecisionArg::Bf16) => Precision::Bf16,
        Some(PrecisionArg::F32) => Precision::F32,
        None => c.precision,
    };
    c.seed = a.seed;
    c.log_every = a.log_every;
    c.val_every = a.val_every;
    c.val_batches = a.val_batches;
    // A replayed CUDA graph records no per-kernel times (the profile would hold the one step it
    // saw, divided by every steady step): profiling runs the steps eagerly, as `gpt train` does.
    let profiling = crate::profiling_on(device);
    c.graph = !a.no_graph && !profiling;
    let note = (profiling && !a.no_graph).then_some(crate::PROFILE_EAGER_NOTE);
    (c, note)
}

fn train_cmd(a: TrainArgs, out: &mut dyn Write) -> CliResult<()> {
    let started = Instant::now();
    let (device, why) = match a.device {
        Some(d) => (d, "--device".to_string()),
        None => Device::best_with_reason()?,
    };
    let (cfg, profile_note) = config(&a, device);
    let (steps, out_dir, m) = (cfg.steps, cfg.out.clone(), cfg.model);
    let precision = if cfg.precision == Precision::Bf16 { "bf16 autocast" } else { "f32" };
    let mut io_err: Option<std::io::Error> = None;
    let mut say = |out: &mut dyn Write, s: String| {
        if let Err(e) = writeln!(out, "{s}") {
            io_err.get_or_insert(e);
        }
    };
    let summary = train(cfg, started, |e| match e {
        Event::Started(info) => {
            say(
                &mut *out,
                format!(
                    "mamba train on {} ({why}): {:.2}M parameters ({} blocks x {}, state {}), {} x {} tokens/step, {precision}; data: {} train tokens{}",
                    info.device,
                    info.parameters as f64 / 1e6,
                    m.n_layer,
                    m.d_model,
                    m.d_state,
                    info.micro_batch,
                    info.tokens_per_step / info.micro_batch.max(1),
                    info.train_tokens,
                    info.val_tokens.map(|v| format!(", {v} val")).unwrap_or_default()
                ),
            );
            for n in info.notes.iter().cloned().chain(profile_note.map(String::from)) {
                say(&mut *out, n);
            }
        }
        Event::Progress(_) | Event::Saved { .. } => {}
        Event::Logged(s) => say(&mut *out, stats_line(s, steps)),
        Event::Validated { step, loss } => say(&mut *out, format!("step {step}/{steps} | val loss {loss:.4}")),
    });
    if let Some(e) = io_err {
        return Err(e.into());
    }
    let s = summary?;
    let fmt = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.4}"));
    writeln!(
        out,
        "done: {} steps in {:.1} s | loss {} -> {} | val {} | {} tok/s{} | first step after {:.2} s",
        s.steps,
        s.train_s,
        fmt(s.first_loss),
        fmt(s.final_loss),
        fmt(s.final_val_loss),
        human_count(s.tokens_per_s),
        s.mfu.map(|m| format!(" (MFU {:.1}%)", 100.0 * m)).unwrap_or_default(),
        s.startup_s
    )?;
    let summary_path = out_dir.join("summary.json");
    let json = serde_json::to_string_pretty(&s)?;
    ferrograd_nn::checkpoint::write_atomic(&summary_path, json.as_bytes())
        .map_err(|e| format!("writing {}: {e}", summary_path.display()))?;
    writeln!(out, "log {} | summary {}", s.log.display(), summary_path.display())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profiling_runs_the_steps_eagerly() {
        let parse = |extra: &[&str]| {
            let args: Vec<&str> = ["mamba-train", "--data", "d", "--out", "o"].iter().chain(extra).copied().collect();
            crate::parse_args::<TrainArgs>(&args)
        };
        let graph_and_note = |a: &TrainArgs, device| {
            let (c, note) = config(a, device);
            (c.graph, note.is_some())
        };
        let gpu = Device::Cuda(0);
        let (profiled, profiled_no_graph, profiled_cpu) = crate::with_profiling(true, || {
            (
                graph_and_note(&parse(&[]), gpu),
                graph_and_note(&parse(&["--no-graph"]), gpu),
                graph_and_note(&parse(&[]), Device::Cpu),
            )
        });
        assert_eq!(profiled, (false, true));
        assert_eq!(profiled_no_graph, (false, false));
        // The CPU has no kernels to time: nothing changes there.
        assert_eq!(profiled_cpu, (true, false));
        let (plain, no_graph) = crate::with_profiling(false, || {
            (graph_and_note(&parse(&[]), gpu), graph_and_note(&parse(&["--no-graph"]), gpu))
        });
        assert_eq!(plain, (true, false));
        assert_eq!(no_graph, (false, false));
    }
}
