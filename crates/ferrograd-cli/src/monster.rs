//! `ferrograd monster-walk`: fill the device with Monster Walk copies, train the autoencoder and
//! report (docs/monster-walk.md). `monster-walk export` writes one copy's four representations, or
//! the values of many copies for the PyTorch twin.
//!
//! Everything the flags can get wrong is found before any work: the numbers (`check`), the plan
//! against the host's memory (and, once the device is open, the GPU's), the `--init` file's header,
//! shapes and values, and the output paths (`--save`, `--report`, `--out`: writable, not the same
//! file). A run that stops (a non-finite loss) writes nothing.

use crate::CliResult;
use clap::{Args, Subcommand};
use ferrograd_core::cuda::alloc::parse_byte_size;
use ferrograd_core::{Device, Tensor};
use ferrograd_models::monster_walk::data::COPY_BYTES;
use ferrograd_models::monster_walk::plan::{human, plan, PlanRequest};
use ferrograd_models::monster_walk::train::{describe, export, EpochStats};
use ferrograd_models::monster_walk::walk::SAMPLES;
use ferrograd_models::monster_walk::{run as train, CopyData, Report, TrainConfig};
use indicatif::{ProgressBar, ProgressStyle};
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};

/// The CPU default: 4 copies x 200 epochs in batches of 512, 8,000 Adam steps (the GPU default,
/// 113 copies x 71 epochs in batches of 5041, takes 8,023). Measured on this project's two-core
/// build machine under load: 23 s (1 s of data, 22 s of training), the loss from 0.333 to 0.054,
/// below the 0.061 the GPU default ends at. Much shorter runs stop on the plateau near 0.09 that
/// the model leaves after about 1,500 steps, which would not show what training does.
const CPU_DEFAULT_COPIES: usize = 4;
const CPU_DEFAULT_EPOCHS: usize = 200;
const CPU_DEFAULT_BATCH: usize = 512;

#[derive(Args, Debug)]
pub struct MonsterArgs {
    #[command(subcommand)]
    pub command: Option<MonsterCommand>,
    /// Number of copies to keep resident (default: 113 on a GPU).
    #[arg(long, value_parser = crate::parse_count, conflicts_with_all = ["fill", "budget"])]
    pub copies: Option<usize>,
    /// Fill this fraction of the device's free memory with copies.
    #[arg(long, conflicts_with = "budget")]
    pub fill: Option<f64>,
    /// Plan as if the device had this much memory, e.g. 12GB or 8GiB.
    #[arg(long)]
    pub budget: Option<String>,
    /// Passes over all copies (default: 71 on a GPU, 200 on the CPU).
    #[arg(long, value_parser = crate::parse_count)]
    pub epochs: Option<usize>,
    #[arg(long, default_value_t = 1e-3)]
    pub lr: f64,
    /// Samples per optimizer step, 1 to 5041 (default: one whole copy, 5041, on a GPU; 512 on the
    /// CPU).
    #[arg(long, value_parser = crate::parse_count)]
    pub batch: Option<usize>,
    #[arg(long, value_parser = crate::parse_seed, default_value_t = 0)]
    pub seed: u64,
    /// cpu, cuda or cuda:N (default: the best device).
    #[arg(long)]
    pub device: Option<Device>,
    /// Start from these weights (safetensors with PyTorch nn.Sequential names).
    #[arg(long)]
    pub init: Option<PathBuf>,
    /// Accept NaN or infinite values in the --init weights (refused by default).
    #[arg(long, requires = "init")]
    pub allow_nonfinite: bool,
    /// Undo and skip steps whose loss is NaN or infinite (as mixed-precision loss scaling does)
    /// instead of stopping at the first one.
    #[arg(long)]
    pub skip_nonfinite: bool,
    /// Write the trained weights here (same names).
    #[arg(long)]
    pub save: Option<PathBuf>,
    /// Write the JSON report here.
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// On CUDA, train through the generic autograd path (the same as --step unfused).
    #[arg(long, conflicts_with = "step")]
    pub unfused: bool,
    /// With --unfused / --step unfused: run the autograd step op by op instead of replaying it as
    /// a CUDA graph.
    #[arg(long)]
    pub no_graph: bool,
    /// The CUDA training step: persistent (the whole run in one kernel; the default where the GPU
    /// and the model allow it), fused (two kernels a step) or unfused (the generic autograd path).
    #[arg(long, value_enum)]
    pub step: Option<StepArg>,
    /// Matrix-product precision of the persistent kernel: f32 (3xTF32, f32-accurate), tf32, bf16.
    #[arg(long, default_value = "f32")]
    pub precision: String,
    /// Pipeline parallel: cut the eight layers into N stage groups (4: encoder, bottleneck,
    /// decoder, output, as the design document places them) over the ranks of `ferrograd launch`
    /// (N / ranks groups per GPU); without a launcher all groups run on one device.
    #[arg(long, value_parser = crate::parse_count,
          conflicts_with_all = ["fill", "budget", "unfused", "step", "no_graph", "skip_nonfinite"])]
    pub pipeline: Option<usize>,
    /// With --pipeline: micro-batches per step.
    #[arg(long, value_parser = crate::parse_count, default_value_t = 8, requires = "pipeline")]
    pub micro_batches: usize,
    /// With --pipeline: gpipe or 1f1b.
    #[arg(long, default_value = "1f1b", requires = "pipeline")]
    pub schedule: String,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepArg {
    Persistent,
    Fused,
    Unfused,
}

#[derive(Subcommand, Debug)]
pub enum MonsterCommand {
    /// Write one copy's four representations (residues u8, values, complex, ring_onehot f32), or
    /// with --values-of N the values of copies 0..N stacked as `values` [N, 71, 71, 71].
    Export {
        #[arg(long, value_parser = crate::parse_count, default_value_t = 0, conflicts_with = "values_of")]
        copy: usize,
        #[arg(long, value_parser = crate::parse_count)]
        values_of: Option<usize>,
        #[arg(long)]
        out: PathBuf,
    },
}

/// The files the command will write, with their flags.
pub fn outputs(a: &MonsterArgs) -> Vec<(&'static str, &Path)> {
    if let Some(MonsterCommand::Export { out, .. }) = &a.command {
        return vec![("--out", out.as_path())];
    }
    let mut v: Vec<(&'static str, &Path)> = vec![];
    v.extend(a.save.as_deref().map(|p| ("--save", p)));
    v.extend(a.report.as_deref().map(|p| ("--report", p)));
    v
}

/// The request the flags make (the CPU default when none is given on the CPU).
fn request(a: &MonsterArgs, on_cpu: bool) -> CliResult<Option<PlanRequest>> {
    Ok(match (a.copies, a.fill, &a.budget) {
        (Some(n), _, _) => Some(PlanRequest::Copies(n)),
        (_, Some(f), _) => Some(PlanRequest::Fill(f)),
        (_, _, Some(b)) => Some(PlanRequest::Budget(
            parse_byte_size(b).ok_or_else(|| format!("--budget {b:?} is not a size (examples: 12GB, 8GiB, 500MB)"))?,
        )),
        _ if on_cpu => Some(PlanRequest::Copies(CPU_DEFAULT_COPIES)),
        _ => None,
    })
}

/// The training configuration for `device`.
fn config(a: &MonsterArgs, device: Device) -> CliResult<TrainConfig> {
    let on_cpu = device.is_cpu();
    let mut cfg = TrainConfig::spec_defaults(device);
    if let Some(r) = request(a, on_cpu)? {
        cfg.plan = r;
    }
    cfg.epochs = a.epochs.unwrap_or(if on_cpu { CPU_DEFAULT_EPOCHS } else { cfg.epochs });
    cfg.batch = a.batch.unwrap_or(if on_cpu { CPU_DEFAULT_BATCH } else { SAMPLES });
    cfg.lr = a.lr;
    cfg.seed = a.seed;
    cfg.init = a.init.clone();
    cfg.save = a.save.clone();
    let step = if a.unfused { StepArg::Unfused } else { a.step.unwrap_or(StepArg::Persistent) };
    cfg.fused = step != StepArg::Unfused;
    cfg.persistent = step == StepArg::Persistent;
    // A replayed CUDA graph records no per-kernel times, and the profile divides by every step:
    // profiling runs the autograd step (the one that replays a graph) eagerly, so its table is each step's kernels.
    let profiling = crate::profiling_on(device);
    if profiling && !a.no_graph && step == StepArg::Unfused {
        eprintln!("--profile: the autograd step runs eagerly (a replayed CUDA graph records no per-kernel times)");
    }
    cfg.graph = !a.no_graph && !profiling;
    cfg.precision =
        a.precision.parse().map_err(|_| format!("--precision {:?}: expected f32, tf32 or bf16", a.precision))?;
    cfg.allow_nonfinite = a.allow_nonfinite;
    cfg.skip_nonfinite = a.skip_nonfinite;
    Ok(cfg)
}

/// The checks that need no device: the numbers, and a plan that cannot fit this host (on the CPU,
/// or wherever `--copies` asks for more than any byte count holds).
pub fn check(a: &MonsterArgs) -> CliResult<()> {
    if let Some(MonsterCommand::Export { values_of: Some(n), .. }) = &a.command {
        if *n == 0 {
            return Err("--values-of must be at least 1".into());
        }
        // The stacked export is built on the host: [n, 71, 71, 71] f32, twice (values and bytes).
        let bytes = n.checked_mul(8 * 357_911).ok_or("--values-of is far too large")?;
        ferrograd_core::host::check_fits(|| format!("--values-of {n} (the stacked values, built on the host)"), bytes)?;
        return Ok(());
    }
    if a.command.is_some() {
        return Ok(());
    }
    if let Some(n) = a.pipeline {
        crate::monster_pipeline::check(n, a.micro_batches, a.batch.unwrap_or(SAMPLES).min(SAMPLES))?;
        a.schedule.parse::<ferrograd_dist::pipeline::ScheduleKind>()?;
    }
    if a.epochs == Some(0) {
        return Err("--epochs must be at least 1".into());
    }
    if let Some(b) = a.batch {
        if b == 0 || b > SAMPLES {
            return Err(format!(
                "--batch {b} must be between 1 and {SAMPLES} (one copy's samples: a step never spans two copies)"
            )
            .into());
        }
    }
    if !(a.lr > 0.0 && a.lr.is_finite()) {
        return Err(format!("--lr {} must be a positive number", a.lr).into());
    }
    if let Some(f) = a.fill {
        if !(f > 0.0 && f <= 1.0) {
            return Err(format!("--fill {f} is not a fraction in (0, 1]").into());
        }
    }
    // The --init file, read on the host now (38 KB): its header, names, shapes, dtypes and values,
    // so that a bad file is one error line before anything is printed or built.
    if let Some(p) = &a.init {
        let opts = ferrograd_nn::checkpoint::LoadOptions { allow_nonfinite: a.allow_nonfinite };
        ferrograd_models::monster_walk::Autoencoder::load_with(p, Device::Cpu, opts)?;
    }
    // The device is chosen later; the request's arithmetic is checked now (an overflowing
    // --copies), and against this host's memory when the run will be on the CPU.
    let on_cpu = matches!(a.device, Some(Device::Cpu));
    if let Some(r) = request(a, on_cpu)? {
        let free = ferrograd_core::host::host_memory().map(|m| m.available);
        if !matches!(r, PlanRequest::Fill(_)) || on_cpu {
            let mp = plan(r, COPY_BYTES, free)?;
            if on_cpu {
                ferrograd_models::monster_walk::train::check_fits(&mp, Device::Cpu)?;
            }
        }
    }
    Ok(())
}

pub fn run(a: MonsterArgs, out: &mut dyn Write) -> CliResult<()> {
    if let Some(MonsterCommand::Export { copy, values_of, out: path }) = &a.command {
        match values_of {
            None => export(*copy, path)?,
            Some(n) => export_values(*n, path)?,
        }
        writeln!(out, "wrote {}", path.display())?;
        return Ok(());
    }
    if a.pipeline.is_some() {
        return run_pipelined(&a, out);
    }
    // Under `ferrograd launch`: data parallel, this process on cuda:LOCAL_RANK.
    let pg = crate::monster_dist::group()?;
    let (device, why) = crate::monster_dist::device_for(pg.as_ref(), a.device)?;
    let main_rank = pg.as_ref().is_none_or(|p| p.is_main());
    let mut cfg = config(&a, device)?;
    cfg.dist = pg.as_ref().map(crate::monster_dist::hooks);
    if !main_rank {
        // Rank 0 writes the weights (every rank ends with the same ones) and the report.
        cfg.save = None;
    }
    let on_cpu = device.is_cpu();
    writeln!(out, "monster-walk on {} ({why})", describe(device))?;
    // What will run, said before it runs. On the CPU a copy's bytes are exactly the arithmetic, so
    // the count is exact; on a GPU the allocator's rounding can change a --budget/--fill plan by
    // a copy, and the table below gives the count trained.
    let free = if on_cpu { ferrograd_core::host::host_memory().map(|m| m.available) } else { None };
    let planned = match cfg.plan {
        PlanRequest::Copies(n) => Some(n),
        r if on_cpu => plan(r, COPY_BYTES, free).ok().map(|p| p.copies),
        _ => None,
    };
    let steps_per_copy = SAMPLES.div_ceil(cfg.batch);
    match planned {
        Some(n) => writeln!(
            out,
            "training {n} cop{}{} x {} epoch{} in batches of {} ({} Adam steps)",
            if n == 1 { "y" } else { "ies" },
            if pg.is_some() { " per GPU" } else { "" },
            cfg.epochs,
            if cfg.epochs == 1 { "" } else { "s" },
            cfg.batch,
            (n as u128) * (cfg.epochs as u128) * (steps_per_copy as u128)
        )?,
        None => writeln!(
            out,
            "training as many copies as the plan allows x {} epochs in batches of {}",
            cfg.epochs, cfg.batch
        )?,
    }
    if on_cpu && a.copies.is_none() && a.fill.is_none() && a.budget.is_none() && a.epochs.is_none() && a.batch.is_none()
    {
        writeln!(
            out,
            "no GPU: the CPU default takes about 25 s on two cores and lowers the loss from about 0.33 to 0.05 \
             (the GPU default is 113 copies x 71 epochs in batches of {SAMPLES}); --copies, --epochs and --batch \
             change it"
        )?;
    }
    out.flush()?;
    let bar = if main_rank { progress(cfg.epochs) } else { None };
    let mut log: Vec<String> = vec![];
    let result = train(&cfg, |s: &EpochStats| {
        let mem = s.device_memory_used.map(|b| format!(", {} on device", human(b))).unwrap_or_default();
        let msg = format!("loss {:.6}, {:.0} samples/s{mem}", s.loss, s.samples_per_s);
        match &bar {
            Some(b) => {
                b.set_position(s.epoch as u64);
                b.set_message(msg);
            }
            None => log.push(format!("epoch {}/{}: {msg}", s.epoch, s.epochs)),
        }
    });
    if let Some(b) = &bar {
        b.abandon();
    }
    if main_rank {
        for l in &log {
            writeln!(out, "{l}")?;
        }
    }
    let (mut report, plan) = result?;
    if crate::profiling_on(device) {
        // FERROGRAD_PROFILE=1: device time per kernel and per step over the run (`config` turns
        // the CUDA graph off while profiling: a replayed graph records no timings).
        eprint!("{}", ferrograd_core::cuda::profile::report_table(report.steps as u64)?);
    }
    if let Some(pg) = &pg {
        report.allreduce_share = Some(crate::monster_dist::allreduce_share(&pg.comm(), report.training_time_s)?);
        if !pg.is_main() {
            writeln!(out, "rank {}: done, loss {:.6} (rank 0 reports)", pg.rank(), report.final_loss)?;
            return Ok(());
        }
    }
    if let Some(why) = &report.step_fallback {
        writeln!(out, "note: persistent kernel not used ({why}); trained with the fused step")?;
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
    if let Some(p) = &cfg.save {
        writeln!(out, "weights: {}", p.display())?;
    }
    if let Some(p) = &a.report {
        let text = serde_json::to_string_pretty(&report)?;
        ferrograd_core::io::write_atomic(p, (text + "\n").as_bytes())?;
        writeln!(out, "report: {}", p.display())?;
    }
    Ok(())
}

/// `--pipeline N`: the stage groups over the launcher's ranks, or all on one device.
fn run_pipelined(a: &MonsterArgs, out: &mut dyn Write) -> CliResult<()> {
    use ferrograd_dist::{Communicator, Solo};
    let pg = crate::monster_dist::group()?;
    let (comm, device, why): (std::sync::Arc<dyn Communicator>, Device, String) = match (&pg, a.device) {
        (Some(pg), Some(d)) if d != pg.device() => {
            return Err(format!("--device {d}: under launch, rank {} trains on {}", pg.rank(), pg.device()).into())
        }
        (Some(pg), _) => (pg.comm(), pg.device(), format!("rank {} of {}, pipeline", pg.rank(), pg.world_size())),
        (None, d) => {
            let (d, why) = match d {
                Some(d) => (d, "--device".to_string()),
                None => Device::best_with_reason()?,
            };
            (std::sync::Arc::new(Solo::new(d)), d, why)
        }
    };
    let on_cpu = device.is_cpu();
    let run = crate::monster_pipeline::PipeRun {
        groups: a.pipeline.unwrap_or(4),
        micro_batches: a.micro_batches,
        schedule: a.schedule.parse()?,
        copies: a.copies.unwrap_or(if on_cpu { CPU_DEFAULT_COPIES } else { 113 }),
        epochs: a.epochs.unwrap_or(if on_cpu { CPU_DEFAULT_EPOCHS } else { 71 }),
        batch: a.batch.unwrap_or(if on_cpu { CPU_DEFAULT_BATCH } else { SAMPLES }),
        lr: a.lr,
        seed: a.seed,
        init: a.init.clone(),
    };
    let main = comm.rank() == 0;
    if main {
        writeln!(
            out,
            "monster-walk on {} ({why}): {} stage groups on {} rank(s), {} copies x {} epochs in batches of {}, {} \
             micro-batches ({})",
            describe(device),
            run.groups,
            comm.world_size(),
            run.copies,
            run.epochs,
            run.batch,
            run.micro_batches,
            run.schedule
        )?;
        out.flush()?;
    }
    let r = crate::monster_pipeline::train(comm, device, &run)?;
    if !main {
        writeln!(out, "rank {}: done (rank 0 reports)", pg.as_ref().map_or(0, |p| p.rank()))?;
        return Ok(());
    }
    crate::monster_pipeline::table(&r, out)?;
    if let Some(p) = &a.save {
        let m = ferrograd_models::monster_walk::Autoencoder::init(0, Device::Cpu)?;
        for (dst, src) in m.parameters().iter().zip(&r.weights) {
            dst.set(src)?;
        }
        m.save(p)?;
        writeln!(out, "weights: {}", p.display())?;
    }
    if let Some(p) = &a.report {
        let text = serde_json::to_string_pretty(&r)?;
        ferrograd_core::io::write_atomic(p, (text + "\n").as_bytes())?;
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
        ("training step", {
            let kind = r.precision.as_ref().map_or(r.step_kind.clone(), |p| format!("{}, {p}", r.step_kind));
            if r.cuda_graph {
                format!("{kind} (CUDA graph)")
            } else {
                kind
            }
        }),
        ("copies x epochs", format!("{} x {} = {} steps of {} samples", r.copies, r.epochs, r.steps, r.batch)),
        ("entries resident", format!("{}", r.total_entries)),
        ("training time", format!("{:.3} s", r.training_time_s)),
        ("samples/s", format!("{:.0}", r.samples_per_s)),
        ("entries/s", format!("{:.3e}", r.entries_per_s)),
        ("loss", format!("{:.6} -> {:.6}", r.first_loss, r.final_loss)),
        ("data build", format!("{:.2} s", r.data_build_time_s)),
    ];
    let skipped = (r.skipped_steps > 0).then(|| ("skipped steps", format!("{} (non-finite loss)", r.skipped_steps)));
    for (k, v) in rows.into_iter().chain(skipped) {
        writeln!(out, "  {k:<18} {v}")?;
    }
    if let Some(p) = &r.phases {
        let parts: Vec<String> = p.phases.iter().map(|ph| format!("{} {:.2}", ph.name, ph.mean_us)).collect();
        writeln!(
            out,
            "  {:<18} {} (us per step, mean over {} blocks of {} threads, {} KiB shared memory each)",
            "step phases",
            parts.join(", "),
            p.grid,
            p.block,
            p.smem_bytes / 1024
        )?;
    }
    if r.world_size > 1 {
        writeln!(out, "  {:<18} {} (copies per GPU: {})", "GPUs", r.world_size, r.copies / r.world_size)?;
    }
    if let Some(s) = r.allreduce_share {
        writeln!(out, "  {:<18} {:.1}% of the training time", "all-reduce share", 100.0 * s)?;
    }
    Ok(())
}

/// `values` of copies 0..n stacked [n, 71, 71, 71] (what the PyTorch twin trains on), written
/// atomically through ferrograd-nn's safetensors writer.
fn export_values(n: usize, path: &std::path::Path) -> CliResult<()> {
    let vals = (0..n).map(|c| CopyData::build(c, Device::Cpu).map(|d| d.values)).collect::<Result<Vec<_>, _>>()?;
    let all = Tensor::stack(&vals, 0)?;
    ferrograd_nn::checkpoint::save_safetensors(path, &[("values", &all)], Default::default())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Profiling on a GPU turns the autograd step's CUDA graph off: a replayed graph records no
    /// per-kernel times, and the profile's table divides by every step.
    #[test]
    fn profiling_runs_the_autograd_step_eagerly() {
        let graph = |extra: &[&str]| {
            let args: Vec<&str> = ["monster-walk", "--step", "unfused"].iter().chain(extra).copied().collect();
            config(&crate::parse_args::<MonsterArgs>(&args), Device::Cuda(0)).expect("config").graph
        };
        assert!(!crate::with_profiling(true, || graph(&[])));
        assert!(crate::with_profiling(false, || graph(&[])));
        assert!(!crate::with_profiling(false, || graph(&["--no-graph"])));
    }
}
