//! `ferrograd bench allreduce`: NCCL all-reduce bandwidth across the ranks of a launch, in
//! nccl-tests' terms. Twin: `bench/torch_allreduce.py` (`torch.distributed.all_reduce`, run with
//! torchrun on the same GPUs).
//!
//! Run under a launcher: `ferrograd launch --nproc-per-node 2 -- ferrograd bench allreduce`.
//! Per size: a correctness check (rank r contributes r + 1; every element must come back as
//! n(n+1)/2), `warmup` untimed all-reduces, then 5 batches of `iters` back to back on the
//! communication stream, each after a barrier and timed on the host clock around the loop and a
//! final synchronisation, as nccl-tests does; the median batch's time per all-reduce, of the
//! slowest rank, is reported. Algorithm bandwidth = bytes / time; bus
//! bandwidth = algbw * 2(n-1)/n, the figure nccl-tests prints, comparable across rank counts.

use super::{finish_json, print_rows, Environment, Report, Row};
use crate::CliResult;
use ferrograd_core::{DType, Tensor};
use ferrograd_dist::{ProcessGroup, ReduceOp};
use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Timed batches per size (the median is reported).
const BATCHES: usize = 5;

/// Largest buffer, MiB: far above any GPU's memory, low enough that the element count cannot
/// overflow.
const MAX_MIB: f64 = (1u64 << 20) as f64;

#[derive(clap::Args, Debug)]
pub struct AllreduceArgs {
    /// Buffer sizes in MiB, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64,256,1024")]
    pub sizes: Vec<f64>,
    /// Element type: f32, bf16 or f16.
    #[arg(long, default_value = "f32", value_parser = parse_dtype)]
    pub dtype: DType,
    /// Untimed all-reduces per size first.
    #[arg(long, value_parser = crate::parse_count, default_value_t = 5)]
    pub warmup: usize,
    /// All-reduces per timed batch (5 batches; the median is reported).
    #[arg(long, value_parser = crate::parse_count, default_value_t = 20)]
    pub iters: usize,
    /// Also write the results as JSON to this file (rank 0).
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    #[arg(long, value_parser = crate::parse_seed, default_value_t = 42)]
    pub seed: u64,
}

impl From<AllreduceArgs> for Config {
    fn from(a: AllreduceArgs) -> Config {
        Config { sizes_mib: a.sizes, dtype: a.dtype, warmup: a.warmup, iters: a.iters, json: a.json, seed: a.seed }
    }
}

#[derive(Debug, Clone)]
pub struct Config {
    /// Buffer sizes in MiB.
    pub sizes_mib: Vec<f64>,
    pub dtype: DType,
    pub warmup: usize,
    pub iters: usize,
    pub json: Option<PathBuf>,
    pub seed: u64,
}

pub fn parse_dtype(s: &str) -> Result<DType, String> {
    match s.trim() {
        "f32" => Ok(DType::F32),
        "bf16" => Ok(DType::BF16),
        "f16" => Ok(DType::F16),
        other => Err(format!("`{other}`: expected f32, bf16 or f16")),
    }
}

/// nccl-tests' bus bandwidth factor for all-reduce.
pub fn bus_factor(world: usize) -> f64 {
    2.0 * (world as f64 - 1.0) / world as f64
}

fn size_name(mib: f64) -> String {
    if mib >= 1.0 && mib.fract() == 0.0 {
        format!("{mib:.0} MiB")
    } else {
        format!("{:.0} KiB", mib * 1024.0)
    }
}

/// The flags' numbers, before any process group or device: at least one timed all-reduce, every
/// size positive and at most 1 TiB.
pub fn check(cfg: &Config) -> CliResult<()> {
    if cfg.iters == 0 {
        return Err("--iters must be at least 1".into());
    }
    if cfg.sizes_mib.is_empty() {
        return Err("--sizes needs at least one size".into());
    }
    if let Some(s) = cfg.sizes_mib.iter().find(|s| !(**s > 0.0 && **s <= MAX_MIB)) {
        return Err(format!("--sizes {s}: every size must be a positive number of MiB, at most {MAX_MIB}").into());
    }
    Ok(())
}

pub fn run(cfg: &Config, out: &mut dyn Write) -> CliResult<()> {
    let pg = ProcessGroup::init()?;
    if pg.world_size() < 2 {
        return Err("bench allreduce needs at least two processes: run it as `ferrograd launch --nproc-per-node 2 -- \
                    ferrograd bench allreduce` (or under torchrun)"
            .into());
    }
    let comm = pg.comm();
    let (world, rank, device) = (pg.world_size(), pg.rank(), pg.device());
    let env = Environment::for_device(device);
    let timeout = ferrograd_dist::env::timeout_from_env();
    let lib = ferrograd_dist::nccl::nccl()?;
    if pg.is_main() {
        writeln!(
            out,
            "all-reduce ({} sum) over {world} ranks, NCCL {} ({}), rank 0 on {device} ({})",
            cfg.dtype,
            lib.version_string(),
            lib.path,
            env.device_name()
        )?;
        writeln!(
            out,
            "host clock around {BATCHES} batches of {} back-to-back all-reduces after {} warm-up; median batch, slowest rank",
            cfg.iters, cfg.warmup
        )?;
        writeln!(out)?;
    }
    let esz = cfg.dtype.size_in_bytes();
    let mut rows = vec![];
    let mut rng = ferrograd_core::Rng::new(cfg.seed + rank as u64);
    for &mib in &cfg.sizes_mib {
        let n = ((mib * (1u64 << 20) as f64) as usize / esz).max(world).next_multiple_of(world);
        let bytes = n * esz;
        // Correctness first, on values each rank knows the sum of.
        let check = Tensor::full((rank + 1) as f64, n, cfg.dtype, device)?;
        comm.all_reduce(&check, ReduceOp::Sum)?.synchronize(timeout)?;
        let want = (world * (world + 1) / 2) as f64;
        let ends = [check.narrow(0, 0, 1)?.item_f64()?, check.narrow(0, n - 1, 1)?.item_f64()?];
        if ends.iter().any(|v| *v != want) {
            return Err(format!("all-reduce of {} gave {ends:?}, expected {want}", size_name(mib)).into());
        }
        drop(check);
        // Timed on random values (never zeros).
        let buf = Tensor::rand_with(&mut rng, -1.0, 1.0, n, cfg.dtype, device)?;
        for _ in 0..cfg.warmup {
            comm.all_reduce(&buf, ReduceOp::Sum)?;
        }
        let mut per_op = Vec::with_capacity(BATCHES);
        for _ in 0..BATCHES {
            comm.barrier()?;
            let t0 = Instant::now();
            let mut last = None;
            for _ in 0..cfg.iters {
                last = Some(comm.all_reduce(&buf, ReduceOp::Sum)?);
            }
            if let Some(w) = last {
                w.synchronize(timeout)?;
            }
            per_op.push(t0.elapsed().as_secs_f64() / cfg.iters as f64);
        }
        per_op.sort_by(f64::total_cmp);
        let mine = per_op[BATCHES / 2];
        let slowest = Tensor::full(mine, 1, DType::F64, device)?;
        comm.all_reduce(&slowest, ReduceOp::Max)?.synchronize(timeout)?;
        let t = slowest.item_f64()?;
        let algbw = bytes as f64 / t / 1e9;
        let busbw = algbw * bus_factor(world);
        rows.push(
            Row::new(format!("allreduce {} {}", cfg.dtype, size_name(mib)), busbw, "GB/s", true)
                .with("median_s", t)
                .with("reps", BATCHES as u64)
                .with("iters_per_rep", cfg.iters as u64)
                .with("algbw_gbps", algbw)
                .with("bytes", bytes as u64)
                .with("ranks", world as u64),
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    if !pg.is_main() {
        return Ok(());
    }
    print_rows(out, &rows, Some(("algbw GB/s", "algbw_gbps")))?;
    let mut report = Report::new(
        "allreduce",
        device,
        env,
        "host clock around 5 batches of back-to-back all-reduces; median batch per op, slowest rank",
    );
    report.rows = rows;
    report
        .notes
        .push(format!("{world} ranks; value = bus bandwidth = algbw x 2(n-1)/n (nccl-tests); time is per all-reduce"));
    report.extra.insert("nccl".into(), lib.version_string().into());
    finish_json(&cfg.json, &report, out)
}
