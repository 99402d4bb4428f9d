//! `ferrograd monster-walk`: fill the device with Monster Walk copies, train the autoencoder and
//! report (MONSTER_WALK.md). `monster-walk export` writes one copy's four representations, or the
//! values of many copies for the PyTorch twin.

use crate::CliResult;
use clap::{Args, Subcommand};
use ferrograd_core::cuda::alloc::parse_byte_size;
use ferrograd_core::{Device, Tensor};
use ferrograd_models::monster_walk::plan::{human, PlanRequest};
use ferrograd_models::monster_walk::train::{describe, export, EpochStats};
use ferrograd_models::monster_walk::walk::SAMPLES;
use ferrograd_models::monster_walk::{run as train, CopyData, Report, TrainConfig};
use indicatif::{ProgressBar, ProgressStyle};
use std::io::{IsTerminal, Write};
use std::path::PathBuf;

/// Copies the CPU default trains: about a minute on two cores.
const CPU_DEFAULT_COPIES: usize = 4;
const CPU_DEFAULT_EPOCHS: usize = 20;

#[derive(Args, Debug)]
pub struct MonsterArgs {
    #[command(subcommand)]
    pub command: Option<MonsterCommand>,
    /// Number of copies to keep resident (default: 113 on a GPU).
    #[arg(long, conflicts_with_all = ["fill", "budget"])]
    pub copies: Option<usize>,
    /// Fill this fraction of the device's free memory with copies.
    #[arg(long, conflicts_with = "budget")]
    pub fill: Option<f64>,
    /// Plan as if the device had this much memory, e.g. 12GB or 8GiB.
    #[arg(long)]
    pub budget: Option<String>,
    /// Passes over all copies (default: 71 on a GPU).
    #[arg(long)]
    pub epochs: Option<usize>,
    #[arg(long, default_value_t = 1e-3)]
    pub lr: f64,
    /// Samples per optimizer step (default: one whole copy, 5041).
    #[arg(long, default_value_t = SAMPLES)]
    pub batch: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// cpu, cuda or cuda:N (default: the best device).
    #[arg(long)]
    pub device: Option<Device>,
    /// Start from these weights (safetensors with PyTorch nn.Sequential names).
    #[arg(long)]
    pub init: Option<PathBuf>,
    /// Write the trained weights here (same names).
    #[arg(long)]
    pub save: Option<PathBuf>,
    /// Write the JSON report here.
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// On CUDA, train through the generic autograd path instead of the fused two-kernel step.
    #[arg(long)]
    pub unfused: bool,
}

#[derive(Subcommand, Debug)]
pub enum MonsterCommand {
    /// Write one copy's four representations (residues u8, values, complex, ring_onehot f32), or
    /// with --values-of N the values of copies 0..N stacked as `values` [N, 71, 71, 71].
    Export {
        #[arg(long, default_value_t = 0, conflicts_with = "values_of")]
        copy: usize,
        #[arg(long)]
        values_of: Option<usize>,
        #[arg(long)]
        out: PathBuf,
    },
}

pub fn run(a: MonsterArgs, out: &mut dyn Write) -> CliResult<()> {
    if let Some(MonsterCommand::Export { copy, values_of, out: path }) = a.command {
        match values_of {
            None => export(copy, &path)?,
            Some(n) => export_values(n, &path)?,
        }
        writeln!(out, "wrote {}", path.display())?;
        return Ok(());
    }
    // Under `ferrograd launch`: data parallel, this process on cuda:LOCAL_RANK.
    let pg = crate::monster_dist::group()?;
    let (device, why) = match (&pg, a.device) {
        (Some(pg), Some(d)) if d != pg.device() => {
            return Err(format!(
                "--device {d}: under launch, rank {} trains on {} (LOCAL_RANK)",
                pg.rank(),
                pg.device()
            )
            .into())
        }
        (Some(pg), _) => (pg.device(), format!("rank {} of {}, data parallel", pg.rank(), pg.world_size())),
        (None, Some(d)) => (d, "--device".to_string()),
        (None, None) => Device::best_with_reason()?,
    };
    let main_rank = pg.as_ref().is_none_or(|p| p.is_main());
    let mut cfg = TrainConfig::spec_defaults(device);
    let on_cpu = device.is_cpu();
    cfg.plan = match (a.copies, a.fill, &a.budget) {
        (Some(n), _, _) => PlanRequest::Copies(n),
        (_, Some(f), _) => PlanRequest::Fill(f),
        (_, _, Some(b)) => PlanRequest::Budget(
            parse_byte_size(b).ok_or_else(|| format!("--budget {b:?} is not a size (examples: 12GB, 8GiB, 500MB)"))?,
        ),
        _ if on_cpu => PlanRequest::Copies(CPU_DEFAULT_COPIES),
        _ => cfg.plan,
    };
    cfg.epochs = a.epochs.unwrap_or(if on_cpu { CPU_DEFAULT_EPOCHS } else { cfg.epochs });
    cfg.lr = a.lr;
    cfg.batch = a.batch;
    cfg.seed = a.seed;
    cfg.init = a.init;
    cfg.save = a.save;
    cfg.fused = !a.unfused;
    cfg.dist = pg.as_ref().map(crate::monster_dist::hooks);
    if !main_rank {
        cfg.save = None;
    }
    if let Some(p) = &cfg.init {
        if !p.exists() {
            return Err(format!("--init {}: no such file", p.display()).into());
        }
    }
    writeln!(out, "monster-walk on {} ({why})", describe(device))?;
    if on_cpu && a.copies.is_none() && a.epochs.is_none() {
        writeln!(
            out,
            "no GPU: training {CPU_DEFAULT_COPIES} copies x {CPU_DEFAULT_EPOCHS} epochs so that the CPU finishes in \
             about a minute (the GPU default is 113 x 71; pass --copies/--epochs to change)"
        )?;
    }
    let bar = if main_rank { progress(cfg.epochs) } else { None };
    let mut log: Vec<String> = vec![];
    let (mut report, plan) = train(&cfg, |s: &EpochStats| {
        let mem = s.device_memory_used.map(|b| format!(", {} on device", human(b))).unwrap_or_default();
        let msg = format!("loss {:.6}, {:.0} samples/s{mem}", s.loss, s.samples_per_s);
        match &bar {
            Some(b) => {
                b.set_position(s.epoch as u64);
                b.set_message(msg);
            }
            None => log.push(format!("epoch {}/{}: {msg}", s.epoch, s.epochs)),
        }
    })?;
    if let Some(b) = bar {
        b.finish();
    }
    if let Some(pg) = &pg {
        report.allreduce_share = Some(crate::monster_dist::allreduce_share(&pg.comm(), report.training_time_s)?);
        if !pg.is_main() {
            writeln!(out, "rank {}: done, loss {:.6} (rank 0 reports)", pg.rank(), report.final_loss)?;
            return Ok(());
        }
    }
    for l in log {
        writeln!(out, "{l}")?;
    }
    writeln!(
        out,
        "memory: planned {} ({} copies x {} measured; arithmetic {}), measured {}",
        human(plan.planned_bytes),
        plan.copies,
        human(plan.copy_bytes_measured),
        human(plan.copy_bytes_arithmetic),
        human(report.memory_measured_bytes)
    )?;
    table(&report, out)?;
    if let Some(p) = &a.report {
        let text = serde_json::to_string_pretty(&report)?;
        std::fs::write(p, text + "\n").map_err(|e| format!("cannot write {}: {e}", p.display()))?;
        writeln!(out, "report: {}", p.display())?;
    }
    Ok(())
}

fn progress(epochs: usize) -> Option<ProgressBar> {
    if !std::io::stderr().is_terminal() {
        return None;
    }
    let b = ProgressBar::new(epochs as u64);
    if let Ok(style) = ProgressStyle::with_template("epoch {pos}/{len} [{bar:30}] {msg} ({elapsed})") {
        b.set_style(style.progress_chars("=> "));
    }
    Some(b)
}

fn table(r: &Report, out: &mut dyn Write) -> CliResult<()> {
    let rows = [
        ("device", r.device.clone()),
        ("training step", r.step_kind.clone()),
        ("copies x epochs", format!("{} x {} = {} steps", r.copies, r.epochs, r.steps)),
        ("entries resident", format!("{}", r.total_entries)),
        ("training time", format!("{:.3} s", r.training_time_s)),
        ("samples/s", format!("{:.0}", r.samples_per_s)),
        ("entries/s", format!("{:.3e}", r.entries_per_s)),
        ("loss", format!("{:.6} -> {:.6}", r.first_loss, r.final_loss)),
        ("data build", format!("{:.2} s", r.data_build_time_s)),
    ];
    for (k, v) in rows {
        writeln!(out, "  {k:<18} {v}")?;
    }
    if r.world_size > 1 {
        writeln!(out, "  {:<18} {} (copies per GPU: {})", "GPUs", r.world_size, r.copies / r.world_size)?;
    }
    if let Some(s) = r.allreduce_share {
        writeln!(out, "  {:<18} {:.1}% of the training time", "all-reduce share", 100.0 * s)?;
    }
    Ok(())
}

/// `values` of copies 0..n stacked [n, 71, 71, 71] (what the PyTorch twin trains on).
fn export_values(n: usize, path: &std::path::Path) -> CliResult<()> {
    if n == 0 {
        return Err("--values-of must be at least 1".into());
    }
    let vals = (0..n).map(|c| CopyData::build(c, Device::Cpu).map(|d| d.values)).collect::<Result<Vec<_>, _>>()?;
    let all = Tensor::stack(&vals, 0)?;
    let bytes: Vec<u8> = all.to_vec::<f32>()?.iter().flat_map(|x| x.to_le_bytes()).collect();
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, all.dims().to_vec(), &bytes)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let data =
        safetensors::serialize([("values".to_string(), view)], None).map_err(|e| format!("{}: {e}", path.display()))?;
    ferrograd_models::monster_walk::model::write_atomic(path, &data)?;
    Ok(())
}
