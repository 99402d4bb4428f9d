//! `ferrograd dist ...`: checks of a multi-process setup, run under `ferrograd launch` (or
//! torchrun, or srun).
//!
//! - `dist check`: every collective on known values, across all ranks, on the GPUs (and a
//!   GPU-to-GPU copy where one process sees two GPUs); prints what NCCL was found.
//! - `dist mlp`: the reference data-parallel run (`ferrograd_dist::workload`): an MLP trained for a
//!   few AdamW steps on a fixed dataset, rank 0 writing the final weights, so that runs on 1 GPU,
//!   2 GPUs, ZeRO-1, two nodes or a resume can be compared file to file.

use crate::CliResult;
use clap::{Args, Subcommand};
use ferrograd_core::{DType, Device, Tensor};
use ferrograd_dist::workload::{self, MlpRun};
use ferrograd_dist::{DpConfig, ProcessGroup, ReduceOp};
use ferrograd_nn::checkpoint::{self, TrainState};
use std::io::Write;
use std::path::{Path, PathBuf};

#[derive(Subcommand, Debug)]
pub enum DistCommand {
    /// Every collective (all-reduce sum/avg/min/max, reduce-scatter, all-gather, broadcast,
    /// send/recv) on known values across the ranks of a launch, and a peer copy.
    Check,
    /// Train a small MLP data-parallel for a few steps; rank 0 writes the weights (--out).
    Mlp(MlpArgs),
}

#[derive(Args, Debug)]
pub struct MlpArgs {
    #[arg(long, default_value_t = 10)]
    pub steps: u64,
    /// Samples per optimizer step over all ranks.
    #[arg(long, value_parser = crate::parse_count, default_value_t = 48)]
    pub global_batch: usize,
    /// Micro-batches per step (gradient accumulation).
    #[arg(long, value_parser = crate::parse_count, default_value_t = 1)]
    pub micro_steps: usize,
    /// 1: ZeRO-1 (AdamW's state sharded over the ranks).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=1))]
    pub zero: u8,
    /// Gradients travel as f32 or bf16.
    #[arg(long, default_value = "f32", value_parser = crate::bench::allreduce::parse_dtype)]
    pub comm_dtype: DType,
    /// Bucket size in MiB.
    #[arg(long, default_value_t = 25.0)]
    pub bucket_mib: f64,
    #[arg(long)]
    pub clip: Option<f64>,
    #[arg(long, value_parser = crate::parse_seed, default_value_t = 0)]
    pub seed: u64,
    /// Write a checkpoint after this step (to --checkpoint).
    #[arg(long, requires = "checkpoint")]
    pub save_at: Option<u64>,
    #[arg(long)]
    pub checkpoint: Option<PathBuf>,
    /// Start from this checkpoint.
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Rank 0 writes the final weights here (safetensors).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Test hook: this rank kills itself (SIGKILL) after --die-at-step.
    #[arg(long, hide = true, requires = "die_at_step")]
    pub die_rank: Option<usize>,
    #[arg(long, hide = true)]
    pub die_at_step: Option<u64>,
}

/// The files the command writes (rank 0), with their flags.
pub fn outputs(c: &DistCommand) -> Vec<(&'static str, &Path)> {
    match c {
        DistCommand::Check => vec![],
        DistCommand::Mlp(a) => {
            let mut v: Vec<(&'static str, &Path)> = vec![];
            v.extend(a.checkpoint.as_deref().map(|p| ("--checkpoint", p)));
            v.extend(a.out.as_deref().map(|p| ("--out", p)));
            v
        }
    }
}

/// The flags' numbers, before any process group or device.
pub fn check(c: &DistCommand) -> CliResult<()> {
    let DistCommand::Mlp(a) = c else { return Ok(()) };
    // 1 TiB at most: far above any GPU, and the byte count cannot overflow.
    if !(a.bucket_mib > 0.0 && a.bucket_mib <= (1u64 << 20) as f64) {
        return Err(format!("--bucket-mib {} must be a positive number of MiB, at most 1048576", a.bucket_mib).into());
    }
    if a.global_batch == 0 {
        return Err("--global-batch must be at least 1".into());
    }
    if a.micro_steps == 0 {
        return Err("--micro-steps must be at least 1".into());
    }
    if let Some(c) = &a.clip {
        if !(*c > 0.0 && c.is_finite()) {
            return Err(format!("--clip {c} must be a positive number").into());
        }
    }
    Ok(())
}

pub fn run(c: DistCommand, out: &mut dyn Write) -> CliResult<()> {
    match c {
        DistCommand::Check => collectives(out),
        DistCommand::Mlp(a) => mlp(a, out),
    }
}

fn collectives(out: &mut dyn Write) -> CliResult<()> {
    let pg = ProcessGroup::init()?;
    let comm = pg.comm();
    let (rank, world, dev) = (pg.rank(), pg.world_size(), pg.device());
    let nccl = match ferrograd_dist::nccl::nccl() {
        Ok(l) => format!("NCCL {} ({})", l.version_string(), l.path),
        Err(e) => format!("no NCCL ({e})"),
    };
    writeln!(out, "rank {rank} of {world} on {dev}, backend {}, {nccl}", comm.backend())?;
    let timeout = ferrograd_dist::env::timeout_from_env();
    let r = rank as f32;
    let n = 4 * world;
    let t = |v: Vec<f32>| Tensor::from_vec(v, n, dev);
    let mine: Vec<f32> = (0..n).map(|i| r * 100.0 + i as f32).collect();
    let sum_of = |i: usize| (0..world).map(|q| q as f32 * 100.0 + i as f32).sum::<f32>();
    let mut failures = vec![];
    let mut expect = |what: &str, got: Vec<f32>, want: Vec<f32>| {
        if got != want {
            failures.push(format!("{what}: got {got:?}, expected {want:?}"));
        }
    };
    for (op, name) in [(ReduceOp::Sum, "sum"), (ReduceOp::Avg, "avg"), (ReduceOp::Min, "min"), (ReduceOp::Max, "max")] {
        let x = t(mine.clone())?;
        comm.all_reduce(&x, op)?.synchronize(timeout)?;
        let want: Vec<f32> = (0..n)
            .map(|i| match op {
                ReduceOp::Sum => sum_of(i),
                ReduceOp::Avg => sum_of(i) / world as f32,
                ReduceOp::Min => i as f32,
                ReduceOp::Max => (world - 1) as f32 * 100.0 + i as f32,
            })
            .collect();
        expect(&format!("all_reduce {name}"), x.to_vec()?, want);
    }
    let x = t(mine.clone())?;
    comm.reduce_scatter(&x, ReduceOp::Sum)?.synchronize(timeout)?;
    let mut want = mine.clone();
    (rank * 4..rank * 4 + 4).for_each(|i| want[i] = sum_of(i));
    expect("reduce_scatter", x.to_vec()?, want);
    let x = t(vec![-1.0; n])?;
    x.narrow(0, rank * 4, 4)?.set(&Tensor::from_vec(vec![r; 4], 4, dev)?)?;
    comm.all_gather(&x)?.synchronize(timeout)?;
    expect("all_gather", x.to_vec()?, (0..n).map(|i| (i / 4) as f32).collect());
    let x = t(mine.clone())?;
    let root = world - 1;
    comm.broadcast(&x, root)?.synchronize(timeout)?;
    expect("broadcast", x.to_vec()?, (0..n).map(|i| root as f32 * 100.0 + i as f32).collect());
    if world > 1 {
        let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
        let got = t(vec![0.0; n])?;
        comm.send_recv(&t(mine.clone())?, next, &got, prev)?.synchronize(timeout)?;
        expect("send/recv ring", got.to_vec()?, (0..n).map(|i| prev as f32 * 100.0 + i as f32).collect());
    }
    comm.barrier()?;
    // A GPU-to-GPU copy where this process sees a second GPU.
    let visible = ferrograd_core::cuda::device_count().unwrap_or(0);
    if let (Device::Cuda(o), true) = (dev, visible > 1 && rank == 0) {
        let other = Device::Cuda((o + 1) % visible);
        let a = Tensor::rand(-1.0, 1.0, 1 << 20, DType::F32, dev)?;
        let b = a.to_device(other)?;
        let direct = ferrograd_core::cuda::peer::peer_access(
            &*ferrograd_core::cuda::CudaDevice::get(o)?,
            &*ferrograd_core::cuda::CudaDevice::get((o + 1) % visible)?,
        )?;
        expect(&format!("copy {dev} -> {other}"), b.to_device(dev)?.to_vec()?, a.to_vec()?);
        writeln!(
            out,
            "rank 0: {dev} -> {other} copy {}",
            if direct { "peer to peer" } else { "staged through the host" }
        )?;
    }
    if !failures.is_empty() {
        return Err(format!("rank {rank}: {} check(s) failed: {}", failures.len(), failures.join("; ")).into());
    }
    writeln!(
        out,
        "rank {rank}: all-reduce (sum, avg, min, max), reduce-scatter, all-gather, broadcast, send/recv: ok"
    )?;
    Ok(())
}

fn mlp(a: MlpArgs, out: &mut dyn Write) -> CliResult<()> {
    let pg = ProcessGroup::init()?;
    let (rank, world) = (pg.rank(), pg.world_size());
    let run = MlpRun {
        global_batch: a.global_batch,
        micro_steps: a.micro_steps,
        steps: a.steps,
        seed: a.seed,
        clip: a.clip,
        dp: DpConfig {
            bucket_bytes: (a.bucket_mib * (1 << 20) as f64) as usize,
            comm_dtype: a.comm_dtype,
            zero: a.zero,
        },
        save: a.save_at.zip(a.checkpoint.clone()),
        resume: a.resume.clone(),
        ..Default::default()
    };
    let (die_rank, die_at) = (a.die_rank, a.die_at_step);
    let (net, losses) = workload::train(pg.comm(), &run, &mut |step| {
        if die_rank == Some(rank) && die_at == Some(step) {
            eprintln!("rank {rank}: killing myself after step {step} (--die-rank)");
            // SAFETY: raise(2) with SIGKILL; the process ends here.
            unsafe { libc::raise(libc::SIGKILL) };
        }
        Ok(())
    })?;
    let last = losses.last().copied().unwrap_or(f64::NAN);
    writeln!(
        out,
        "rank {rank} of {world} on {}: {} steps (zero {}, {} gradients), final loss {last:.6}",
        pg.device(),
        losses.len(),
        a.zero,
        a.comm_dtype
    )?;
    if let (Some(p), true) = (&a.out, pg.is_main()) {
        checkpoint::save(p, &net, None, &TrainState { step: a.steps, ..Default::default() })?;
        writeln!(out, "wrote {}", p.display())?;
    }
    pg.comm().barrier()?;
    Ok(())
}
