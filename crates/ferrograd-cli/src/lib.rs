//! `ferrograd`: the command-line tool, as a library (`main.rs` only calls [`main`]) so that the
//! parsing and validation can be fuzzed (`fuzz/`) and tested in process. This file holds the clap
//! definitions and the dispatch; each subcommand lives in its own module and writes to the `Write`
//! it is given, so that a closed pipe (`ferrograd info | head -1`) ends the program quietly
//! instead of panicking in `println!`.
//!
//! (About 940 lines: every command's clap definitions and its `Job` arms stay side by side in one
//! file, so each `match` is exhaustive where its commands are defined.)
//!
//! A command runs in three phases ([`Job`]): its flags become a configuration and are checked
//! (numbers in range, sizes that do not overflow, plans that fit the host's memory: no device is
//! touched), then every output path is checked (`ferrograd_core::io::check_outputs`: its directory
//! takes a file, no two outputs name the same file), and only then does the work start. Every
//! file is written with `ferrograd_core::io::write_atomic`.
//!
//! Errors: every failure reaches `main` as a [`CliError`] and is printed as one line,
//! `error: ...`, with exit status 1. Bad flags are clap's own `error: ...` with status 2 (negative
//! numbers are read as numbers and refused as such, not as unknown flags). A CUDA out-of-memory
//! error (a `ferrograd_core::Error::OutOfMemory` anywhere in the error's chain) is followed by the
//! devices' memory figures and the next thing to try for the command that failed
//! (`memory::oom_report`); a host one carries its figures and the hint on its one line.

mod bench;
mod demo;
mod dist;
mod gpt;
mod info;
mod kernels;
mod launch;
mod mamba;
mod memory;
mod monster;
mod monster_dist;
mod monster_pipeline;
mod plot;
mod timing;

/// The data-parallel hooks `gpt train` gets under `ferrograd launch` (public for the tests that
/// drive them with the in-process thread communicator).
pub use gpt::dist::hooks as gpt_dp_hooks;

use clap::{Args, Parser, Subcommand};
use ferrograd_core::cuda::nvrtc::Arch;
use ferrograd_core::{DType, Device};
use std::io::IsTerminal;
use std::io::{self, Write};
use std::path::Path;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

/// The error every subcommand returns: a message meant for the user, printed as is.
pub type CliError = Box<dyn std::error::Error + Send + Sync>;
pub type CliResult<T> = Result<T, CliError>;

#[derive(Parser, Debug)]
#[command(name = "ferrograd", version, about = "ferrograd: tensors, autograd and CPU/CUDA backends in Rust")]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Print the device time per kernel and the transfer metrics (bandwidth against the measured
    /// peak, transfer overhead, useful bytes per byte moved, overlap) at the end of `gpt train`,
    /// `mamba train`, `monster-walk` and `gpt sample` on a GPU; the same as FERROGRAD_PROFILE=1.
    #[arg(long, global = true)]
    profile: bool,
}

impl Cli {
    /// The clap command, with every value-taking flag accepting a leading `-` as a number, so
    /// that `--copies -1` is refused as a negative count rather than as an unknown flag `-1`.
    pub fn command_def() -> clap::Command {
        fn allow_negatives(c: clap::Command) -> clap::Command {
            c.mut_args(|a| if a.get_action().takes_values() { a.allow_negative_numbers(true) } else { a })
                .mut_subcommands(allow_negatives)
        }
        allow_negatives(<Cli as clap::CommandFactory>::command())
    }

    /// Parse a command line (the program name first).
    pub fn parse_from_args<I, T>(args: I) -> Result<Cli, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        let m = Self::command_def().try_get_matches_from(args)?;
        <Cli as clap::FromArgMatches>::from_arg_matches(&m)
    }
}

/// A count: a whole number of at least 0, said plainly when it is negative or not a number.
pub fn parse_count(s: &str) -> Result<usize, String> {
    let t = s.trim();
    if t.starts_with('-') {
        return Err("must not be negative".into());
    }
    t.parse::<usize>().map_err(|e| match e.kind() {
        std::num::IntErrorKind::PosOverflow => format!("too large (at most {})", usize::MAX),
        std::num::IntErrorKind::Empty => "expected a whole number, got nothing".into(),
        _ => "expected a whole number such as 4".into(),
    })
}

/// A seed: any whole number from 0 to 2^64 - 1.
pub fn parse_seed(s: &str) -> Result<u64, String> {
    let t = s.trim();
    if t.starts_with('-') {
        return Err("a seed must not be negative".into());
    }
    t.parse::<u64>().map_err(|_| format!("expected a whole number from 0 to {}", u64::MAX))
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
    /// autoencoder on them (docs/monster-walk.md); `monster-walk export` writes the data.
    MonsterWalk(monster::MonsterArgs),
    /// GPT-2 on real text: `gpt prepare` (text to token shards), `gpt train`, `gpt sample`.
    Gpt(gpt::GptArgs),
    /// Mamba (selective state-space) language model on gpt's token shards: `mamba train`.
    Mamba(mamba::MambaArgs),
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
    /// The GPU memory guide's "Expected Improvements" table, measured (twin: bench/torch_guide.py).
    Guide(GuideArgs),
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
    /// Fused attention forward and forward+backward TFLOP/s and peak memory (twin:
    /// F.scaled_dot_product_attention).
    Attention(AttentionArgs),
    /// One linear layer + bias + GELU (tanh) at GPT-2's MLP shapes, forward and forward+backward
    /// TFLOP/s through the fused op (cuBLASLt epilogues), and GPT-2's MLP block; twin: F.linear +
    /// F.gelu eager.
    Linear(LinearArgs),
    /// Fused selective scan (Mamba) forward and forward+backward time and peak memory (twin:
    /// bench/torch_selective_scan.py, the sequential recurrence in plain PyTorch).
    SelectiveScan(SelectiveScanArgs),
    /// Causal depthwise conv1d (Mamba) forward and forward+backward time and peak memory (twin:
    /// bench/torch_conv1d.py, depthwise F.conv1d with left padding).
    Conv1d(Conv1dArgs),
    /// int8 x int8 -> int32 matmul (cuBLASLt IMMA) TOPS against bf16 TFLOP/s, and the W8A8 / W8A16
    /// linears (twin: bench/torch_int8.py, torch._int_mm).
    Int8(Int8Args),
    /// NCCL all-reduce bus bandwidth across the ranks of a launch (twin: torch.distributed).
    Allreduce(bench::allreduce::AllreduceArgs),
    /// Fused transformer ops (residual add + layer norm, bias + GELU, the fused classifier) forward
    /// and forward+backward GB/s (twins: x + r then F.layer_norm; F.gelu(x + b); F.log_softmax +
    /// F.nll_loss; eager and torch.compile).
    Fused(FusedArgs),
    /// Inference latency (p50/p99) of a small MLP through the Predictor, eager and as a CUDA graph,
    /// batch 1 and 32 (twin: bench/predictor_torch.py, eager and torch.cuda.graphs).
    Predictor(PredictorArgs),
}

#[derive(Args, Debug)]
struct PredictorArgs {
    /// CUDA device: cuda or cuda:N.
    #[arg(long, default_value = "cuda")]
    device: Device,
    /// MLP width (input, hidden and output).
    #[arg(long, value_parser = crate::parse_count, default_value_t = 512)]
    width: usize,
    /// Linear layers (ReLU between them).
    #[arg(long, value_parser = crate::parse_count, default_value_t = 3)]
    layers: usize,
    /// Batch sizes, comma-separated.
    #[arg(long, value_delimiter = ',', value_parser = crate::parse_count, default_value = "1,32")]
    batches: Vec<usize>,
    /// Timed calls per row (after a tenth as many warm-up calls).
    #[arg(long, value_parser = crate::parse_count, default_value_t = 5000)]
    calls: usize,
    /// Also write the results as JSON to this file.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Seed of the weights and inputs.
    #[arg(long, value_parser = crate::parse_seed, default_value_t = 42)]
    seed: u64,
}

#[derive(Args, Debug)]
struct FusedArgs {
    /// CUDA device: cuda or cuda:N.
    #[arg(long, default_value = "cuda")]
    device: Device,
    /// Element type: bf16, f16 or f32.
    #[arg(long, default_value = "bf16", value_parser = parse_matmul_dtype)]
    dtype: DType,
    /// Shapes ROWSxCOLS (tokens x model width), comma-separated.
    #[arg(long, value_delimiter = ',', value_parser = bench::parse_shape, default_value = "16384x768")]
    shapes: Vec<(usize, usize)>,
    /// Fused classifier shapes ROWSxCLASSES (tokens x vocabulary), comma-separated; "none" for none.
    #[arg(long, value_delimiter = ',', value_parser = parse_shape_or_none, default_value = "8192x50257")]
    classifier: Vec<Option<(usize, usize)>>,
    #[command(flatten)]
    common: Common,
}

fn parse_shape_or_none(s: &str) -> Result<Option<(usize, usize)>, String> {
    if s.trim() == "none" {
        return Ok(None);
    }
    bench::parse_shape(s).map(Some)
}

#[derive(Args, Debug)]
struct LinearArgs {
    /// CUDA device: cuda or cuda:N.
    #[arg(long, default_value = "cuda")]
    device: Device,
    /// Element types, comma-separated: bf16, f16, f32.
    #[arg(long, value_delimiter = ',', value_parser = parse_matmul_dtype, default_value = "bf16")]
    dtype: Vec<DType>,
    /// Activation after the bias: gelu (tanh form), relu or none.
    #[arg(long, value_parser = bench::linear::parse_act, default_value = "gelu")]
    act: ferrograd_core::fused::linear::Activation,
    /// Tokens (rows of x) per problem. Default 16384 (16 x 1024).
    #[arg(long, value_parser = crate::parse_count)]
    rows: Option<usize>,
    /// INxOUT feature pairs, comma-separated. Default 768x3072,3072x768,1024x4096.
    #[arg(long, value_delimiter = ',', value_parser = bench::parse_shape)]
    features: Option<Vec<(usize, usize)>>,
    /// Also time each piece of the fused step alone (forward, activation gradient, each matmul).
    #[arg(long)]
    breakdown: bool,
    #[command(flatten)]
    common: Common,
}

#[derive(Args, Debug)]
struct Int8Args {
    /// CUDA device: cuda or cuda:N.
    #[arg(long, default_value = "cuda")]
    device: Device,
    /// Square sizes n (n x n times n x n), comma-separated, multiples of 16.
    #[arg(long, value_delimiter = ',', value_parser = crate::parse_count, default_value = "4096")]
    sizes: Vec<usize>,
    /// Also write the results as JSON to this file.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Seed of the Philox generator that fills the inputs.
    #[arg(long, value_parser = crate::parse_seed, default_value_t = 42)]
    seed: u64,
}

/// The flags `bench conv1d` and `bench selective-scan` share (`bench::seq_op::Sizes`).
#[derive(Args, Debug)]
struct SeqOpArgs {
    /// CUDA device: cuda or cuda:N.
    #[arg(long, default_value = "cuda")]
    device: Device,
    /// Element type of the sequence tensors: bf16 or f32 (the scan's A, D and delta_bias stay f32).
    #[arg(long, default_value = "bf16", value_parser = parse_matmul_dtype)]
    dtype: DType,
    /// Batch size.
    #[arg(long, value_parser = crate::parse_count, default_value_t = 4)]
    batch: usize,
    /// Channels (Mamba's d_inner).
    #[arg(long, value_parser = crate::parse_count, default_value_t = 1536)]
    dim: usize,
    /// Sequence lengths, comma-separated.
    #[arg(long, value_delimiter = ',', value_parser = crate::parse_count, default_value = "256,1024,4096")]
    seqs: Vec<usize>,
    /// Also write the results as JSON to this file (the bench draws no figure).
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Seed of the Philox generator that fills the inputs.
    #[arg(long, value_parser = crate::parse_seed, default_value_t = 42)]
    seed: u64,
}

impl From<SeqOpArgs> for bench::seq_op::Sizes {
    fn from(a: SeqOpArgs) -> Self {
        bench::seq_op::Sizes {
            device: a.device,
            dtype: a.dtype,
            batch: a.batch,
            dim: a.dim,
            seqs: a.seqs,
            json: a.json,
            seed: a.seed,
        }
    }
}

#[derive(Args, Debug)]
struct Conv1dArgs {
    #[command(flatten)]
    sizes: SeqOpArgs,
    /// Kernel width (Mamba's d_conv).
    #[arg(long, value_parser = crate::parse_count, default_value_t = 4)]
    k: usize,
}

#[derive(Args, Debug)]
struct SelectiveScanArgs {
    #[command(flatten)]
    sizes: SeqOpArgs,
    /// State size N.
    #[arg(long, value_parser = crate::parse_count, default_value_t = 16)]
    state: usize,
}

#[derive(Args, Debug)]
struct AttentionArgs {
    /// CUDA device: cuda or cuda:N.
    #[arg(long, default_value = "cuda")]
    device: Device,
    /// Element type: bf16, f16 or f32.
    #[arg(long, default_value = "bf16", value_parser = parse_matmul_dtype)]
    dtype: DType,
    /// Batch size B.
    #[arg(long, value_parser = crate::parse_count, default_value_t = 4)]
    batch: usize,
    /// Heads H (B * H = 64 by default).
    #[arg(long, value_parser = crate::parse_count, default_value_t = 16)]
    heads: usize,
    /// Sequence lengths, comma-separated.
    #[arg(long, value_delimiter = ',', value_parser = crate::parse_count, default_value = "512,1024,2048,4096,8192")]
    seqs: Vec<usize>,
    /// Head dims, comma-separated.
    #[arg(long, value_delimiter = ',', value_parser = crate::parse_count, default_value = "64,128")]
    head_dims: Vec<usize>,
    /// Causal settings, comma-separated: full, causal.
    #[arg(long, value_delimiter = ',', default_value = "full,causal", value_parser = parse_causal)]
    causal: Vec<bool>,
    /// Dropout probability of every call, in [0, 1) (the same mask each call, which the checks
    /// apply; PyTorch's twin takes the same flag).
    #[arg(long, default_value_t = 0.0)]
    dropout: f64,
    /// Implementation: auto (cuDNN where it can run the case, ours otherwise), flash (our
    /// kernels), cudnn, or math (the composed definition); overrides FERROGRAD_ATTENTION. Each
    /// row says which ran.
    #[arg(long, default_value = "auto", value_parser = parse_attention_backend)]
    backend: ferrograd_core::fused::attention::select::Backend,
    #[command(flatten)]
    common: Common,
}

fn parse_attention_backend(s: &str) -> Result<ferrograd_core::fused::attention::select::Backend, String> {
    ferrograd_core::fused::attention::select::Backend::parse(s).map_err(|e| e.to_string())
}

fn parse_causal(s: &str) -> Result<bool, String> {
    match s.trim() {
        "full" => Ok(false),
        "causal" => Ok(true),
        other => Err(format!("`{other}`: expected full or causal")),
    }
}

#[derive(Args, Debug)]
struct OptimArgs {
    /// CUDA device (or cpu).
    #[arg(long, default_value = "cuda")]
    device: Device,
    /// Parameter tensors in the step.
    #[arg(long, value_parser = crate::parse_count, default_value_t = 100)]
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
    #[arg(long, value_parser = crate::parse_count, default_value_t = 64)]
    mib: usize,
    /// Side of the four f32 matmuls of the synthetic step.
    #[arg(long, value_parser = crate::parse_count, default_value_t = 2048)]
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
    #[arg(long, value_parser = crate::parse_count, default_value_t = 1024)]
    size: usize,
    /// Seed of the Philox generator that fills the inputs.
    #[arg(long, value_parser = crate::parse_seed, default_value_t = 42)]
    seed: u64,
}

#[derive(Args, Debug)]
struct MemoryArgs {
    /// Refresh every second until interrupted (Ctrl-C).
    #[arg(long)]
    watch: bool,
    /// Stop --watch after this many refreshes (for tests and scripts).
    #[arg(long, value_parser = crate::parse_count, hide = true, requires = "watch")]
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
    #[arg(long, value_parser = crate::parse_seed, default_value_t = 42)]
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
    #[arg(long, value_parser = crate::parse_count, value_delimiter = ',')]
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
    #[arg(long, value_parser = crate::parse_count, default_value_t = 256)]
    mib: usize,
    /// Many-small case: this many tensors ...
    #[arg(long, value_parser = crate::parse_count, default_value_t = 100)]
    count: usize,
    /// ... of this many KiB each.
    #[arg(long, value_parser = crate::parse_count, default_value_t = 4)]
    kib: usize,
    #[command(flatten)]
    common: Common,
}

#[derive(Args, Debug)]
struct GuideArgs {
    /// CUDA device: cuda or cuda:N.
    #[arg(long, default_value = "cuda")]
    device: Device,
    /// Size of the large transfers and of the file read, MiB.
    #[arg(long, value_parser = crate::parse_count, default_value_t = 256)]
    mib: usize,
    /// JSON of bench/torch_guide.py, for the PyTorch column.
    #[arg(long, value_name = "FILE")]
    torch: Option<PathBuf>,
    #[command(flatten)]
    common: Common,
}

#[derive(Args, Debug)]
struct AllocArgs {
    /// CUDA device: cuda or cuda:N.
    #[arg(long, default_value = "cuda")]
    device: Device,
    /// Size of the block, MiB.
    #[arg(long, value_parser = crate::parse_count, default_value_t = 64)]
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
    #[arg(long, value_parser = crate::parse_count, default_value_t = 10_000)]
    ops: usize,
    /// Elements of the tensors added.
    #[arg(long, value_parser = crate::parse_count, default_value_t = 1024)]
    elems: usize,
    /// Timed chains (the median is reported).
    #[arg(long, value_parser = crate::parse_count, default_value_t = 5)]
    repeats: usize,
    #[command(flatten)]
    common: Common,
}

#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("compile").args(["precompile", "write_prebuilt"])))]
struct KernelsArgs {
    /// Compile every kernel module the GPU runs into the disk cache ($FERROGRAD_CACHE_DIR) and report
    /// the time the next start saves.
    #[arg(long)]
    precompile: bool,
    /// Compile every module of the architecture with NVRTC and write them into DIR as the
    /// prebuilt kernels the program ships (DIR/<arch>.bin and .manifest;
    /// scripts/prebuild-kernels.sh).
    #[arg(long, value_name = "DIR")]
    write_prebuilt: Option<PathBuf>,
    /// Architecture to compile for (sm_80, sm_90, 9.0, ...) instead of the GPU's; needs no GPU.
    #[arg(long, requires = "compile")]
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

/// One command, its flags turned into a configuration. See the module documentation.
#[derive(Debug)]
pub enum Job {
    Info,
    Demo(demo::Config),
    Memory(memory::Config),
    MonsterWalk(Box<monster::MonsterArgs>),
    Gpt(Box<gpt::GptArgs>),
    Mamba(mamba::MambaArgs),
    Matmul(bench::matmul::Config),
    Transfer(bench::transfer::Config),
    Guide(bench::guide::Config),
    Alloc(bench::alloc::Config),
    Elementwise(bench::elementwise::Config),
    Launch(bench::launch::Config),
    Optim(bench::optim::Config),
    Overlap(bench::overlap::Config),
    Attention(bench::attention::Config),
    Linear(bench::linear::Config),
    SelectiveScan(bench::selective_scan::Config),
    Conv1d(bench::conv1d::Config),
    Int8(bench::int8::Config),
    Fused(bench::fused::Config),
    Predictor(bench::predictor::Config),
    Kernels(kernels::Config),
    /// `ferrograd launch` (the ranks it starts check their own flags).
    LaunchRanks(launch::LaunchArgs),
    Dist(dist::DistCommand),
    Allreduce(bench::allreduce::Config),
}

impl Job {
    pub fn from_cli(cli: Cli) -> CliResult<Job> {
        use bench::*;
        Ok(match cli.command {
            Command::Info => Job::Info,
            Command::Demo(a) => Job::Demo(demo::Config { device: a.device, size: a.size, seed: a.seed }),
            Command::Memory(a) => Job::Memory(memory::Config {
                watch: a.watch,
                iterations: a.iterations,
                interval: Duration::from_secs(1),
                clear: io::stdout().is_terminal(),
            }),
            Command::MonsterWalk(a) => Job::MonsterWalk(Box::new(a)),
            Command::Gpt(a) => Job::Gpt(Box::new(a)),
            Command::Mamba(a) => Job::Mamba(a),
            Command::Bench(BenchCommand::Predictor(a)) => Job::Predictor(predictor::Config {
                device: a.device,
                width: a.width,
                layers: a.layers,
                batches: a.batches,
                calls: a.calls,
                json: a.json,
                seed: a.seed,
            }),
            Command::Launch(a) => Job::LaunchRanks(a),
            Command::Dist(c) => Job::Dist(c),
            Command::Bench(BenchCommand::Allreduce(a)) => Job::Allreduce(a.into()),
            Command::Bench(BenchCommand::Matmul(a)) => Job::Matmul(matmul::Config {
                device: a.device,
                dtypes: a.dtype,
                sizes: a.sizes,
                json: a.common.json,
                plot: a.common.plot,
                seed: a.common.seed,
            }),
            Command::Bench(BenchCommand::Transfer(a)) => Job::Transfer(transfer::Config {
                device: a.device,
                mib: a.mib,
                count: a.count,
                kib: a.kib,
                json: a.common.json,
                plot: a.common.plot,
                seed: a.common.seed,
            }),
            Command::Bench(BenchCommand::Guide(a)) => Job::Guide(bench::guide::Config {
                device: a.device,
                mib: a.mib,
                torch: a.torch,
                json: a.common.json,
                plot: a.common.plot,
                seed: a.common.seed,
            }),
            Command::Bench(BenchCommand::Alloc(a)) => {
                Job::Alloc(alloc::Config { device: a.device, mib: a.mib, json: a.json, plot: a.plot })
            }
            Command::Bench(BenchCommand::Elementwise(a)) => Job::Elementwise(elementwise::Config {
                device: a.device,
                shapes: a.shapes,
                json: a.common.json,
                plot: a.common.plot,
                seed: a.common.seed,
            }),
            Command::Bench(BenchCommand::Launch(a)) => Job::Launch(launch::Config {
                device: a.device,
                ops: a.ops,
                elems: a.elems,
                repeats: a.repeats,
                json: a.common.json,
                plot: a.common.plot,
                seed: a.common.seed,
            }),
            Command::Bench(BenchCommand::Optim(a)) => Job::Optim(optim::Config {
                device: a.device,
                tensors: a.tensors,
                json: a.common.json,
                plot: a.common.plot,
                seed: a.common.seed,
            }),
            Command::Bench(BenchCommand::Overlap(a)) => {
                Job::Overlap(overlap::Config { device: a.device, mib: a.mib, matmul: a.matmul, json: a.json })
            }
            Command::Bench(BenchCommand::Attention(a)) => Job::Attention(attention::Config {
                device: a.device,
                dtype: a.dtype,
                batch: a.batch,
                heads: a.heads,
                seqs: a.seqs,
                head_dims: a.head_dims,
                causal: a.causal,
                dropout: a.dropout,
                backend: a.backend,
                json: a.common.json,
                plot: a.common.plot,
                seed: a.common.seed,
            }),
            Command::Bench(BenchCommand::Linear(a)) => Job::Linear(linear::Config {
                device: a.device,
                dtypes: a.dtype,
                act: a.act,
                rows: a.rows,
                features: a.features,
                breakdown: a.breakdown,
                json: a.common.json,
                plot: a.common.plot,
                seed: a.common.seed,
            }),
            Command::Bench(BenchCommand::Fused(a)) => Job::Fused(fused::Config {
                device: a.device,
                dtype: a.dtype,
                shapes: a.shapes,
                classifier: a.classifier.into_iter().flatten().collect(),
                json: a.common.json,
                plot: a.common.plot,
                seed: a.common.seed,
            }),
            Command::Bench(BenchCommand::Int8(a)) => {
                Job::Int8(bench::int8::Config { device: a.device, sizes: a.sizes, json: a.json, seed: a.seed })
            }
            Command::Bench(BenchCommand::SelectiveScan(a)) => {
                Job::SelectiveScan(selective_scan::Config { sizes: a.sizes.into(), state: a.state })
            }
            Command::Bench(BenchCommand::Conv1d(a)) => Job::Conv1d(conv1d::Config { sizes: a.sizes.into(), k: a.k }),
            Command::Kernels(a) => {
                let ordinal = match a.device {
                    Device::Cuda(n) => n,
                    Device::Cpu => return Err("kernels --device: expected cuda or cuda:N".into()),
                };
                Job::Kernels(kernels::Config {
                    precompile: a.precompile,
                    write_prebuilt: a.write_prebuilt,
                    arch: a.arch,
                    ordinal,
                })
            }
        })
    }

    /// Every file the job will write, with the flag that named it.
    pub fn outputs(&self) -> Vec<(&'static str, &Path)> {
        fn two<'a>(json: &'a Option<PathBuf>, plot: &'a Option<PathBuf>) -> Vec<(&'static str, &'a Path)> {
            let mut v: Vec<(&'static str, &Path)> = vec![];
            v.extend(json.as_deref().map(|p| ("--json", p)));
            v.extend(plot.as_deref().map(|p| ("--plot", p)));
            v
        }
        match self {
            Job::MonsterWalk(a) => monster::outputs(a),
            Job::Matmul(c) => two(&c.json, &c.plot),
            Job::Transfer(c) => two(&c.json, &c.plot),
            Job::Guide(c) => two(&c.json, &c.plot),
            Job::Alloc(c) => two(&c.json, &c.plot),
            Job::Elementwise(c) => two(&c.json, &c.plot),
            Job::Launch(c) => two(&c.json, &c.plot),
            Job::Optim(c) => two(&c.json, &c.plot),
            Job::Overlap(c) => two(&c.json, &None),
            Job::Attention(c) => two(&c.json, &c.plot),
            Job::Linear(c) => two(&c.json, &c.plot),
            Job::Fused(c) => two(&c.json, &c.plot),
            Job::Predictor(c) => two(&c.json, &None),
            Job::SelectiveScan(c) => two(&c.sizes.json, &None),
            Job::Conv1d(c) => two(&c.sizes.json, &None),
            Job::Int8(c) => two(&c.json, &None),
            Job::Allreduce(c) => two(&c.json, &None),
            Job::Dist(c) => dist::outputs(c),
            // gpt checks its own output paths (checkpoint directories, logs) before training; the
            // ranks a launch starts check theirs.
            Job::Info | Job::Demo(_) | Job::Memory(_) | Job::Kernels(_) | Job::Gpt(_) | Job::LaunchRanks(_) => vec![],
            Job::Mamba(_) => vec![],
        }
    }

    /// The checks that need no device and write nothing: numbers in range, sizes that do not
    /// overflow, plans that fit the host's memory.
    pub fn check(&self) -> CliResult<()> {
        use bench::*;
        match self {
            Job::Demo(c) => demo::check(c),
            Job::MonsterWalk(a) => monster::check(a),
            Job::Matmul(c) => matmul::check(c),
            Job::Transfer(c) => transfer::check(c),
            Job::Guide(c) => guide::check(c),
            Job::Alloc(c) => alloc::check(c),
            Job::Elementwise(c) => elementwise::check(c),
            Job::Launch(c) => launch::check(c),
            Job::Optim(c) => optim::check(c),
            Job::Overlap(c) => overlap::check(c),
            Job::Attention(c) => attention::check(c),
            Job::Linear(c) => linear::check(c),
            Job::Fused(c) => fused::check(c),
            Job::Predictor(c) => predictor::check(c),
            Job::SelectiveScan(c) => selective_scan::check(c),
            Job::Conv1d(c) => conv1d::check(c),
            Job::Int8(c) => bench::int8::check(c),
            Job::Allreduce(c) => allreduce::check(c),
            Job::LaunchRanks(a) => crate::launch::check(a),
            Job::Dist(c) => dist::check(c),
            Job::Info | Job::Memory(_) | Job::Kernels(_) | Job::Gpt(_) | Job::Mamba(_) => Ok(()),
        }
    }

    /// Do the work.
    pub fn execute(self, out: &mut dyn Write) -> CliResult<()> {
        use bench::*;
        match self {
            Job::Info => info::run(out),
            Job::Demo(c) => demo::run(&c, out),
            Job::Memory(c) => memory::run(&c, out),
            Job::MonsterWalk(a) => monster::run(*a, out),
            Job::Gpt(a) => gpt::run(*a, out),
            Job::Mamba(a) => mamba::run(a, out),
            Job::Matmul(c) => matmul::run(&c, out),
            Job::Transfer(c) => transfer::run(&c, out),
            Job::Guide(c) => guide::run(&c, out),
            Job::Alloc(c) => alloc::run(&c, out),
            Job::Elementwise(c) => elementwise::run(&c, out),
            Job::Launch(c) => launch::run(&c, out),
            Job::Optim(c) => optim::run(&c, out),
            Job::Overlap(c) => overlap::run(&c, out),
            Job::Attention(c) => attention::run(&c, out),
            Job::Linear(c) => linear::run(&c, out),
            Job::SelectiveScan(c) => selective_scan::run(&c, out),
            Job::Conv1d(c) => conv1d::run(&c, out),
            Job::Int8(c) => bench::int8::run(&c, out),
            Job::Fused(c) => fused::run(&c, out),
            Job::Predictor(c) => predictor::run(&c, out),
            Job::Kernels(c) => kernels::run(&c, out),
            Job::LaunchRanks(a) => crate::launch::run(a, out),
            Job::Dist(c) => dist::run(c, out),
            Job::Allreduce(c) => allreduce::run(&c, out),
        }
    }
}

/// Check, check the outputs, then work (see the module documentation).
pub fn run(cli: Cli, out: &mut dyn Write) -> CliResult<()> {
    if cli.profile {
        ferrograd_core::cuda::profile::set_enabled(true);
    }
    let job = Job::from_cli(cli)?;
    job.check()?;
    ferrograd_core::io::check_outputs(&job.outputs())?;
    job.execute(out)
}

/// What to try after an out-of-memory error in this command: its own flags that need less memory.
fn oom_hint(c: &Command) -> &'static str {
    match c {
        Command::MonsterWalk(_) => {
            "try fewer copies (--copies N) or plan for less memory (--budget 8GiB or --fill 0.5)"
        }
        Command::Gpt(a) => gpt::oom_hint(&a.command),
        Command::Demo(_) => "try a smaller matmul (--size 512)",
        Command::Bench(BenchCommand::Matmul(_)) => "try smaller matrices (--sizes) or a smaller dtype (--dtype bf16)",
        Command::Bench(BenchCommand::Elementwise(_)) => "try smaller tensors (--shapes 4096x4096)",
        Command::Bench(BenchCommand::Transfer(_) | BenchCommand::Alloc(_)) => "try a smaller block (--mib 64)",
        Command::Bench(BenchCommand::Launch(_)) => "try smaller tensors (--elems)",
        Command::Bench(BenchCommand::Optim(_)) => "try fewer tensors (--tensors)",
        Command::Bench(BenchCommand::Overlap(_)) => "try a smaller batch (--mib) or matmul (--matmul)",
        Command::Bench(BenchCommand::Attention(_)) => "try shorter sequences (--seqs) or fewer heads (--heads)",
        Command::Bench(BenchCommand::Linear(_)) => "try fewer tokens (--rows 4096)",
        Command::Bench(BenchCommand::SelectiveScan(_)) => "try shorter sequences (--seqs) or fewer channels (--dim)",
        Command::Bench(BenchCommand::Conv1d(_)) => "try shorter sequences (--seqs) or fewer channels (--dim)",
        Command::Bench(BenchCommand::Int8(_)) => "try smaller sizes (--sizes)",
        Command::Bench(BenchCommand::Allreduce(_)) => "try smaller buffers (--sizes 1,16,64)",
        Command::Bench(BenchCommand::Fused(_)) => "try fewer rows (--shapes 4096x768)",
        Command::Mamba(_) => "try a smaller batch (--batch 8) or a shorter --context",
        _ => "free memory held by other processes (nvidia-smi lists them)",
    }
}

/// The program: parse `std::env::args`, run, print one error line on failure.
pub fn main() -> ExitCode {
    let cli = match Cli::parse_from_args(std::env::args_os()) {
        Ok(c) => c,
        Err(e) => e.exit(),
    };
    // The kernels shipped in this binary: a first GPU run loads them instead of compiling.
    if let Err(e) = ferrograd_kernels::install() {
        eprintln!("ferrograd: the prebuilt kernels are unusable ({e}); NVRTC compiles every module");
    }
    let hint = oom_hint(&cli.command);
    let stdout = io::stdout();
    let mut out = stdout.lock();
    let res = run(cli, &mut out).and_then(|()| out.flush().map_err(CliError::from));
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if is_broken_pipe(&*e) => ExitCode::SUCCESS,
        Err(e) => {
            let _ = out.flush();
            eprintln!("error: {}", error_line(&*e, hint));
            if let Some(report) = memory::oom_report(&*e, memory::status_after_error, hint) {
                eprint!("{report}");
            }
            ExitCode::FAILURE
        }
    }
}

/// The error's one line, with what to do next where the error alone does not say it.
pub fn error_line(e: &(dyn std::error::Error + 'static), hint: &str) -> String {
    match e.downcast_ref::<ferrograd_core::Error>() {
        Some(ferrograd_core::Error::HostOutOfMemory { .. }) => format!("{e}; {hint}"),
        Some(ferrograd_core::Error::NonFinite { .. }) => {
            format!("{e}; pass --allow-nonfinite to load it anyway (training will likely stop at a non-finite loss)")
        }
        _ => e.to_string(),
    }
}

fn is_broken_pipe(e: &(dyn std::error::Error + 'static)) -> bool {
    e.downcast_ref::<io::Error>().is_some_and(|e| e.kind() == io::ErrorKind::BrokenPipe)
}

/// Whether `--profile` / `FERROGRAD_PROFILE` times the kernels `device` runs (CUDA only). The
/// commands run their steps eagerly then: a replayed CUDA graph records no per-kernel times.
pub(crate) fn profiling_on(device: Device) -> bool {
    device.is_cuda() && ferrograd_core::cuda::profile::enabled()
}

/// The note `gpt train` and `mamba train` print when profiling turns their CUDA graph off.
pub(crate) const PROFILE_EAGER_NOTE: &str =
    "--profile: every step runs eagerly (a replayed CUDA graph records no per-kernel times)";

/// A subcommand's flattened arguments `A` parsed from `args` (the program name first), for tests.
#[cfg(test)]
pub(crate) fn parse_args<A: clap::Args + clap::FromArgMatches>(args: &[&str]) -> A {
    let matches = A::augment_args(clap::Command::new("test")).try_get_matches_from(args).expect("arguments parse");
    A::from_arg_matches(&matches).expect("arguments convert")
}

/// Runs `f` with the process-wide profiling switch set to `on`, one test at a time (the switch is
/// global and the tests run on parallel threads), and switches it off again.
#[cfg(test)]
pub(crate) fn with_profiling<T>(on: bool, f: impl FnOnce() -> T) -> T {
    static SWITCH: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    ferrograd_core::cuda::profile::set_enabled(on);
    let out = f();
    ferrograd_core::cuda::profile::set_enabled(false);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn clap_definitions_are_consistent() {
        Cli::command().debug_assert();
        Cli::command_def().debug_assert();
    }

    #[test]
    fn sizes_and_device_parse() {
        let cli =
            Cli::parse_from_args(["ferrograd", "bench", "matmul", "--device", "cuda:1", "--sizes", "8,16"]).unwrap();
        let Command::Bench(BenchCommand::Matmul(a)) = cli.command else { panic!("wrong subcommand") };
        assert_eq!(a.device, Device::Cuda(1));
        assert_eq!(a.sizes, Some(vec![8, 16]));
        assert_eq!(a.dtype, None);
        assert!(Cli::parse_from_args(["ferrograd", "bench", "matmul", "--device", "tpu"]).is_err());
    }

    #[test]
    fn dtypes_shapes_and_arch_parse() {
        let cli = Cli::parse_from_args(["ferrograd", "bench", "matmul", "--dtype", "bf16,f16"]).unwrap();
        let Command::Bench(BenchCommand::Matmul(a)) = cli.command else { panic!("wrong subcommand") };
        assert_eq!(a.dtype, Some(vec![DType::BF16, DType::F16]));
        assert!(Cli::parse_from_args(["ferrograd", "bench", "matmul", "--dtype", "i32"]).is_err());

        let cli = Cli::parse_from_args(["ferrograd", "bench", "elementwise", "--shapes", "4x8,16x2"]).unwrap();
        let Command::Bench(BenchCommand::Elementwise(a)) = cli.command else { panic!("wrong subcommand") };
        assert_eq!(a.shapes, vec![(4, 8), (16, 2)]);
        assert_eq!(a.device, Device::Cuda(0));

        let cli = Cli::parse_from_args(["ferrograd", "kernels", "--precompile", "--arch", "sm_90"]).unwrap();
        let Command::Kernels(a) = cli.command else { panic!("wrong subcommand") };
        assert_eq!(a.arch, Some(Arch::SM90));
        assert!(Cli::parse_from_args(["ferrograd", "kernels", "--arch", "sm_90"]).is_err());
        let cli = Cli::parse_from_args(["ferrograd", "kernels", "--write-prebuilt", "out", "--arch", "sm_80"]).unwrap();
        let Command::Kernels(a) = cli.command else { panic!("wrong subcommand") };
        assert_eq!((a.write_prebuilt.as_deref(), a.arch), (Some(std::path::Path::new("out")), Some(Arch::SM80)));
        assert!(Cli::parse_from_args(["ferrograd", "kernels", "--precompile", "--arch", "banana"]).is_err());
    }
}
