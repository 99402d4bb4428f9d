//! `ferrograd gpt` as a user runs it, on the CPU: prepare (and its errors), a tiny training run and
//! its files, resuming it, sampling and logits from what it wrote.

use crate::common;

use common::{bin, text};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn ferrograd(args: &[&str]) -> Output {
    Command::new(bin()).args(args).env_remove("FERROGRAD_DEVICE").output().expect("failed to start ferrograd")
}

fn ok(o: &Output) -> String {
    let (out, err) = text(o);
    assert!(o.status.success(), "status {:?}\nstdout:\n{out}\nstderr:\n{err}", o.status);
    assert!(!err.contains("panicked"), "{err}");
    out
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn corpus(dir: &Path) -> PathBuf {
    let words = ["to", "be", "or", "not", "that", "is", "the", "question", "whether", "tis", "nobler"];
    let mut t = String::new();
    for i in 0..3000usize {
        t.push_str(words[(i * 7 + i / 5) % words.len()]);
        t.push(if i % 13 == 12 { '\n' } else { ' ' });
    }
    let p = dir.join("hamlet.txt");
    std::fs::write(&p, t).unwrap();
    p
}

#[test]
fn prepare_names_the_bad_file_and_says_why() {
    let dir = tempfile::tempdir().unwrap();
    let good = corpus(dir.path());
    let out = dir.path().join("shards");
    let bin_file = dir.path().join("model.bin");
    std::fs::write(&bin_file, [0x7fu8, b'E', b'L', b'F', 0, 1, 2]).unwrap();
    let empty = dir.path().join("empty.txt");
    std::fs::write(&empty, "").unwrap();
    let missing = dir.path().join("nope.txt");
    for (bad, why) in [(&bin_file, "binary"), (&empty, "empty"), (&missing, "cannot read")] {
        let o = ferrograd(&["gpt", "prepare", s(&good), s(bad), "--out", s(&out)]);
        let (_, err) = text(&o);
        assert_eq!(o.status.code(), Some(1), "{err}");
        assert!(err.starts_with("error: ") && err.contains(s(bad)) && err.contains(why), "{why}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    assert!(!out.exists());
}

#[test]
fn train_refuses_bad_settings_with_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    ok(&ferrograd(&["gpt", "prepare", s(&corpus(dir.path())), "--out", s(&data)]));
    let run = |extra: &[&str]| {
        let mut a = vec!["gpt", "train", "--data", s(&data), "--out", s(dir.path()), "--device", "cpu"];
        a.extend(extra);
        let o = ferrograd(&a);
        let (_, err) = text(&o);
        assert_eq!(o.status.code(), Some(1), "{extra:?}: {err}");
        assert!(err.starts_with("error: ") && !err.contains("panicked"), "{err}");
        err
    };
    assert!(run(&["--batch", "auto"]).contains("measures GPU memory"));
    assert!(run(&["--heads", "3"]).contains("multiple of heads"));
    assert!(run(&["--batch", "4", "--total-batch", "1000"]).contains("not a multiple"));
    assert!(run(&["--resume"]).contains("no checkpoint"));
    let none = dir.path().join("none");
    let o = ferrograd(&["gpt", "train", "--data", s(&none), "--device", "cpu", "--out", s(dir.path())]);
    assert!(text(&o).1.contains("gpt prepare") || text(&o).1.contains("listing"), "{}", text(&o).1);
}

#[test]
fn prepare_train_resume_sample_and_logits_on_the_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let run = dir.path().join("run");
    let out = ok(&ferrograd(&["gpt", "prepare", s(&corpus(dir.path())), "--out", s(&data)]));
    assert!(out.contains("train:") && out.contains("val:"), "{out}");
    assert!(data.join("train_000000.bin").is_file() && data.join("val_000000.bin").is_file());

    let shape = ["--layers", "1", "--heads", "2", "--dim", "16", "--context", "16", "--batch", "2"];
    let mut args = vec!["gpt", "train", "--data", s(&data), "--out", s(&run), "--device", "cpu", "--steps", "3"];
    args.extend(shape);
    args.extend(["--log-every", "1", "--val-batches", "2", "--progress", "lines"]);
    let out = ok(&ferrograd(&args));
    assert!(out.contains("step 3/3 | loss") && out.contains("val loss") && out.contains("done: 3 steps"), "{out}");
    for f in [
        "checkpoint.safetensors",
        "log.jsonl",
        "summary.json",
        "loss.png",
        "model/config.json",
        "model/model.safetensors",
    ] {
        assert!(run.join(f).is_file(), "{f} missing:\n{out}");
    }
    let png = std::fs::read(run.join("loss.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");

    // Resume: the checkpoint's settings are the defaults; --steps extends the run.
    let out = ok(&ferrograd(&[
        "gpt",
        "train",
        "--data",
        s(&data),
        "--out",
        s(&run),
        "--resume",
        "--steps",
        "5",
        "--progress",
        "lines",
        "--log-every",
        "1",
        "--device",
        "cpu",
    ]));
    assert!(out.contains("resuming at step 3") && out.contains("step 5/5 | loss"), "{out}");
    let log = std::fs::read_to_string(run.join("log.jsonl")).unwrap();
    let steps: Vec<u64> = log
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["kind"] == "train")
        .map(|v| v["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, [1, 2, 3, 4, 5]);
    // A resumed run that would change the model is refused.
    let o = ferrograd(&["gpt", "train", "--data", s(&data), "--out", s(&run), "--resume", "--layers", "2"]);
    assert_eq!(o.status.code(), Some(1));

    // Greedy sampling is deterministic, from the checkpoint file or the exported directory.
    let sample = |ck: &Path, seed: &str| {
        ok(&ferrograd(&[
            "gpt",
            "sample",
            "--checkpoint",
            s(ck),
            "--prompt",
            "to be or",
            "--tokens",
            "6",
            "--top-k",
            "1",
            "--seed",
            seed,
            "--device",
            "cpu",
        ]))
    };
    let a = sample(&run.join("checkpoint.safetensors"), "1");
    assert!(a.starts_with("to be or"), "{a}");
    assert_eq!(a, sample(&run.join("model"), "2"));

    let logits = dir.path().join("logits.safetensors");
    ok(&ferrograd(&[
        "gpt",
        "logits",
        "--checkpoint",
        s(&run.join("model")),
        "--prompt",
        "that is",
        "--out",
        s(&logits),
        "--device",
        "cpu",
    ]));
    let bytes = std::fs::read(&logits).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.tensor("logits").unwrap().shape()[1], 50257);
}
