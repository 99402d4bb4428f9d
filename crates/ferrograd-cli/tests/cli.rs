//! Runs the `ferrograd` binary as a user would: exit status, what it prints, the JSON it writes.

use std::path::PathBuf;
use std::process::{Command, Output};

/// The binary under test: cargo's build path, or (when the test binary was carried to a GPU
/// machine by ../shared/gpu/bundle) the bundled copy in .gpu/bin, or $FERROGRAD_BIN.
fn bin() -> PathBuf {
    if let Some(p) = std::env::var_os("FERROGRAD_BIN") {
        return p.into();
    }
    let built = PathBuf::from(env!("CARGO_BIN_EXE_ferrograd"));
    if built.exists() {
        return built;
    }
    PathBuf::from(".gpu/bin/ferrograd")
}

fn ferrograd(args: &[&str]) -> Output {
    Command::new(bin()).args(args).output().expect("failed to start the ferrograd binary")
}

fn text(o: &Output) -> (String, String) {
    (String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned())
}

#[test]
fn info_prints_version_device_and_cuda_line() {
    let o = Command::new(bin()).arg("info").env_remove("FERROGRAD_DEVICE").output().unwrap();
    let (out, err) = text(&o);
    assert!(o.status.success(), "status {:?}\nstdout:\n{out}\nstderr:\n{err}", o.status);
    assert!(out.starts_with(&format!("ferrograd {}", env!("CARGO_PKG_VERSION"))), "{out}");
    assert!(out.lines().any(|l| l.starts_with("device: ")), "{out}");
    assert!(out.lines().any(|l| l.starts_with("cpu: ") && l.contains("rayon threads")), "{out}");
    // Either a device list or one line saying it runs on the CPU.
    let cuda: Vec<&str> = out.lines().filter(|l| l.starts_with("cuda: ")).collect();
    assert_eq!(cuda.len(), 1, "{out}");
    assert!(cuda[0].contains("device(s)") || cuda[0].contains("runs on the CPU"), "{out}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn bench_matmul_cpu_writes_positive_figures() {
    let json = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("matmul-{}.json", std::process::id()));
    let _ = std::fs::remove_file(&json);
    let o = ferrograd(&["bench", "matmul", "--device", "cpu", "--sizes", "64,128", "--json", json.to_str().unwrap()]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "status {:?}\nstdout:\n{out}\nstderr:\n{err}", o.status);
    assert!(out.contains("GFLOPS") && out.contains("speedup"), "{out}");
    for n in ["64", "128"] {
        assert!(out.lines().any(|l| l.trim_start().starts_with(&format!("{n} |"))), "no row for {n}:\n{out}");
    }

    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    std::fs::remove_file(&json).unwrap();
    assert_eq!(v["bench"], "matmul");
    assert_eq!(v["device"], "cpu");
    let results = v["results"].as_array().unwrap();
    assert_eq!(results.iter().map(|r| r["n"].as_u64().unwrap()).collect::<Vec<_>>(), vec![64, 128]);
    for r in results {
        for side in ["naive", "ferrograd"] {
            for key in ["median_s", "min_s", "gflops"] {
                let x = r[side][key].as_f64().unwrap();
                assert!(x > 0.0 && x.is_finite(), "{side}.{key} = {x} in {r}");
            }
            assert!(r[side]["reps"].as_u64().unwrap() >= 3, "{r}");
        }
        assert!(r["speedup"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["max_rel_diff"].as_f64().unwrap() < 1e-4, "{r}");
    }
}

#[test]
fn bad_flag_is_one_error_line_not_a_panic() {
    for args in [
        &["bench", "matmul", "--no-such-flag"][..],
        &["bench", "matmul", "--device", "tpu"],
        &["bench", "matmul", "--sizes", "0"],
        &["bench", "matmul", "--sizes", "abc"],
        &["frobnicate"],
    ] {
        let o = ferrograd(args);
        let (out, err) = text(&o);
        assert!(!o.status.success(), "{args:?} succeeded:\n{out}");
        assert!(err.lines().any(|l| l.starts_with("error: ")), "{args:?}: no error line in\n{err}");
        assert!(!err.contains("panicked") && !err.contains("RUST_BACKTRACE"), "{args:?}:\n{err}");
    }
}

#[test]
fn cuda_matmul_bench_says_it_is_not_available() {
    let o = ferrograd(&["bench", "matmul", "--device", "cuda", "--sizes", "64"]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.starts_with("error: CUDA matmul benchmark not available in this build"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
}
