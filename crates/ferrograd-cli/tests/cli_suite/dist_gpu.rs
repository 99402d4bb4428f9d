//! Multi-GPU runs through `ferrograd launch` (NCCL). Each test skips with one line where fewer
//! than two GPUs or no NCCL library exist; on a 2-GPU machine they check that
//!
//! - every collective gives the right values across processes (`dist check`);
//! - 2-GPU data parallel ends with the parameters of 1 GPU on the same global batch (f32, 10
//!   AdamW steps, 1e-5 relative to each tensor's scale), for ZeRO-1 too, and for two single-GPU
//!   "nodes" launched separately over 127.0.0.1;
//! - a checkpoint written by 2 GPUs resumes on 1 to the same parameters;
//! - a rank that is killed stops the group with a message naming it, with no hang;
//! - a rendezvous that times out names the missing rank.

use crate::common;

use common::{bin, ferrograd, max_rel, ok, two_gpus, weights};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn port(k: u16) -> String {
    common::port(20000, k)
}

fn tmp(name: &str) -> PathBuf {
    common::tmp("dist", name)
}

/// `launch --nproc-per-node N -- ferrograd dist mlp ARGS --out FILE`.
fn mlp(nproc: usize, k: u16, args: &[&str], out: &Path) -> Output {
    let n = nproc.to_string();
    let p = port(k);
    let mut a = vec!["launch", "--nproc-per-node", &n, "--master-port", &p, "--", "ferrograd", "dist", "mlp"];
    a.extend_from_slice(args);
    let o = out.to_str().unwrap();
    a.extend_from_slice(&["--out", o]);
    ferrograd(&a, &[])
}

#[test]
fn dist_gpu_collectives_give_the_right_values() {
    if !two_gpus("dist_gpu_collectives_give_the_right_values") {
        return;
    }
    let p = port(0);
    let out = ok(&ferrograd(
        &["launch", "--nproc-per-node", "2", "--master-port", &p, "--", "ferrograd", "dist", "check"],
        &[],
    ));
    for r in 0..2 {
        assert!(out.contains(&format!("[rank {r}] rank {r}: all-reduce (sum, avg, min, max)")), "{out}");
    }
    assert!(out.contains("backend nccl"), "{out}");
    println!("{out}");
}

#[test]
fn dist_gpu_data_parallel_matches_one_gpu() {
    if !two_gpus("dist_gpu_data_parallel_matches_one_gpu") {
        return;
    }
    let (one, two, zero, bf16) = (tmp("one"), tmp("two"), tmp("zero"), tmp("bf16"));
    ok(&mlp(1, 1, &["--steps", "10"], &one));
    ok(&mlp(2, 2, &["--steps", "10"], &two));
    ok(&mlp(2, 3, &["--steps", "10", "--zero", "1"], &zero));
    let out = ok(&mlp(2, 4, &["--steps", "10", "--comm-dtype", "bf16", "--micro-steps", "2"], &bf16));
    let (e2, ez) = (max_rel(&two, &one), max_rel(&zero, &one));
    println!("2 GPUs vs 1: {e2:e}; ZeRO-1 on 2 vs 1: {ez:e}; bf16 gradients vs f32: {:e}", max_rel(&bf16, &one));
    assert!(e2 <= 1e-5, "2-GPU data parallel differs from 1 GPU by {e2:e}");
    assert!(ez <= 1e-5, "ZeRO-1 differs from 1 GPU by {ez:e}");
    assert!(out.contains("final loss"), "{out}");
}

#[test]
fn dist_gpu_checkpoint_from_two_gpus_resumes_on_one() {
    if !two_gpus("dist_gpu_checkpoint_from_two_gpus_resumes_on_one") {
        return;
    }
    let (want, ckpt, got) = (tmp("want"), tmp("ckpt"), tmp("resumed"));
    ok(&mlp(1, 5, &["--steps", "10", "--zero", "1"], &want));
    let c = ckpt.to_str().unwrap();
    ok(&mlp(2, 6, &["--steps", "5", "--zero", "1", "--save-at", "5", "--checkpoint", c], &tmp("half")));
    ok(&mlp(1, 7, &["--steps", "10", "--zero", "1", "--resume", c], &got));
    let e = max_rel(&got, &want);
    println!("saved on 2 GPUs at step 5, resumed on 1 to step 10: {e:e} from the 1-GPU run");
    assert!(e <= 1e-5, "{e:e}");
}

#[test]
fn dist_gpu_killed_rank_stops_the_group() {
    if !two_gpus("dist_gpu_killed_rank_stops_the_group") {
        return;
    }
    let t = Instant::now();
    let o = mlp(2, 8, &["--steps", "1000000", "--die-rank", "1", "--die-at-step", "3"], &tmp("never"));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(t.elapsed() < Duration::from_secs(90), "took {:?}", t.elapsed());
    assert!(err.contains("rank 1 (local rank 1") && err.contains("SIGKILL"), "{err}");
    assert!(err.contains("stopping rank(s) 0"), "{err}");
    println!(
        "stopped in {:.1} s: {}",
        t.elapsed().as_secs_f64(),
        err.lines().filter(|l| l.contains("ferrograd launch")).collect::<Vec<_>>().join(" | ")
    );
}

#[test]
fn dist_gpu_two_nodes_on_one_host_match_one_gpu() {
    if !two_gpus("dist_gpu_two_nodes_on_one_host_match_one_gpu") {
        return;
    }
    let (one, two) = (tmp("node-one"), tmp("node-two"));
    ok(&mlp(1, 9, &["--steps", "10"], &one));
    let p = port(10);
    let o = two.to_str().unwrap().to_string();
    let node = |rank: &str, gpu: &str| {
        Command::new(bin())
            .args([
                "launch",
                "--nproc-per-node",
                "1",
                "--nnodes",
                "2",
                "--node-rank",
                rank,
                "--master-addr",
                "127.0.0.1",
            ])
            .args(["--master-port", &p, "--", "ferrograd", "dist", "mlp", "--steps", "10", "--out", &o])
            .env("CUDA_VISIBLE_DEVICES", gpu)
            .env("NCCL_NVLS_ENABLE", "0")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (n1, n0) = (node("1", "1"), node("0", "0"));
    let (o0, o1) = (n0.wait_with_output().unwrap(), n1.wait_with_output().unwrap());
    let out0 = ok(&o0);
    ok(&o1);
    assert!(out0.contains("[rank 0] rank 0 of 2"), "{out0}");
    let e = max_rel(&two, &one);
    println!("two launches --nnodes 2 over 127.0.0.1 vs 1 GPU: {e:e}");
    assert!(e <= 1e-5, "{e:e}");
}

#[test]
fn dist_gpu_rendezvous_timeout_names_the_missing_rank() {
    if !two_gpus("dist_gpu_rendezvous_timeout_names_the_missing_rank") {
        return;
    }
    let p = port(11);
    let t = Instant::now();
    let env = [
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("LOCAL_RANK", "0"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", p.as_str()),
        ("FERROGRAD_DIST_TIMEOUT", "3"),
    ];
    let o = ferrograd(&["dist", "check"], &env);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(err.contains("rank(s) [1] of 2 never arrived"), "{err}");
    assert!(t.elapsed() < Duration::from_secs(60));
}

/// Token shards of LCG tokens (a skewed distribution below 300) for the GPT runs.
fn gpt_shards(dir: &Path) {
    common::gpt_run::lcg_shards(dir, 7, 200_000, 10_000);
}

/// `launch --nproc-per-node N -- ferrograd gpt train --data DATA --out OUT ARGS`.
fn gpt(nproc: usize, k: u16, data: &Path, out: &Path, args: &[&str]) -> String {
    let (n, p) = (nproc.to_string(), port(k));
    let (d, o) = (data.to_str().unwrap(), out.to_str().unwrap());
    let mut a = vec!["launch", "--nproc-per-node", &n, "--master-port", &p, "--", "ferrograd", "gpt", "train"];
    a.extend_from_slice(&["--data", d, "--out", o, "--progress", "lines", "--log-every", "1"]);
    a.extend_from_slice(args);
    ok(&ferrograd(&a, &[]))
}

/// A small GPT in f32, 4 x 64 tokens a micro-batch, 4 micro-batches a step over all ranks, a
/// constant learning rate (so that a run cut short and resumed follows the same schedule).
const GPT_RUN: &[&str] = &[
    "--layers",
    "2",
    "--heads",
    "2",
    "--dim",
    "64",
    "--context",
    "64",
    "--batch",
    "4",
    "--total-batch",
    "1024",
    "--precision",
    "f32",
    "--lr",
    "1e-3",
    "--warmup",
    "0",
    "--min-lr-ratio",
    "1",
    "--val-every",
    "0",
    "--val-batches",
    "2",
];

/// `max_rel` of two exported GPT models, leaving out the key third of `c_attn.bias`: its
/// gradient is exactly zero in exact arithmetic (softmax ignores a shift shared by all keys), so
/// Adam turns its rounding noise into steps of about lr whatever the summation order.
fn gpt_max_rel(a: &Path, b: &Path, dim: usize) -> f64 {
    let (a, b) = (weights(&a.join("model/model.safetensors")), weights(&b.join("model/model.safetensors")));
    assert_eq!(a.len(), b.len());
    let mut worst = 0.0f64;
    for (name, x) in &a {
        let y = &b[name];
        let keep = |i: usize| !(name.ends_with("attn.c_attn.bias") && (dim..2 * dim).contains(&i));
        let diff = x.iter().zip(y).enumerate().filter(|(i, _)| keep(*i)).map(|(_, (p, q))| (p - q).abs() as f64);
        let scale = y.iter().map(|q| q.abs() as f64).fold(1e-30, f64::max);
        worst = worst.max(diff.fold(0.0, f64::max) / scale);
    }
    worst
}

#[test]
fn dist_gpu_gpt_train_on_two_gpus_matches_one() {
    if !two_gpus("dist_gpu_gpt_train_on_two_gpus_matches_one") {
        return;
    }
    let data = tmp("gpt-data");
    gpt_shards(&data);
    let (one, two, half) = (tmp("gpt-one"), tmp("gpt-two"), tmp("gpt-half"));
    let with = |extra: &[&'static str]| -> Vec<&str> { GPT_RUN.iter().chain(extra).copied().collect() };
    gpt(1, 8, &data, &one, &with(&["--steps", "10"]));
    let out = gpt(2, 9, &data, &two, &with(&["--steps", "10"]));
    assert!(out.contains("data parallel over 2 ranks (nccl"), "{out}");
    // Rank 0 speaks for the group; the other says nothing.
    assert!(!out.contains("[rank 1] step"), "{out}");
    let e = gpt_max_rel(&two, &one, 64);
    println!("gpt train, 2 GPUs vs 1 on the same global batch (f32, 10 steps): max rel {e:e}");
    assert!(e <= 1e-5, "{e:e}");
    // 5 steps on 2 GPUs, then the checkpoint resumed on 1 GPU to step 10.
    gpt(2, 10, &data, &half, &with(&["--steps", "5"]));
    let out = gpt(1, 11, &data, &half, &["--resume", "--steps", "10"]);
    assert!(out.contains("resuming at step 5"), "{out}");
    let e = gpt_max_rel(&half, &one, 64);
    println!("gpt train, 5 steps on 2 GPUs resumed on 1 to step 10, vs 1 GPU throughout: max rel {e:e}");
    assert!(e <= 1e-5, "{e:e}");
}

/// `gpt train --zero 1` on 2 GPUs: reduce-scatter, GPT's AdamW on each GPU's half of the
/// parameters, all-gather; the steps of 1 GPU, half the moments per GPU, and checkpoints that
/// resume with ZeRO on 2 GPUs and without it on 1.
#[test]
fn dist_gpu_gpt_train_zero1_on_two_gpus_matches_one() {
    if !two_gpus("dist_gpu_gpt_train_zero1_on_two_gpus_matches_one") {
        return;
    }
    let data = tmp("gpt-zero-data");
    gpt_shards(&data);
    let (one, zero, half, to_one) =
        (tmp("gpt-zero-one"), tmp("gpt-zero-two"), tmp("gpt-zero-half"), tmp("gpt-zero-to1"));
    let with = |extra: &[&'static str]| -> Vec<&str> { GPT_RUN.iter().chain(extra).copied().collect() };
    gpt(1, 12, &data, &one, &with(&["--steps", "10"]));
    let out = gpt(2, 13, &data, &zero, &with(&["--steps", "10", "--zero", "1"]));
    assert!(out.contains("ZeRO-1 (reduce-scatter"), "{out}");
    // The optimizer memory and how the step ran (one CUDA graph, or eager and why), for the record.
    for line in out.lines().filter(|l| l.contains("ZeRO-1: rank") || l.contains("step: ")) {
        println!("{line}");
    }
    assert!(out.contains("ZeRO-1: rank 0 keeps AdamW moments for its shard"), "{out}");
    let e = gpt_max_rel(&zero, &one, 64);
    println!("gpt train --zero 1, 2 GPUs vs 1 on the same global batch (f32, 10 steps): max rel {e:e}");
    assert!(e <= 1e-5, "{e:e}");
    // 5 ZeRO steps on 2 GPUs resumed with ZeRO on 2: the straight ZeRO run (bit for bit on the
    // CPU, gpt_zero.rs; here NCCL's reductions are deterministic for a fixed size and algorithm).
    gpt(2, 14, &data, &half, &with(&["--steps", "5", "--zero", "1"]));
    let out = gpt(2, 15, &data, &half, &["--resume", "--steps", "10", "--zero", "1"]);
    assert!(out.contains("resuming at step 5"), "{out}");
    let e = gpt_max_rel(&half, &zero, 64);
    println!("gpt train --zero 1, 5 + 5 steps (resumed) vs 10 straight on 2 GPUs: max rel {e:e}");
    assert!(e <= 1e-6, "{e:e}");
    // 5 ZeRO steps on 2 GPUs resumed on 1 GPU without ZeRO: the 1-GPU run.
    gpt(2, 16, &data, &to_one, &with(&["--steps", "5", "--zero", "1"]));
    let out = gpt(1, 17, &data, &to_one, &["--resume", "--steps", "10"]);
    assert!(out.contains("resuming at step 5"), "{out}");
    let e = gpt_max_rel(&to_one, &one, 64);
    println!("gpt train, 5 ZeRO-1 steps on 2 GPUs resumed on 1 GPU to step 10, vs 1 GPU throughout: max rel {e:e}");
    assert!(e <= 1e-5, "{e:e}");
}
