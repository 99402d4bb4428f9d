//! Pipeline parallelism across GPUs through `ferrograd launch` (NCCL send/recv). Each test skips
//! with one line where fewer than two GPUs or no NCCL library exist; on a 2-GPU machine they check
//! that
//!
//! - `monster-walk --pipeline 4` on 2 GPUs (two stage groups each) trains the parameters the same
//!   four groups train on one GPU, for the same micro-batches (f32, 1e-5 relative to each tensor's
//!   scale), under GPipe and 1F1B, and the two schedules agree;
//! - a stage that fails (an injected error on rank 1) stops every rank with a message naming it,
//!   with no hang.

mod common;

use common::{ferrograd, ok, two_gpus, weights};
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::{Duration, Instant};

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
#[ignore = "hangs on 2 x H200 (2026-11-23): the NCCL pipeline path is disabled until fixed (monster_pipeline.rs)"]
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
    // The NCCL pipeline is opt-in while it hangs (monster_pipeline.rs); a failure at step 2 comes
    // before the hang (this passed on 2 x H200), so the abort path stays tested.
    let env = [("FERROGRAD_PIPELINE_FAIL", "1"), ("FERROGRAD_PIPELINE_NCCL", "1")];
    let o = walk(2, 3, "1f1b", &tmp("fail.safetensors"), &env);
    let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    println!("{text}");
    assert!(!o.status.success());
    assert!(text.contains("injected failure") && text.contains("rank 1"), "{text}");
    assert!(start.elapsed() < Duration::from_secs(90), "took {:?}", start.elapsed());
}
