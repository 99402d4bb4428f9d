//! Every command of issue 11, run as a user would: each gives one clear error line and exit 1 (or
//! clap's line and exit 2 for a malformed flag), or runs correctly. None may panic (exit 101),
//! abort (134), be killed (137) or hang; files are written whole or not at all.

use crate::common;

use common::bin;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn run_env(args: &[&str], envs: &[(&str, &str)]) -> Output {
    let mut c = Command::new(bin());
    c.args(args).env_remove("FERROGRAD_DEVICE");
    for (k, v) in envs {
        c.env(k, v);
    }
    c.output().expect("start ferrograd")
}

fn dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("fg-cli-robust-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// One `error: ...` line on stderr containing `expect`, exit `code`, no panic.
fn fails(args: &[&str], envs: &[(&str, &str)], code: i32, expect: &str) -> String {
    let o = run_env(args, envs);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(code), "{args:?}\nstderr:\n{err}");
    assert!(err.starts_with("error: ") && err.contains(expect), "{args:?}: expected {expect:?} in:\n{err}");
    if code == 1 {
        assert_eq!(err.lines().count(), 1, "{args:?}: one line:\n{err}");
    }
    assert!(!err.contains("panicked"), "{err}");
    err
}

#[test]
fn sizes_that_overflowed_are_typed_errors() {
    // Issue 11: exit 101, "capacity overflow".
    fails(
        &["monster-walk", "--device", "cpu", "--copies", "18446744073709551615", "--epochs", "1"],
        &[],
        1,
        "far too large",
    );
    fails(
        &["bench", "launch", "--device", "cpu", "--elems", "18446744073709551615", "--ops", "1"],
        &[],
        1,
        "too large",
    );
    fails(&["bench", "elementwise", "--device", "cpu", "--shapes", "3x6148914691236517206"], &[], 1, "too large");
}

#[test]
fn plans_larger_than_the_host_are_refused_with_figures() {
    // Issue 11: SIGABRT (134) or the OOM killer (137). A 4 GiB cap makes this deterministic on
    // any machine (FERROGRAD_HOST_MEMORY_LIMIT lowers the figure the host reports).
    let cap = [("FERROGRAD_HOST_MEMORY_LIMIT", "4GiB")];
    for args in [
        &["monster-walk", "--device", "cpu", "--copies", "1000"][..],
        &["monster-walk", "--device", "cpu", "--budget", "1000TB"][..],
        &["bench", "elementwise", "--device", "cpu", "--shapes", "100000x100000"][..],
        &["bench", "optim", "--device", "cpu", "--tensors", "1000000"][..],
    ] {
        let e = fails(args, &cap, 1, "host out of memory");
        assert!(e.contains("available") && e.contains("try "), "{e}");
    }
    // Without the cap, against the machine's own figure.
    fails(&["monster-walk", "--device", "cpu", "--copies", "1000000"], &[], 1, "host out of memory");
}

#[test]
fn negative_numbers_and_bad_devices_are_named() {
    fails(&["monster-walk", "--copies", "-1"], &[], 2, "'-1' for '--copies <COPIES>': must not be negative");
    fails(&["bench", "launch", "--elems", "-5"], &[], 2, "must not be negative");
    fails(&["monster-walk", "--device", "cpu", "--lr", "-1"], &[], 1, "--lr -1 must be a positive number");
    for cmd in [&["demo"][..], &["monster-walk"][..]] {
        fails(cmd, &[("FERROGRAD_DEVICE", "tpu")], 1, "FERROGRAD_DEVICE=tpu");
    }
    fails(
        &["monster-walk", "--device", "cpu", "--batch", "99999999"],
        &[],
        1,
        "--batch 99999999 must be between 1 and 5041",
    );
}

#[test]
fn non_finite_and_odd_init_files() {
    let d = dir("init");
    let good = d.join("good.safetensors");
    let o = run_env(&["monster-walk", "--device", "cpu", "--copies", "1", "--epochs", "1", "--save", s(&good)], &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // NaN in 0.weight: refused; with --allow-nonfinite, the first step's loss is NaN and the run
    // stops there, saving nothing (issue 11: exit 0 and NaN weights saved).
    let bytes = std::fs::read(&good).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let start = header["0.weight"]["data_offsets"][0].as_u64().unwrap() as usize + 8 + n;
    let mut nan = bytes.clone();
    nan[start + 12..start + 16].copy_from_slice(&f32::NAN.to_le_bytes());
    let bad = d.join("nan.safetensors");
    std::fs::write(&bad, &nan).unwrap();
    let out = d.join("out.safetensors");
    let base = ["monster-walk", "--device", "cpu", "--copies", "1", "--epochs", "1", "--init", s(&bad)];
    let e = fails(&[&base[..], &["--save", s(&out)]].concat(), &[], 1, "tensor 0.weight: element 3 is NaN");
    assert!(e.contains("--allow-nonfinite"), "{e}");
    fails(&[&base[..], &["--allow-nonfinite", "--save", s(&out)]].concat(), &[], 1, "loss is NaN at step 1 (epoch 1)");
    assert!(!out.exists(), "a stopped run saves nothing");
    // A FIFO hung; a directory, a missing file and a 4 GiB file are named at once.
    #[cfg(unix)]
    {
        let fifo = d.join("fifo.safetensors");
        if Command::new("mkfifo").arg(&fifo).status().is_ok_and(|st| st.success()) {
            fails(&["monster-walk", "--device", "cpu", "--init", s(&fifo)], &[], 1, "not a regular file");
        }
    }
    fails(&["monster-walk", "--device", "cpu", "--init", s(&d)], &[], 1, "is a directory");
    fails(&["monster-walk", "--device", "cpu", "--init", s(&d.join("nope"))], &[], 1, "no such file");
    let huge = d.join("huge.safetensors");
    std::fs::copy(&good, &huge).unwrap();
    std::fs::OpenOptions::new().write(true).open(&huge).unwrap().set_len(4 << 30).unwrap();
    fails(&["monster-walk", "--device", "cpu", "--init", s(&huge)], &[], 1, "data section");
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn outputs_are_checked_first_and_written_atomically() {
    let d = dir("out");
    let prev = d.join("prev.json");
    std::fs::write(&prev, b"{\"previous\": true}\n").unwrap();
    // Issue 11: a bad --report was found after training; --save X --report X overwrote the
    // weights; bench overlap truncated prev.json before failing for lack of CUDA.
    fails(&["monster-walk", "--device", "cpu", "--report", "/nonexistent/dir/r.json"], &[], 1, "does not exist");
    let x = d.join("x.out");
    fails(
        &["monster-walk", "--device", "cpu", "--save", s(&x), "--report", s(&x)],
        &[],
        1,
        "--save and --report name the same file",
    );
    let dotted = format!("{}/./x.out", s(&d));
    fails(&["monster-walk", "--device", "cpu", "--save", &dotted, "--report", s(&x)], &[], 1, "same file");
    fails(&["bench", "launch", "--device", "cpu", "--json", s(&prev), "--plot", s(&prev)], &[], 1, "same file");
    let o = run_env(&["bench", "overlap", "--device", "cuda:99", "--json", s(&prev)], &[]);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(std::fs::read(&prev).unwrap(), b"{\"previous\": true}\n", "a failed bench leaves the file as it was");
    // A successful run replaces the file whole and leaves no temporary behind.
    let o = run_env(
        &["bench", "launch", "--device", "cpu", "--ops", "20", "--elems", "64", "--repeats", "1", "--json", s(&prev)],
        &[],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&prev).unwrap()).unwrap();
    assert_eq!(v["bench"], "launch");
    let names: Vec<String> =
        std::fs::read_dir(&d).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert_eq!(names, vec!["prev.json"], "no temporary files left");
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn the_cpu_plan_is_announced_truthfully() {
    // Issue 11: with --budget the CPU run announced "4 copies x 20 epochs" and trained 16.
    let o =
        run_env(&["monster-walk", "--device", "cpu", "--budget", "600MiB", "--epochs", "1", "--batch", "5041"], &[]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // (600 MiB - 256 MiB of working space) / 102.7 MiB = 3 copies.
    assert!(out.contains("training 3 copies x 1 epoch in batches of 5041 (3 Adam steps)"), "{out}");
    assert!(out.contains("3 x 1 = 3 steps of 5041 samples"), "{out}");
    assert!(!out.contains("no GPU: the CPU default"), "{out}");
}
