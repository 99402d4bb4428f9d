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
    assert_eq!(v["schema"], "ferrograd-bench/1");
    assert_eq!(row_names(&v), vec!["f32 n=64", "f32 n=128"]);
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

/// Whether `ferrograd info` lists a CUDA device: the GPU-only benches then run for real (small
/// sizes) instead of being checked for their one-line refusal.
fn has_gpu() -> bool {
    let o = Command::new(bin()).arg("info").env_remove("FERROGRAD_DEVICE").output().unwrap();
    text(&o).0.lines().any(|l| l.starts_with("cuda: ") && l.contains("device(s)"))
}

fn json_path(name: &str) -> PathBuf {
    let p = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}-{}.json", std::process::id()));
    let _ = std::fs::remove_file(&p);
    p
}

/// Run a bench that must succeed and return its JSON, checked against the shared schema
/// (`ferrograd-bench/1`): every row named, positive and finite, with a unit and a direction.
fn bench_json(args: &[&str], name: &str) -> (String, serde_json::Value) {
    let json = json_path(name);
    let mut all: Vec<&str> = args.to_vec();
    all.extend(["--json", json.to_str().unwrap()]);
    let o = ferrograd(&all);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{all:?}: status {:?}\nstdout:\n{out}\nstderr:\n{err}", o.status);
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    std::fs::remove_file(&json).unwrap();
    assert_eq!(v["schema"], "ferrograd-bench/1", "{v}");
    assert_eq!(v["bench"], args[1], "{v}");
    assert_eq!(v["impl"], "ferrograd", "{v}");
    assert!(v["device_name"].as_str().is_some_and(|s| !s.is_empty()), "{v}");
    let rows = v["rows"].as_array().unwrap();
    assert!(!rows.is_empty(), "{v}");
    for r in rows {
        let name = r["name"].as_str().unwrap();
        let x = r["value"].as_f64().unwrap();
        assert!(x > 0.0 && x.is_finite(), "{name} = {x}");
        assert!(r["unit"].as_str().is_some_and(|u| !u.is_empty()), "{r}");
        assert!(r["higher_is_better"].is_boolean(), "{r}");
        assert!(out.contains(name), "row {name} not in the table:\n{out}");
    }
    (out, v)
}

fn row_names(v: &serde_json::Value) -> Vec<String> {
    v["rows"].as_array().unwrap().iter().map(|r| r["name"].as_str().unwrap().to_string()).collect()
}

/// A command that needs what this machine lacks: exit status 1 and one `error: ` line.
fn one_line_error(args: &[&str], expect: &str) {
    let o = ferrograd(args);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{args:?}\nstdout:\n{out}\nstderr:\n{err}");
    assert!(err.starts_with("error: ") && err.contains(expect), "{args:?}: {err}");
    assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn bench_launch_cpu_reports_time_per_op() {
    let (_, v) = bench_json(&["bench", "launch", "--device", "cpu", "--ops", "500", "--repeats", "3"], "launch");
    assert_eq!(v["device"], "cpu");
    assert_eq!(row_names(&v), vec!["cpu: time per add", "cpu: adds per second"]);
    let rows = v["rows"].as_array().unwrap();
    // ops/s and µs/op describe the same chains: their product is about 1e6 (enqueue = total on the CPU).
    let (us, ops) = (rows[0]["value"].as_f64().unwrap(), rows[1]["value"].as_f64().unwrap());
    assert!((us * ops / 1e6 - 1.0).abs() < 0.5, "{us} µs/op, {ops} ops/s");
}

#[test]
fn bench_elementwise_cpu_small_shapes() {
    let (out, v) = bench_json(&["bench", "elementwise", "--device", "cpu", "--shapes", "64x128,32x16"], "ew");
    assert!(out.contains("% of copy"), "{out}");
    let names = row_names(&v);
    for op in ["copy", "mul_scalar", "add", "mul", "relu", "sigmoid", "softmax", "layer_norm"] {
        assert!(names.contains(&format!("{op} 64x128")), "{op} missing: {names:?}");
    }
    for op in ["copy", "softmax", "layer_norm"] {
        assert!(names.contains(&format!("{op} 32x16")), "{op} missing: {names:?}");
    }
    assert_eq!(names.len(), 11, "{names:?}");
    for r in v["rows"].as_array().unwrap() {
        assert_eq!(r["unit"], "GB/s");
        assert!(r["pct_of_copy"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["median_s"].as_f64().unwrap() > 0.0, "{r}");
    }
}

#[test]
fn bench_elementwise_rejects_bad_shapes() {
    for shape in ["64", "0x4", "ax4"] {
        let o = ferrograd(&["bench", "elementwise", "--device", "cpu", "--shapes", shape]);
        let (_, err) = text(&o);
        assert_eq!(o.status.code(), Some(2), "{shape}: {err}");
        assert!(err.contains("ROWSxCOLS") || err.contains("at least 1"), "{shape}: {err}");
    }
}

#[test]
fn gpu_only_benches_refuse_the_cpu() {
    for b in ["transfer", "alloc"] {
        one_line_error(&["bench", b, "--device", "cpu"], &format!("bench {b} measures a CUDA device"));
    }
}

#[test]
fn bench_transfer_and_alloc_need_a_gpu() {
    if has_gpu() {
        let (_, v) = bench_json(&["bench", "transfer", "--mib", "8", "--count", "10", "--kib", "4"], "transfer");
        let names = row_names(&v);
        for n in ["h2d pageable 8 MiB", "h2d pinned 8 MiB", "d2h pageable 8 MiB", "10 x 4 KiB h2d: one coalesced copy"]
        {
            assert!(names.iter().any(|x| x == n), "{n} missing: {names:?}");
        }
        let (_, v) = bench_json(&["bench", "alloc", "--mib", "8"], "alloc");
        assert_eq!(row_names(&v), vec!["cached allocate+free 8 MiB", "raw driver allocate+free 8 MiB"]);
    } else {
        println!("no CUDA device: checking the one-line refusals");
        one_line_error(&["bench", "transfer"], "bench transfer needs a CUDA device");
        one_line_error(&["bench", "alloc"], "bench alloc needs a CUDA device");
    }
}

#[test]
fn cuda_matmul_elementwise_and_launch_run_or_refuse() {
    if has_gpu() {
        let (_, v) = bench_json(
            &["bench", "matmul", "--device", "cuda", "--dtype", "f32,bf16", "--sizes", "64,256"],
            "cuda-matmul",
        );
        assert_eq!(row_names(&v), vec!["f32 n=64", "f32 n=256", "bf16 n=64", "bf16 n=256"]);
        for r in v["rows"].as_array().unwrap() {
            assert_eq!(r["unit"], "TFLOP/s");
            assert!(r["rel_err"].as_f64().unwrap() < 1e-2, "{r}");
        }
        bench_json(&["bench", "elementwise", "--device", "cuda", "--shapes", "256x512"], "cuda-ew");
        let (_, v) =
            bench_json(&["bench", "launch", "--device", "cuda", "--ops", "300", "--repeats", "2"], "cuda-launch");
        assert_eq!(row_names(&v).len(), 4, "cuda and cpu rows: {v}");
    } else {
        one_line_error(&["bench", "matmul", "--device", "cuda", "--sizes", "64"], "CUDA is not available");
        one_line_error(&["bench", "elementwise"], "use --device cpu");
        one_line_error(&["bench", "launch"], "use --device cpu");
    }
}

#[test]
fn kernels_lists_modules_and_precompile_needs_a_gpu_or_arch() {
    let o = ferrograd(&["kernels"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    for m in ["copy", "softmax", "layernorm"] {
        assert!(out.lines().any(|l| l.trim_start().starts_with(m)), "{m} not listed:\n{out}");
    }
    assert!(out.lines().any(|l| l.starts_with("cache: ")), "{out}");
    if !has_gpu() {
        one_line_error(&["kernels", "--precompile"], "pass --arch");
    }
}

#[test]
fn kernels_precompile_for_an_explicit_arch() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("kcache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let run = || {
        Command::new(bin())
            .args(["kernels", "--precompile", "--arch", "sm_90"])
            .env("FERROGRAD_CACHE_DIR", &dir)
            .output()
            .unwrap()
    };
    let o = run();
    let (out, err) = text(&o);
    if !o.status.success() {
        // No NVRTC on this machine: one clear line, no panic.
        assert_eq!(o.status.code(), Some(1), "{out}\n{err}");
        assert!(err.starts_with("error: cannot precompile") && err.contains("nvrtc"), "{err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        println!("skipping the compile itself: {err}");
        return;
    }
    assert!(out.contains("kernels for sm_90"), "{out}");
    assert!(out.contains("compiled") && out.contains("0 failed"), "{out}");
    assert!(out.lines().any(|l| l.starts_with("next start: ") && l.contains("from the disk cache")), "{out}");
    // The second run finds everything on disk.
    let (out2, _) = text(&run());
    assert!(out2.contains(" 0 compiled, 0 failed"), "{out2}");
    std::fs::remove_dir_all(&dir).unwrap();
}
