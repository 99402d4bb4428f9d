//! What the CLI's integration tests share (`tests/cli_suite/main.rs` includes it): where
//! the `ferrograd` binary under test is, and its output as text.
#![allow(dead_code)] // each test crate uses a different part

pub mod gpt_run;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The binary under test: $FERROGRAD_BIN, else cargo's build path, else (when the test binary was
/// carried to a GPU machine by ../shared/gpu/bundle) the bundled copy in .gpu/bin.
pub fn bin() -> PathBuf {
    if let Some(p) = std::env::var_os("FERROGRAD_BIN") {
        return p.into();
    }
    let built = PathBuf::from(env!("CARGO_BIN_EXE_ferrograd"));
    if built.exists() {
        return built;
    }
    PathBuf::from(".gpu/bin/ferrograd")
}

/// (stdout, stderr) of a finished run, lossily decoded.
pub fn text(o: &Output) -> (String, String) {
    (String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned())
}

// ---- the 2-GPU tests (dist_gpu.rs, pipeline_gpu.rs) ----------------------------------------------

/// Whether the machine can run a 2-GPU test (two CUDA devices and NCCL); prints the one-line
/// reason when not.
pub fn two_gpus(test: &str) -> bool {
    let n = ferrograd_core::cuda::device_count().unwrap_or(0);
    if n < 2 {
        println!("skipped {test}: {n} CUDA device(s) visible, 2 needed");
        return false;
    }
    if let Err(e) = ferrograd_dist::nccl::nccl() {
        println!("skipped {test}: {e}");
        return false;
    }
    true
}

/// A rendezvous port for test `k` of a binary whose ports start at `base` (tests of one binary run
/// one at a time on the GPU machine; dist_gpu uses 20000, pipeline_gpu 21000).
pub fn port(base: u16, k: u16) -> String {
    (base + (std::process::id() % 20000) as u16 + 7 * k).to_string()
}

/// Run the binary under test with `args` and extra environment (NVLink multicast off, as KINDS.md
/// asks).
pub fn ferrograd(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(bin());
    c.args(args).env("NCCL_NVLS_ENABLE", "0");
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("failed to start ferrograd")
}

/// The stdout of a run that must have succeeded (else a panic showing both streams).
pub fn ok(o: &Output) -> String {
    let (out, err) = text(o);
    assert!(o.status.success(), "status {:?}\nstdout:\n{out}\nstderr:\n{err}", o.status);
    out
}

/// A path in the temp dir unique to this process: `ferrograd-PREFIX-PID-NAME`.
pub fn tmp(prefix: &str, name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("ferrograd-{prefix}-{}-{name}", std::process::id()))
}

/// The f32 tensors of a safetensors file, by name.
pub fn weights(path: &Path) -> HashMap<String, Vec<f32>> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, v)| (n, v.data().chunks(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()))
        .collect()
}

/// Largest over the tensors of two weight files (the same names) of max|a - b| / max|b|.
pub fn max_rel(a: &Path, b: &Path) -> f64 {
    let (a, b) = (weights(a), weights(b));
    assert_eq!(a.len(), b.len());
    let mut worst = 0.0f64;
    for (name, x) in &a {
        let y = &b[name];
        let diff = x.iter().zip(y).map(|(p, q)| (p - q).abs() as f64).fold(0.0, f64::max);
        let scale = y.iter().map(|q| q.abs() as f64).fold(1e-30, f64::max);
        worst = worst.max(diff / scale);
    }
    worst
}
