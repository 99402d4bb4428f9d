//! `ferrograd`: the command-line tool. This file holds the clap definitions and the dispatch;
//! each subcommand lives in its own module and writes to the `Write` it is given, so that a closed
//! pipe (`ferrograd info | head -1`) ends the program quietly instead of panicking in `println!`.
//!
//! Errors: every failure reaches `main` as a [`CliError`] and is printed as one line,
//! `error: ...`, with exit status 1. Bad flags are clap's own `error: ...` with status 2.

mod bench;
mod info;
mod timing;

use clap::{Args, Parser, Subcommand};
use ferrograd_core::Device;
use std::io::{self, Write};
use std::path::PathBuf;
use std::process::ExitCode;

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
    /// Micro-benchmarks; each prints a table and can write JSON.
    #[command(subcommand)]
    Bench(BenchCommand),
}

#[derive(Subcommand, Debug)]
enum BenchCommand {
    /// Square f32 matmul: a naive triple loop against ferrograd's `Tensor::matmul`.
    Matmul(MatmulArgs),
}

#[derive(Args, Debug)]
struct MatmulArgs {
    /// Device to run on: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: Device,
    /// Matrix sizes (n for n x n times n x n), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "128,256,512,1024")]
    sizes: Vec<usize>,
    /// Also write the results as JSON to this file.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Seed of the Philox generator that fills the inputs.
    #[arg(long, default_value_t = 42)]
    seed: u64,
}

fn run(cli: Cli, out: &mut dyn Write) -> CliResult<()> {
    match cli.command {
        Command::Info => info::run(out),
        Command::Bench(BenchCommand::Matmul(a)) => bench::matmul::run(
            &bench::matmul::Config { device: a.device, sizes: a.sizes, json: a.json, seed: a.seed },
            out,
        ),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let stdout = io::stdout();
    let mut out = stdout.lock();
    let res = run(cli, &mut out).and_then(|()| out.flush().map_err(CliError::from));
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if is_broken_pipe(&*e) => ExitCode::SUCCESS,
        Err(e) => {
            let _ = out.flush();
            eprintln!("error: {e}");
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
        assert_eq!(a.sizes, vec![8, 16]);
        assert!(Cli::try_parse_from(["ferrograd", "bench", "matmul", "--device", "tpu"]).is_err());
    }
}
