//! Pipeline parallelism across GPUs through `ferrograd launch` (NCCL send/recv). Each test skips
//! with one line where fewer than two GPUs or no NCCL library exist; on a 2-GPU machine they check
//! that
//!
//! - `monster-walk --pipeline 4` on 2 GPUs (two stage groups each) trains the parameters the same
//!   four groups train on one GPU, for the same micro-batches (f32, 1e-5 relative to each tensor's
//!   scale), under GPipe and 1F1B, and the two schedules agree;
//! - a stage that fails (an injected error on rank 1) stops every rank with a message naming it,
//!   with no hang.
//!
//! A run that takes longer than a minute and a half is killed and fails its test (the first 2-GPU
//! run of the pipeline hung: see `ferrograd_dist::pipeline::runner`).

use crate::common;

use common::{ok, two_gpus, weights};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// How long one run may take before it counts as a hang (a run takes seconds).
const HANG: Duration = Duration::from_secs(90);

/// `common::ferrograd`, but a run that outlives [`HANG`] is killed with its ranks (its own process
/// group) and fails the test, instead of hanging it.
fn ferrograd(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(common::bin());
    c.args(args).env("NCCL_NVLS_ENABLE", "0").stdout(Stdio::piped()).stderr(Stdio::piped()).process_group(0);
    for (k, v) in env {
        c.env(k, v);
    }
    let child = c.spawn().expect("failed to start ferrograd");
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(HANG) {
        Ok(out) => out.expect("failed to wait for ferrograd"),
        Err(_) => {
            let _ = Command::new("kill").args(["-KILL", "--", &format!("-{pid}")]).status();
            let out = rx.recv_timeout(Duration::from_secs(10)).ok().and_then(|o| o.ok());
            let (o, e) = out.as_ref().map(common::text).unwrap_or_default();
            panic!("ferrograd {args:?} made no progress in {HANG:?} (a hang): killed\nstdout:\n{o}\nstderr:\n{e}");
        }
    }
}

fn port(k: u16) -> String {
    common::port(21000, k)
}

fn tmp(name: &str) -> PathBuf {
    common::tmp("pipe", name)
}

/// [`common::max_rel`] of two Monster Walk weight files (its 16 tensors).
fn max_rel(a: &Path, b: &Path) -> f64 {
    assert_eq!(weights(a).len(), 16);
    common::max_rel(a, b)
}

const RUN: [&str; 10] =
    ["monster-walk", "--pipeline", "4", "--copies", "2", "--epochs", "2", "--batch", "1200", "--micro-batches"];

/// `monster-walk --pipeline 4` with 4 micro-batches on `nproc` GPUs (launch) or on cuda:0.
fn walk(nproc: usize, k: u16, schedule: &str, save: &Path, env: &[(&str, &str)]) -> Output {
    let s = save.to_str().unwrap();
    let mut a: Vec<&str> = vec![];
    let (n, p) = (nproc.to_string(), port(k));
    if nproc > 1 {
        a.extend_from_slice(&["launch", "--nproc-per-node", &n, "--master-port", &p, "--", "ferrograd"]);
    }
    a.extend_from_slice(&RUN);
    a.extend_from_slice(&["4", "--schedule", schedule, "--save", s]);
    if nproc == 1 {
        a.extend_from_slice(&["--device", "cuda:0"]);
    }
    ferrograd(&a, env)
}

#[test]
fn pipeline_gpu_two_gpus_train_as_one_does() {
    if !two_gpus("pipeline_gpu_two_gpus_train_as_one_does") {
        return;
    }
    let one = tmp("one.safetensors");
    println!("{}", ok(&walk(1, 0, "gpipe", &one, &[])));
    let mut runs = vec![];
    for (k, schedule) in [(1, "gpipe"), (2, "1f1b")] {
        let two = tmp(&format!("two-{schedule}.safetensors"));
        let out = ok(&walk(2, k, schedule, &two, &[]));
        println!("{out}");
        assert!(out.contains("bubble"), "{out}");
        let rel = max_rel(&two, &one);
        println!("{schedule}: 2 GPUs vs 1 GPU, largest relative difference {rel:.2e}");
        assert!(rel <= 1e-5, "{schedule}: {rel}");
        runs.push(two);
    }
    let rel = max_rel(&runs[0], &runs[1]);
    println!("gpipe vs 1f1b on 2 GPUs: {rel:.2e}");
    assert!(rel <= 1e-5, "{rel}");
}

#[test]
fn pipeline_gpu_failing_stage_stops_every_rank() {
    if !two_gpus("pipeline_gpu_failing_stage_stops_every_rank") {
        return;
    }
    let start = Instant::now();
    let env = [("FERROGRAD_PIPELINE_FAIL", "1")];
    let o = walk(2, 3, "1f1b", &tmp("fail.safetensors"), &env);
    let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    println!("{text}");
    assert!(!o.status.success());
    assert!(text.contains("injected failure") && text.contains("rank 1"), "{text}");
    assert!(start.elapsed() < Duration::from_secs(90), "took {:?}", start.elapsed());
}
