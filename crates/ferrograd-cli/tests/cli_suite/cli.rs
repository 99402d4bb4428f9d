//! Runs the `ferrograd` binary as a user would: exit status, what it prints, the JSON it writes.

use crate::common;

use common::{bin, text};
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn ferrograd(args: &[&str]) -> Output {
    Command::new(bin()).args(args).output().expect("failed to start the ferrograd binary")
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
    let json = std::env::temp_dir().join(format!("matmul-{}.json", std::process::id()));
    let _ = std::fs::remove_file(&json);
    let o = ferrograd(&["bench", "matmul", "--device", "cpu", "--sizes", "64,128", "--json", json.to_str().unwrap()]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "status {:?}\nstdout:\n{out}\nstderr:\n{err}", o.status);
    assert!(out.contains("GFLOPS") && out.contains("speedup"), "{out}");
    // Each row of the table starts with the row's name in the JSON.
    for n in ["f32 n=64", "f32 n=128"] {
        assert!(out.lines().any(|l| l.starts_with(&format!("{n} "))), "no row for {n}:\n{out}");
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
    let p = std::env::temp_dir().join(format!("{name}-{}.json", std::process::id()));
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
    for op in [
        "copy",
        "mul_scalar",
        "add",
        "mul",
        "relu",
        "sigmoid",
        "tanh",
        "transpose",
        "softmax",
        "layer_norm",
        "cross_entropy",
        "add_bf16",
        "mul_bf16",
    ] {
        assert!(names.contains(&format!("{op} 64x128")), "{op} missing: {names:?}");
    }
    for op in ["copy", "softmax", "layer_norm", "cross_entropy"] {
        assert!(names.contains(&format!("{op} 32x16")), "{op} missing: {names:?}");
    }
    assert_eq!(names.len(), 17, "{names:?}");
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
fn bench_optim_and_overlap() {
    let (_, v) = bench_json(&["bench", "optim", "--device", "cpu", "--tensors", "5"], "optim");
    assert_eq!(row_names(&v), vec!["adam step, 5 tensors", "adam bandwidth, 5 tensors"]);
    if has_gpu() {
        let (_, v) = bench_json(&["bench", "optim", "--tensors", "100"], "optim-gpu");
        assert_eq!(row_names(&v)[0], "adam step, 100 tensors");
        let (_, v) = bench_json(&["bench", "overlap", "--mib", "16", "--matmul", "1024"], "overlap");
        assert!(row_names(&v).contains(&"overlap efficiency".to_string()));
    } else {
        let o = ferrograd(&["bench", "overlap"]);
        let (_, err) = text(&o);
        assert_eq!(o.status.code(), Some(1), "{err}");
        assert!(err.starts_with("error: ") && err.lines().count() == 1 && !err.contains("panicked"), "{err}");
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
        // The add chain on both devices, and on CUDA where its host time goes (bare launch,
        // Tensor::full).
        let names = row_names(&v);
        assert_eq!(names.len(), 6, "cuda and cpu rows: {v}");
        for want in ["cuda: host time per add", "cuda: host time per bare launch", "cuda: host time per Tensor::full"] {
            assert!(names.iter().any(|n| n.starts_with(want)), "{want}: {v}");
        }
        for r in v["rows"].as_array().unwrap() {
            assert!(r["value"].as_f64().is_some_and(|x| x.is_finite() && x > 0.0), "{r}");
        }
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
    for m in ["copy", "softmax", "layer_norm"] {
        assert!(out.lines().any(|l| l.trim_start().starts_with(m)), "{m} not listed:\n{out}");
    }
    assert!(out.lines().any(|l| l.starts_with("cache: ")), "{out}");
    // The binary ships every module of sm_80 and sm_90, all current (prebuilt.rs says which are
    // not when this fails).
    assert!(out.lines().any(|l| l.starts_with("prebuilt: shipped CUBINs built by NVRTC 13.0 for sm_80")), "{out}");
    for arch in ["sm_80", "sm_90"] {
        let line = out.lines().find(|l| l.trim_start().starts_with(&format!("{arch}: "))).unwrap_or_default();
        let (cur, of) = line.split_once(" of ").unwrap_or_default();
        assert!(cur.ends_with(of.split(' ').next().unwrap_or("?")), "{arch}: {line}\n{out}");
    }
    if !has_gpu() {
        one_line_error(&["kernels", "--precompile"], "pass --arch");
    }
}

#[test]
fn kernels_precompile_for_an_explicit_arch() {
    let dir = std::env::temp_dir().join(format!("kcache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // NVRTC itself, not the CUBINs the binary ships.
    let run = || {
        Command::new(bin())
            .args(["kernels", "--precompile", "--arch", "sm_90"])
            .env("FERROGRAD_CACHE_DIR", &dir)
            .env("FERROGRAD_PREBUILT", "0")
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
    // The read-back asks for exactly the modules compiled: nothing is compiled twice.
    assert!(!out.contains("were not found on disk"), "{out}");
    // On sm_90 the Hopper attention kernels replace four mma.sync modules, and the line says so.
    assert!(out.lines().any(|l| l.starts_with("left out: attention_d64_bf16, attention_d64_f16,")), "{out}");
    #[cfg(target_os = "linux")]
    assert!(out.lines().any(|l| l.starts_with("process CPU time ") && l.contains(" s of NVRTC calls")), "{out}");
    // The second run finds everything on disk.
    let (out2, _) = text(&run());
    assert!(out2.contains(" 0 compiled, 0 failed"), "{out2}");
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---------------------------------------------------------------------------------------------
// demo, --plot, memory
// ---------------------------------------------------------------------------------------------

/// Run the binary, killing it if it is still running after `secs` (a hung --watch fails the test
/// instead of hanging it).
fn ferrograd_within(args: &[&str], envs: &[(&str, &str)], secs: u64) -> Output {
    let mut cmd = Command::new(bin());
    cmd.args(args).env_remove("FERROGRAD_DEVICE").stdout(Stdio::piped()).stderr(Stdio::piped());
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("failed to start the ferrograd binary");
    let deadline = Instant::now() + Duration::from_secs(secs);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            child.kill().unwrap();
            let o = child.wait_with_output().unwrap();
            panic!("{args:?} still running after {secs} s:\n{}", text(&o).0);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}

/// The number just before `unit` on `line` (`... 12.34 GFLOPS ...` -> 12.34).
fn number_before(line: &str, unit: &str) -> f64 {
    let words: Vec<&str> = line.split_whitespace().collect();
    let i = words.iter().position(|w| *w == unit).unwrap_or_else(|| panic!("no {unit} in {line:?}"));
    assert!(i > 0, "{line:?}");
    words[i - 1].parse().unwrap_or_else(|_| panic!("not a number before {unit} in {line:?}"))
}

/// The demo's timed lines (`  <who>  <ms> ms  <GFLOPS> GFLOPS  <how>`), each checked positive.
fn demo_timings(out: &str) -> Vec<(String, f64)> {
    out.lines()
        .filter(|l| l.contains(" GFLOPS "))
        .map(|l| {
            let (ms, gflops) = (number_before(l, "ms"), number_before(l, "GFLOPS"));
            assert!(ms > 0.0 && ms.is_finite() && gflops > 0.0 && gflops.is_finite(), "{l}");
            (l.trim_start().to_string(), gflops)
        })
        .collect()
}

/// The lines every demo prints, whatever the device.
fn check_demo_common(out: &str, device: &str) {
    assert!(out.starts_with(&format!("ferrograd {} demo\n", env!("CARGO_PKG_VERSION"))), "{out}");
    let cuda: Vec<&str> = out.lines().filter(|l| l.starts_with("cuda: ")).collect();
    assert_eq!(cuda.len(), 1, "{out}");
    assert!(cuda[0].starts_with("cuda: found ") || cuda[0].starts_with("cuda: not found ("), "{out}");
    assert!(out.lines().any(|l| l.starts_with(&format!("device: {device}"))), "{out}");
    let zeros = format!("memory: zeros 1000x1000 f32 on {device} (3.81 MiB); sum read back: 0 (ok)");
    assert!(out.lines().any(|l| l == zeros), "no `{zeros}` in\n{out}");
    let mm = format!(
        "matmul 2x2 on {device}: [[1, 2], [3, 4]] x [[5, 6], [7, 8]] = [[19, 22], [43, 50]], expected [[19, 22], \
         [43, 50]] (ok)"
    );
    assert!(out.lines().any(|l| l == mm), "no `{mm}` in\n{out}");
    assert!(out.trim_end().ends_with("demo: all checks passed"), "{out}");
}

#[test]
fn demo_on_the_cpu_prints_checked_and_measured_figures() {
    let o = ferrograd_within(&["demo", "--device", "cpu", "--size", "192"], &[], 120);
    let (out, err) = text(&o);
    assert!(o.status.success(), "status {:?}\nstdout:\n{out}\nstderr:\n{err}", o.status);
    check_demo_common(&out, "cpu");
    assert!(out.contains("matmul 192x192 f32"), "{out}");
    let t = demo_timings(&out);
    assert_eq!(t.len(), 2, "CPU backend and naive loop: {t:?}");
    assert!(t[0].0.starts_with("CPU backend") && t[1].0.starts_with("naive loop"), "{t:?}");
    // The speedup printed is the ratio of the two measured figures, not a constant.
    let line = out.lines().find(|l| l.starts_with("speedup: the CPU backend is ")).expect(&out);
    let x: f64 = line.trim_start_matches("speedup: the CPU backend is ").split('x').next().unwrap().parse().unwrap();
    let want = t[0].1 / t[1].1;
    assert!(x > 0.0 && (x - want).abs() <= 0.051 * want.max(1.0), "{x} vs {want}: {line}");
    assert!(out.contains("no GPU speedup to show"), "{out}");
}

#[test]
fn demo_on_the_best_device_says_what_cuda_offers() {
    let o = ferrograd_within(&["demo", "--size", "128"], &[], 120);
    let (out, err) = text(&o);
    assert!(o.status.success(), "status {:?}\nstdout:\n{out}\nstderr:\n{err}", o.status);
    if has_gpu() {
        check_demo_common(&out, "cuda:0");
        assert!(out.contains("host -> cuda:0 -> host: bit-exact (ok)"), "{out}");
        let t = demo_timings(&out);
        assert_eq!(t.len(), 3, "GPU, CPU backend and naive loop: {t:?}");
        assert!(t[0].0.starts_with("cuda:0 ") && t[0].0.contains("CUDA events"), "{t:?}");
        let line = out.lines().find(|l| l.starts_with("speedup: cuda:0 is ")).expect(&out);
        assert!(line.contains("x the CPU backend and ") && line.ends_with("x the naive loop"), "{line}");
    } else {
        check_demo_common(&out, "cpu");
        assert!(out.contains("cuda: not found (") && out.contains("running the CPU parts only"), "{out}");
        assert!(out.contains("no GPU speedup to show: CUDA was not found ("), "{out}");
        assert_eq!(demo_timings(&out).len(), 2, "{out}");
    }
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn demo_rejects_a_bad_size_in_one_line() {
    one_line_error(&["demo", "--size", "0"], "--size 0: expected 1 to 4096");
    if !has_gpu() {
        one_line_error(&["demo", "--device", "cuda"], "CUDA is not available");
    }
}

/// Check that `path` is a PNG that decodes, and return its dimensions.
fn png_dims(path: &std::path::Path) -> (u32, u32) {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "{}: no PNG signature", path.display());
    let mut reader = png::Decoder::new(std::io::Cursor::new(bytes)).read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).unwrap();
    // A figure is drawn on white: a plot of nothing but the background would be a failure.
    let px = &buf[..info.buffer_size()];
    assert!(px.iter().any(|&b| b < 128), "{}: blank image", path.display());
    (info.width, info.height)
}

/// Run a bench with `--plot` and check the PNG and that the table still printed.
fn bench_plot(args: &[&str], name: &str) {
    let png = std::env::temp_dir().join(format!("{name}-{}.png", std::process::id()));
    let _ = std::fs::remove_file(&png);
    let mut all: Vec<&str> = args.to_vec();
    all.extend(["--plot", png.to_str().unwrap()]);
    let o = ferrograd_within(&all, &[], 300);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{all:?}: status {:?}\nstdout:\n{out}\nstderr:\n{err}", o.status);
    assert!(out.contains(&format!("wrote {}", png.display())), "{out}");
    let (w, h) = png_dims(&png);
    std::fs::remove_file(&png).unwrap();
    assert_eq!(w, 1200, "{all:?}");
    assert!((150..=4000).contains(&h), "{all:?}: height {h}");
}

#[test]
fn every_bench_draws_a_valid_png_with_plot() {
    bench_plot(&["bench", "matmul", "--device", "cpu", "--sizes", "32,64"], "plot-matmul");
    bench_plot(&["bench", "elementwise", "--device", "cpu", "--shapes", "64x128,16x32"], "plot-ew");
    bench_plot(&["bench", "launch", "--device", "cpu", "--ops", "200", "--repeats", "2"], "plot-launch");
    if has_gpu() {
        bench_plot(&["bench", "matmul", "--device", "cuda", "--dtype", "f32,bf16", "--sizes", "64,256"], "plot-cm");
        bench_plot(&["bench", "elementwise", "--device", "cuda", "--shapes", "256x512"], "plot-cew");
        bench_plot(&["bench", "launch", "--device", "cuda", "--ops", "300", "--repeats", "2"], "plot-cl");
        bench_plot(&["bench", "transfer", "--mib", "8", "--count", "10", "--kib", "4"], "plot-transfer");
        bench_plot(&["bench", "alloc", "--mib", "8"], "plot-alloc");
    } else {
        // The GPU-only benches refuse before drawing (or creating) anything.
        let never = std::env::temp_dir().join(format!("never-{}.png", std::process::id()));
        for b in ["transfer", "alloc"] {
            one_line_error(&["bench", b, "--plot", never.to_str().unwrap()], "needs a CUDA device");
            assert!(!never.exists(), "{b} created {} before refusing", never.display());
        }
    }
}

#[test]
fn plot_to_an_unwritable_path_fails_before_benchmarking() {
    one_line_error(
        &["bench", "matmul", "--device", "cpu", "--sizes", "8", "--plot", "/nonexistent-dir/x.png"],
        "--plot /nonexistent-dir/x.png: directory /nonexistent-dir does not exist",
    );
}

#[test]
fn memory_reports_devices_or_one_line_without_a_gpu() {
    let o = ferrograd_within(&["memory"], &[], 60);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(0), "no GPU is not an error\nstdout:\n{out}\nstderr:\n{err}");
    if has_gpu() {
        assert!(out.lines().next().is_some_and(|l| l.starts_with("cuda:0  ")), "{out}");
        for what in ["  driver ", "% utilization", "  allocator  allocated ", "active blocks ", "OOMs "] {
            assert!(out.contains(what), "{what:?} missing:\n{out}");
        }
    } else {
        assert_eq!(out.lines().count(), 1, "{out}");
        assert!(out.starts_with("memory: no usable CUDA device (") && out.contains("not an error"), "{out}");
        assert!(err.is_empty(), "{err}");
    }
}

#[test]
fn memory_watch_stops_after_the_given_refreshes() {
    let t0 = Instant::now();
    let o = ferrograd_within(&["memory", "--watch", "--iterations", "2"], &[], 60);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(0), "stdout:\n{out}\nstderr:\n{err}");
    if has_gpu() {
        let refreshes = out.lines().filter(|l| l.starts_with("ferrograd memory --watch: refresh ")).count();
        assert_eq!(refreshes, 2, "{out}");
        // One second between the two refreshes.
        assert!(t0.elapsed() >= Duration::from_millis(900), "{:?}", t0.elapsed());
    } else {
        assert!(out.starts_with("memory: no usable CUDA device ("), "{out}");
    }
    // --iterations belongs to --watch.
    let o = ferrograd(&["memory", "--iterations", "2"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o).1);
}

#[test]
fn out_of_memory_shows_the_figures_and_what_to_try() {
    if !has_gpu() {
        println!("no CUDA device: the OOM report is covered by the unit tests in memory.rs");
        return;
    }
    // A 64 MiB cap cannot hold three 4096x4096 f32 matrices (64 MiB each).
    let o = ferrograd_within(
        &["bench", "matmul", "--device", "cuda", "--dtype", "f32", "--sizes", "4096"],
        &[("FERROGRAD_CUDA_MEMORY_LIMIT", "64MiB")],
        120,
    );
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "stdout:\n{out}\nstderr:\n{err}");
    assert!(err.starts_with("error: ") && err.contains("out of memory"), "{err}");
    assert!(err.contains("memory now") && err.contains("cuda:0  ") && err.contains("OOMs "), "{err}");
    assert!(err.contains("64.00 MiB for ferrograd (FERROGRAD_CUDA_MEMORY_LIMIT"), "{err}");
    assert!(err.contains("next: try smaller matrices (--sizes)"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn monster_walk_names_a_bad_precision_or_step() {
    let o = ferrograd(&["monster-walk", "--device", "cpu", "--copies", "1", "--epochs", "1", "--precision", "f16"]);
    let (out, err) = text(&o);
    assert!(!o.status.success(), "{out}");
    assert!(err.contains("--precision") && err.contains("f16"), "{err}");
    let o = ferrograd(&["monster-walk", "--step", "fast"]);
    let (_, err) = text(&o);
    assert!(!o.status.success() && err.contains("persistent"), "{err}");
    let o = ferrograd(&["monster-walk", "--step", "fused", "--unfused"]);
    assert!(!o.status.success());
}

#[test]
fn profile_is_a_flag_of_every_command() {
    // Before or after the subcommand (a global flag); on the CPU it changes nothing.
    for args in [&["--profile", "info"][..], &["info", "--profile"], &["gpt", "sample", "--help", "--profile"]] {
        let o = ferrograd(args);
        let (out, err) = text(&o);
        assert!(o.status.success(), "{args:?}: status {:?}\nstdout:\n{out}\nstderr:\n{err}", o.status);
    }
    let (help, _) = text(&ferrograd(&["gpt", "train", "--help"]));
    assert!(help.contains("--profile"), "{help}");
}
