//! `ferrograd gpt quantize / eval / sample --int8` as a user runs them, on the CPU: the sizes it
//! reports, the four evaluation rows, sampling from an int8 file and quantizing on load, and the
//! one-line errors for bad arguments.

use crate::common;

use common::{bin, text};
use ferrograd_core::Device;
use ferrograd_models::gpt::shards::write_shard;
use ferrograd_models::gpt::{Gpt, GptConfig};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn ferrograd(args: &[&str]) -> Output {
    Command::new(bin()).args(args).env_remove("FERROGRAD_DEVICE").output().expect("failed to start ferrograd")
}

fn ok(o: &Output) -> (String, String) {
    let (out, err) = text(o);
    assert!(o.status.success(), "status {:?}\nstdout:\n{out}\nstderr:\n{err}", o.status);
    assert!(!err.contains("panicked"), "{err}");
    (out, err)
}

/// Exit 1 with one `error: ` line holding every `needle`.
fn fails_with(o: &Output, needles: &[&str]) {
    let (_, err) = text(o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.starts_with("error: ") && !err.contains("panicked"), "{err}");
    for n in needles {
        assert!(err.contains(n), "`{n}` not in: {err}");
    }
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A float checkpoint of a small GPT-2 (the real vocabulary, so that prompts tokenize) and a val
/// shard for it.
fn setup(dir: &Path) -> (PathBuf, PathBuf) {
    let cfg = GptConfig { n_positions: 32, ..GptConfig::tiny() };
    let m = Gpt::new(cfg, 3, Device::Cpu).unwrap();
    let ckpt = dir.join("float.safetensors");
    ferrograd_models::gpt::hf::save_weights(&m, &ckpt).unwrap();
    let data = dir.join("data");
    std::fs::create_dir_all(&data).unwrap();
    let toks: Vec<u16> = (0..2000u32).map(|i| ((i * 7919 + 13) % 50_000) as u16).collect();
    write_shard(&data.join("val_000000.bin"), &toks).unwrap();
    (ckpt, data)
}

#[test]
fn quantize_eval_and_sample_int8_from_the_command_line() {
    let dir = tempfile::tempdir().unwrap();
    let (ckpt, data) = setup(dir.path());
    let q = dir.path().join("int8.safetensors");
    let (out, _) = ok(&ferrograd(&["gpt", "quantize", s(&ckpt), "--out", s(&q), "--mode", "w8a8"]));
    assert!(out.contains("projection weights: f32") && out.contains("x smaller"), "{out}");
    let float_len = std::fs::metadata(&ckpt).unwrap().len();
    let q_len = std::fs::metadata(&q).unwrap().len();
    assert!(q_len < float_len, "int8 file {q_len} bytes, float {float_len}");

    let eval = ["gpt", "eval", "--device", "cpu", "--data", s(&data), "--batch", "2", "--context", "32"];
    let (out, _) = ok(&ferrograd(&[&eval[..], &["--checkpoint", s(&ckpt)]].concat()));
    let rows: Vec<&str> = out.lines().filter(|l| l.contains("perplexity")).collect();
    assert_eq!(rows.len(), 4, "{out}");
    for (row, name) in rows.iter().zip(["f32", "bf16", "int8 w8a16", "int8 w8a8"]) {
        assert!(row.starts_with(name), "{row}");
        let ppl: f64 = row.split("perplexity ").nth(1).unwrap().split_whitespace().next().unwrap().parse().unwrap();
        assert!(ppl.is_finite() && ppl > 1.0, "{row}");
    }
    // The int8 file evaluates to the numbers quantizing on the fly gives.
    let (out_q, _) = ok(&ferrograd(&[&eval[..], &["--checkpoint", s(&q), "--modes", "w8a8"]].concat()));
    let row_q = out_q.lines().find(|l| l.starts_with("int8 w8a8")).unwrap();
    assert_eq!(row_q.split("  (").next(), rows[3].split("  (").next(), "{out_q}\n{out}");

    for (file, extra) in [(&q, vec![]), (&ckpt, vec!["--int8", "w8a16"]), (&ckpt, vec!["--int8"])] {
        let mut args = vec!["gpt", "sample", "--checkpoint", s(file), "--device", "cpu", "--prompt", "To be"];
        args.extend(["--tokens", "4", "--temperature", "0"]);
        args.extend(extra);
        let (out, err) = ok(&ferrograd(&args));
        assert!(out.starts_with("To be"), "{out}");
        assert!(err.contains("int8"), "{err}");
    }
}

#[test]
fn int8_commands_refuse_bad_arguments_with_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let (ckpt, data) = setup(dir.path());
    let q = dir.path().join("int8.safetensors");
    ok(&ferrograd(&["gpt", "quantize", s(&ckpt), "--out", s(&q)]));
    let missing = dir.path().join("nope.safetensors");
    fails_with(&ferrograd(&["gpt", "quantize", s(&missing), "--out", s(&dir.path().join("x"))]), &[s(&missing)]);
    fails_with(&ferrograd(&["gpt", "quantize", s(&q), "--out", s(&dir.path().join("y"))]), &["already an int8 file"]);
    let eval = ["gpt", "eval", "--device", "cpu", "--data", s(&data), "--context", "32"];
    fails_with(&ferrograd(&[&eval[..], &["--checkpoint", s(&q), "--modes", "f32"]].concat()), &["int8 file", "f32"]);
    fails_with(&ferrograd(&[&eval[..], &["--checkpoint", s(&ckpt), "--modes", "w4"]].concat()), &["w4"]);
    fails_with(&ferrograd(&[&eval[..], &["--checkpoint", s(&ckpt), "--batch", "1000"]].concat()), &["val shards"]);
    let long = ["gpt", "eval", "--device", "cpu", "--data", s(&data), "--checkpoint", s(&ckpt), "--context", "999"];
    fails_with(&ferrograd(&long), &["--context 999"]);
    // clap's own errors: exit 2 with the bad value named.
    for args in [
        vec!["gpt", "quantize", s(&ckpt), "--out", "z", "--mode", "w4a4"],
        vec!["gpt", "sample", "--checkpoint", s(&ckpt), "--int8", "int4"],
    ] {
        let o = ferrograd(&args);
        let (_, err) = text(&o);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(err.contains("expected w8a16 or w8a8"), "{err}");
    }
}
