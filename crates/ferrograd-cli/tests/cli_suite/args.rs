//! Property harness for the command line (`robust_args`): random argument vectors drawn from
//! every subcommand, flag and a vocabulary of awkward values (negative, huge, overflowing shapes,
//! odd devices and paths) are parsed and checked (`Job::check`: no device is opened and nothing is
//! written). Whatever the input, the outcome is Ok or an error with a message, never a panic.
//! `FERROGRAD_PROPTEST_CASES` sets the number of cases (CI runs more); `fuzz/` has the cargo-fuzz
//! target over raw bytes.

use ferrograd_cli::{Cli, Job};
use proptest::prelude::*;

fn cases(default: u32) -> u32 {
    std::env::var("FERROGRAD_PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

const COMMANDS: &[&[&str]] = &[
    &["monster-walk"],
    &["monster-walk", "export"],
    &["bench", "matmul"],
    &["bench", "transfer"],
    &["bench", "alloc"],
    &["bench", "elementwise"],
    &["bench", "launch"],
    &["bench", "optim"],
    &["bench", "overlap"],
    &["bench", "selective-scan"],
    &["demo"],
    &["kernels"],
    &["info"],
    &["memory"],
    &["launch"],
    &["launch", "--nproc-per-node", "2", "--", "true"],
    &["dist", "check"],
    &["dist", "mlp"],
    &["bench", "allreduce"],
];

const FLAGS: &[&str] = &[
    "--copies",
    "--fill",
    "--budget",
    "--epochs",
    "--lr",
    "--batch",
    "--seed",
    "--device",
    "--init",
    "--save",
    "--report",
    "--unfused",
    "--allow-nonfinite",
    "--skip-nonfinite",
    "--copy",
    "--values-of",
    "--out",
    "--json",
    "--plot",
    "--sizes",
    "--dtype",
    "--mib",
    "--count",
    "--kib",
    "--shapes",
    "--ops",
    "--elems",
    "--repeats",
    "--tensors",
    "--matmul",
    "--dim",
    "--state",
    "--seqs",
    "--size",
    "--precompile",
    "--arch",
    "--watch",
    "--iterations",
    "--nproc-per-node",
    "--nnodes",
    "--node-rank",
    "--master-addr",
    "--master-port",
    "--stop-grace",
    "--global-batch",
    "--micro-steps",
    "--zero",
    "--comm-dtype",
    "--bucket-mib",
    "--clip",
    "--checkpoint",
    "--warmup",
    "--iters",
    "--",
];

const VALUES: &[&str] = &[
    "0",
    "1",
    "-1",
    "3",
    "5041",
    "5042",
    "99999999",
    "18446744073709551615",
    "18446744073709551616",
    "-0",
    "1e-3",
    "nan",
    "inf",
    "-inf",
    "0.5",
    "1.5",
    "1000TB",
    "12GB",
    "8GiB",
    "0B",
    "1e400GB",
    "cpu",
    "cuda",
    "cuda:0",
    "cuda:99",
    "tpu",
    "3x6148914691236517206",
    "100000x100000",
    "4x8",
    "0x4",
    "x",
    "8,16",
    "8,,16",
    "f32",
    "bf16",
    "i32",
    "sm_90",
    "banana",
    "",
    "/nonexistent/x.json",
    "/dev/null",
    ".",
    "a.json",
];

fn arg() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => prop::sample::select(FLAGS).prop_map(String::from),
        3 => prop::sample::select(VALUES).prop_map(String::from),
        1 => any::<u64>().prop_map(|v| v.to_string()),
        1 => any::<i64>().prop_map(|v| v.to_string()),
        1 => "[ -~]{0,12}",
    ]
}

fn check(args: &[String]) {
    let argv = std::iter::once("ferrograd".to_string()).chain(args.iter().cloned());
    let cli = match Cli::parse_from_args(argv) {
        Ok(c) => c,
        Err(e) => {
            assert!(!e.to_string().is_empty());
            return;
        }
    };
    match Job::from_cli(cli).and_then(|j| j.check().map(|()| j)) {
        Ok(job) => {
            // Outputs are listed, never touched here.
            let _ = job.outputs();
        }
        Err(e) => assert!(!e.to_string().is_empty()),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(256), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn robust_args(cmd in prop::sample::select(COMMANDS), rest in prop::collection::vec(arg(), 0..8)) {
        let args: Vec<String> = cmd.iter().map(|s| s.to_string()).chain(rest).collect();
        check(&args);
    }
}

#[test]
fn the_issue_commands_check_without_panicking() {
    for args in [
        "monster-walk --device cpu --copies 18446744073709551615 --epochs 1",
        "bench launch --device cpu --elems 18446744073709551615 --ops 1",
        "bench elementwise --device cpu --shapes 3x6148914691236517206",
        "bench elementwise --device cpu --shapes 100000x100000",
        "bench optim --device cpu --tensors 1000000",
        "monster-walk --device cpu --budget 1000TB",
        "monster-walk --device cpu --batch 99999999",
        "monster-walk --copies -1",
        "monster-walk --device cpu --pipeline 4 --copies 18446744073709551615 --epochs 1",
        "monster-walk --device cpu --pipeline 18446744073709551615",
        "monster-walk --device cpu --pipeline 4 --micro-batches 18446744073709551615",
        "monster-walk export --values-of 18446744073709551615 --out x",
        "launch --nproc-per-node 18446744073709551615 --nnodes 2 --master-addr a -- true",
        "launch --nproc-per-node 1024 --nnodes 18446744073709551615 --master-addr a -- true",
        "bench allreduce --sizes 1e300",
        "dist mlp --bucket-mib 1e300",
    ] {
        let argv: Vec<String> = args.split(' ').map(String::from).collect();
        check(&argv);
    }
}
