//! `ferrograd`: the command-line tool. This file holds the clap definitions and the dispatch;
//! each subcommand lives in its own module and writes to the `Write` it is given, so that a closed
//! pipe (`ferrograd info | head -1`) ends the program quietly instead of panicking in `println!`.
//!
//! Errors: every failure reaches `main` as a [`CliError`] and is printed as one line,
//! `error: ...`, with exit status 1. Bad flags are clap's own `error: ...` with status 2. An
//! out-of-memory error (a `ferrograd_core::Error::OutOfMemory` anywhere in the error's chain) is
//! followed by the devices' memory figures and the next thing to try for the command that failed
//! (`memory::oom_report`).

mod bench;
mod demo;
mod dist;
mod info;
mod kernels;
mod launch;
mod memory;
mod monster;
mod monster_dist;
mod plot;
mod timing;

use clap::{Args, Parser, Subcommand};
use ferrograd_core::cuda::kernels::Arch;
use ferrograd_core::{DType, Device};
use std::io::IsTerminal;
use std::io::{self, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

/// The error every subcommand returns: a message meant for the user, printed as is.
pub type CliError = Box<dyn std::error::Error + Send + Sync>;
pub type CliResult<T> = Result<T, CliError>;

#[derive(Parser, Debug)]
#[command(name = "ferrograd", version, about = "ferrograd: tensors, autograd and CPU/CUDA backends in Rust")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Version, the device ferrograd would use and why, CUDA devices and CPU threads.
    Info,
    /// The first thing to run: finds CUDA (or says why not), moves memory, checks a 2x2 matmul and
    /// times a 1024x1024 f32 matmul on the GPU against the CPU backend and a naive loop.
    Demo(DemoArgs),
    /// GPU memory per device: the driver's used/total and ferrograd's allocator statistics.
    Memory(MemoryArgs),
    /// Micro-benchmarks; each prints a table and can write JSON (schema ferrograd-bench/1, shared
    /// with the PyTorch twins in bench/).
    #[command(subcommand)]
    Bench(BenchCommand),
    /// The embedded CUDA kernels and their on-disk cache; --precompile fills the cache.
    Kernels(KernelsArgs),
    /// Monster Walk: fill the device with copies of the Monster-group tensor and train the
    /// autoencoder on them (shared/MONSTER_WALK.md); `monster-walk export` writes the data.
    MonsterWalk(monster::MonsterArgs),
    /// Start one process per GPU (torchrun-style): `launch --nproc-per-node 2 -- ferrograd ...`.
    Launch(launch::LaunchArgs),
    /// Checks of a multi-process setup, run under `launch`: collectives, a data-parallel MLP.
    #[command(subcommand)]
    Dist(dist::DistCommand),
}

#[derive(Subcommand, Debug)]
enum BenchCommand {
    /// Square matmul. CPU: f32, a naive triple loop against Tensor::matmul. CUDA: f32/bf16/f16
    /// TFLOP/s with CUDA events, checked against a float64 reference first.
    Matmul(MatmulArgs),
    /// Host<->device GB/s (pageable and pinned) and many small copies against one coalesced copy.
    Transfer(TransferArgs),
    /// Allocate+free of device memory: the caching allocator against raw driver calls.
    Alloc(AllocArgs),
    /// Memory-bound ops (copy, add, mul, relu, sigmoid, softmax, layer_norm): GB/s and % of copy.
    Elementwise(ElementwiseArgs),
    /// Per-op host overhead: a chain of small adds.
    Launch(LaunchArgs),
    /// One fused Adam step over 100 parameter tensors (twin: torch.optim.Adam(fused=True)).
    Optim(OptimArgs),
    /// How much of a batch copy the data loader's prefetch hides behind compute.
    Overlap(OverlapArgs),
    /// NCCL all-reduce bus bandwidth across the ranks of a launch (twin: torch.distributed).
    Allreduce(AllreduceArgs),
}

#[derive(Args, Debug)]
struct AllreduceArgs {
    /// Buffer sizes in MiB, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64,256,1024")]
    sizes: Vec<f64>,
    /// Element type: f32, bf16 or f16.
    #[arg(long, default_value = "f32", value_parser = bench::allreduce::parse_dtype)]
    dtype: DType,
    /// Untimed all-reduces per size first.
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// All-reduces per timed batch (5 batches; the median is reported).
    #[arg(long, default_value_t = 20)]
    iters: usize,
    /// Also write the results as JSON to this file (rank 0).
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    #[arg(long, default_value_t = 42)]
    seed: u64,
}

#[derive(Args, Debug)]
struct OptimArgs {
    /// CUDA device (or cpu).
    #[arg(long, default_value = "cuda")]
    device: Device,
    /// Parameter tensors in the step.
    #[arg(long, default_value_t = 100)]
    tensors: usize,
    #[command(flatten)]
    common: Common,
}

#[derive(Args, Debug)]
struct OverlapArgs {
    /// CUDA device: cuda or cuda:N.
    #[arg(long, default_value = "cuda")]
    device: Device,
    /// Bytes of the batch copied per step, MiB.
    #[arg(long, default_value_t = 64)]
    mib: usize,
    /// Side of the four f32 matmuls of the synthetic step.
    #[arg(long, default_value_t = 2048)]
    matmul: usize,
    /// Also write the results as JSON to this file.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
}

#[derive(Args, Debug)]
struct DemoArgs {
    /// Device to run on: cpu, cuda or cuda:N (default: the best one; FERROGRAD_DEVICE overrides).
    #[arg(long)]
    device: Option<Device>,
    /// n of the timed n x n matmul.
    #[arg(long, default_value_t = 1024)]
    size: usize,
    /// Seed of the Philox generator that fills the inputs.
    #[arg(long, default_value_t = 42)]
    seed: u64,
}

#[derive(Args, Debug)]
struct MemoryArgs {
    /// Refresh every second until interrupted (Ctrl-C).
    #[arg(long)]
    watch: bool,
    /// Stop --watch after this many refreshes (for tests and scripts).
    #[arg(long, hide = true, requires = "watch")]
    iterations: Option<usize>,
}

/// Flags every bench shares.
#[derive(Args, Debug)]
struct Common {
    /// Also write the results as JSON to this file.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Also draw the results as a PNG figure in this file.
    #[arg(long, value_name = "FILE.png")]
    plot: Option<PathBuf>,
    /// Seed of the Philox generator that fills the inputs.
    #[arg(long, default_value_t = 42)]
    seed: u64,
}

#[derive(Args, Debug)]
struct MatmulArgs {
    /// Device to run on: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: Device,
    /// Element types, comma-separated: f32, bf16, f16 (CUDA; the CPU runs f32 only).
    /// Default: f32 on the CPU; f32 and bf16 on CUDA.
    #[arg(long, value_delimiter = ',', value_parser = parse_matmul_dtype)]
    dtype: Option<Vec<DType>>,
    /// Matrix sizes (n for n x n times n x n), comma-separated. Default: 128,256,512,1024 on the
    /// CPU; on CUDA 128,...,4096 for f32 and 8192 for bf16/f16.
    #[arg(long, value_delimiter = ',')]
    sizes: Option<Vec<usize>>,
    #[command(flatten)]
    common: Common,
}

#[derive(Args, Debug)]
struct TransferArgs {
    /// CUDA device: cuda or cuda:N.
    #[arg(long, default_value = "cuda")]
    device: Device,
    /// Size of the large host<->device copies, MiB.
    #[arg(long, default_value_t = 256)]
    mib: usize,
    /// Many-small case: this many tensors ...
    #[arg(long, default_value_t = 100)]
    count: usize,
    /// ... of this many KiB each.
    #[arg(long, default_value_t = 4)]
    kib: usize,
    #[command(flatten)]
    common: Common,
}

#[derive(Args, Debug)]
struct AllocArgs {
    /// CUDA device: cuda or cuda:N.
    #[arg(long, default_value = "cuda")]
    device: Device,
    /// Size of the block, MiB.
    #[arg(long, default_value_t = 64)]
    mib: usize,
    /// Also write the results as JSON to this file.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Also draw the results as a PNG figure in this file.
    #[arg(long, value_name = "FILE.png")]
    plot: Option<PathBuf>,
}

#[derive(Args, Debug)]
struct ElementwiseArgs {
    /// Device to run on: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cuda")]
    device: Device,
    /// f32 tensor shapes ROWSxCOLS, comma-separated; every op at the first, the row-wise ops
    /// (softmax, layer_norm) at all.
    #[arg(long, value_delimiter = ',', value_parser = bench::parse_shape, default_value = "8192x8192,65536x1024")]
    shapes: Vec<(usize, usize)>,
    #[command(flatten)]
    common: Common,
}

#[derive(Args, Debug)]
struct LaunchArgs {
    /// Device to run on: cpu, or cuda / cuda:N (which also reports the CPU).
    #[arg(long, default_value = "cuda")]
    device: Device,
    /// Adds per chain.
    #[arg(long, default_value_t = 10_000)]
    ops: usize,
    /// Elements of the tensors added.
    #[arg(long, default_value_t = 1024)]
    elems: usize,
    /// Timed chains (the median is reported).
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    #[command(flatten)]
    common: Common,
}

#[derive(Args, Debug)]
struct KernelsArgs {
    /// Compile every kernel module into the disk cache ($FERROGRAD_CACHE_DIR) and report the time
    /// the next start saves.
    #[arg(long)]
    precompile: bool,
    /// Architecture to compile for (sm_80, sm_90, 9.0, ...) instead of the GPU's; needs no GPU.
    #[arg(long, requires = "precompile")]
    arch: Option<Arch>,
    /// GPU whose architecture to compile for: cuda or cuda:N.
    #[arg(long, default_value = "cuda", conflicts_with = "arch")]
    device: Device,
}

fn parse_matmul_dtype(s: &str) -> Result<DType, String> {
    match s.trim() {
        "f32" => Ok(DType::F32),
        "bf16" => Ok(DType::BF16),
        "f16" => Ok(DType::F16),
        other => Err(format!("`{other}`: expected f32, bf16 or f16")),
    }
}

fn run(cli: Cli, out: &mut dyn Write) -> CliResult<()> {
    use bench::*;
    match cli.command {
        Command::Info => info::run(out),
        Command::Demo(a) => demo::run(&demo::Config { device: a.device, size: a.size, seed: a.seed }, out),
        Command::Memory(a) => memory::run(
            &memory::Config {
                watch: a.watch,
                iterations: a.iterations,
                interval: Duration::from_secs(1),
                clear: io::stdout().is_terminal(),
            },
            out,
        ),
        Command::MonsterWalk(a) => monster::run(a, out),
        Command::Launch(a) => crate::launch::run(a, out),
        Command::Dist(c) => dist::run(c, out),
        Command::Bench(BenchCommand::Allreduce(a)) => allreduce::run(
            &allreduce::Config {
                sizes_mib: a.sizes,
                dtype: a.dtype,
                warmup: a.warmup,
                iters: a.iters,
                json: a.json,
                seed: a.seed,
            },
            out,
        ),
        Command::Bench(BenchCommand::Matmul(a)) => matmul::run(
            &matmul::Config {
                device: a.device,
                dtypes: a.dtype,
                sizes: a.sizes,
                json: a.common.json,
                plot: a.common.plot,
                seed: a.common.seed,
            },
            out,
        ),
        Command::Bench(BenchCommand::Transfer(a)) => transfer::run(
            &transfer::Config {
                device: a.device,
                mib: a.mib,
                count: a.count,
                kib: a.kib,
                json: a.common.json,
                plot: a.common.plot,
                seed: a.common.seed,
            },
            out,
        ),
        Command::Bench(BenchCommand::Alloc(a)) => {
            alloc::run(&alloc::Config { device: a.device, mib: a.mib, json: a.json, plot: a.plot }, out)
        }
        Command::Bench(BenchCommand::Elementwise(a)) => elementwise::run(
            &elementwise::Config {
                device: a.device,
                shapes: a.shapes,
                json: a.common.json,
                plot: a.common.plot,
                seed: a.common.seed,
            },
            out,
        ),
        Command::Bench(BenchCommand::Launch(a)) => launch::run(
            &launch::Config {
                device: a.device,
                ops: a.ops,
                elems: a.elems,
                repeats: a.repeats,
                json: a.common.json,
                plot: a.common.plot,
                seed: a.common.seed,
            },
            out,
        ),
        Command::Bench(BenchCommand::Optim(a)) => optim::run(
            &optim::Config {
                device: a.device,
                tensors: a.tensors,
                json: a.common.json,
                plot: a.common.plot,
                seed: a.common.seed,
            },
            out,
        ),
        Command::Bench(BenchCommand::Overlap(a)) => {
            overlap::run(&overlap::Config { device: a.device, mib: a.mib, matmul: a.matmul, json: a.json }, out)
        }
        Command::Kernels(a) => {
            let ordinal = match a.device {
                Device::Cuda(n) => n,
                Device::Cpu => return Err("kernels --device: expected cuda or cuda:N".into()),
            };
            kernels::run(&kernels::Config { precompile: a.precompile, arch: a.arch, ordinal }, out)
        }
    }
}

/// What to try after an out-of-memory error in this command: its own flags that need less memory.
fn oom_hint(c: &Command) -> &'static str {
    match c {
        Command::MonsterWalk(_) => {
            "try a smaller batch (--batch), fewer copies (--copies N), or plan for less memory (--budget 8GiB or \
             --fill 0.5)"
        }
        Command::Demo(_) => "try a smaller matmul (--size 512)",
        Command::Bench(BenchCommand::Matmul(_)) => "try smaller matrices (--sizes) or a smaller dtype (--dtype bf16)",
        Command::Bench(BenchCommand::Elementwise(_)) => "try smaller tensors (--shapes 4096x4096)",
        Command::Bench(BenchCommand::Transfer(_) | BenchCommand::Alloc(_)) => "try a smaller block (--mib 64)",
        Command::Bench(BenchCommand::Launch(_)) => "try smaller tensors (--elems)",
        Command::Bench(BenchCommand::Optim(_)) => "try fewer tensors (--tensors)",
        Command::Bench(BenchCommand::Overlap(_)) => "try a smaller batch (--mib) or matmul (--matmul)",
        Command::Bench(BenchCommand::Allreduce(_)) => "try smaller buffers (--sizes 1,16,64)",
        _ => "free memory held by other processes (nvidia-smi lists them)",
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let hint = oom_hint(&cli.command);
    let stdout = io::stdout();
    let mut out = stdout.lock();
    let res = run(cli, &mut out).and_then(|()| out.flush().map_err(CliError::from));
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if is_broken_pipe(&*e) => ExitCode::SUCCESS,
        Err(e) => {
            let _ = out.flush();
            eprintln!("error: {e}");
            if let Some(report) = memory::oom_report(&*e, memory::status_after_error, hint) {
                eprint!("{report}");
            }
            ExitCode::FAILURE
        }
    }
}

fn is_broken_pipe(e: &(dyn std::error::Error + 'static)) -> bool {
    e.downcast_ref::<io::Error>().is_some_and(|e| e.kind() == io::ErrorKind::BrokenPipe)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn clap_definitions_are_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn sizes_and_device_parse() {
        let cli =
            Cli::try_parse_from(["ferrograd", "bench", "matmul", "--device", "cuda:1", "--sizes", "8,16"]).unwrap();
        let Command::Bench(BenchCommand::Matmul(a)) = cli.command else { panic!("wrong subcommand") };
        assert_eq!(a.device, Device::Cuda(1));
        assert_eq!(a.sizes, Some(vec![8, 16]));
        assert_eq!(a.dtype, None);
        assert!(Cli::try_parse_from(["ferrograd", "bench", "matmul", "--device", "tpu"]).is_err());
    }

    #[test]
    fn dtypes_shapes_and_arch_parse() {
        let cli = Cli::try_parse_from(["ferrograd", "bench", "matmul", "--dtype", "bf16,f16"]).unwrap();
        let Command::Bench(BenchCommand::Matmul(a)) = cli.command else { panic!("wrong subcommand") };
        assert_eq!(a.dtype, Some(vec![DType::BF16, DType::F16]));
        assert!(Cli::try_parse_from(["ferrograd", "bench", "matmul", "--dtype", "i32"]).is_err());

        let cli = Cli::try_parse_from(["ferrograd", "bench", "elementwise", "--shapes", "4x8,16x2"]).unwrap();
        let Command::Bench(BenchCommand::Elementwise(a)) = cli.command else { panic!("wrong subcommand") };
        assert_eq!(a.shapes, vec![(4, 8), (16, 2)]);
        assert_eq!(a.device, Device::Cuda(0));

        let cli = Cli::try_parse_from(["ferrograd", "kernels", "--precompile", "--arch", "sm_90"]).unwrap();
        let Command::Kernels(a) = cli.command else { panic!("wrong subcommand") };
        assert_eq!(a.arch, Some(Arch::SM90));
        assert!(Cli::try_parse_from(["ferrograd", "kernels", "--arch", "sm_90"]).is_err());
        assert!(Cli::try_parse_from(["ferrograd", "kernels", "--precompile", "--arch", "banana"]).is_err());
    }
}
