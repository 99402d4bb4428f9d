//! GPT-2 on the CPU: Hugging Face names and layouts, the padded vocabulary, data preparation and
//! its errors, the loader's order, training that lowers the loss, bit-identical resume and bad
//! checkpoints, and sampling (greedy determinism, the KV cache against the full forward).
//! (About 830 lines: the model's behaviours one test each, sharing the small configs and data
//! builders at the top.)

use crate::common;

use common::gpu;
use ferrograd_core::{DType, Device, Result, Tensor};
use ferrograd_models::gpt::hf::{from_pretrained, load_weights, save_pretrained, save_weights, weights_bytes};
use ferrograd_models::gpt::loader::{LoaderPos, TokenLoader};
use ferrograd_models::gpt::prepare::{prepare, PrepareConfig};
use ferrograd_models::gpt::sample::{choose, generate, Decoder, SampleConfig};
use ferrograd_models::gpt::shards::{read_shard, write_shard};
use ferrograd_models::gpt::train::{BatchSize, Precision, Run, TrainConfig};
use ferrograd_models::gpt::{Gpt, GptConfig, Tokenizer, EOT};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn tiny(n_positions: usize) -> GptConfig {
    GptConfig { n_positions, ..GptConfig::tiny() }
}

/// A small model with a small vocabulary (72, padded to 128) for the fast tests.
fn small_vocab() -> GptConfig {
    GptConfig { vocab_size: 72, n_positions: 16, n_layer: 2, n_head: 2, n_embd: 16, layer_norm_epsilon: 1e-5 }
}

fn values(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap()
}

/// Deterministic English-like text: sentences drawn from a small grammar by an LCG.
fn generated_text(sentences: usize, seed: u64) -> String {
    let subjects = ["the king", "a fool", "my lord", "the queen", "this night", "our sword"];
    let verbs = ["speaks of", "dreams of", "fears", "loves", "betrays", "remembers"];
    let objects = ["the crown", "his brother", "the sea", "a ghost", "the old law", "thy heart"];
    let mut s = seed;
    let mut next = |n: usize| {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((s >> 33) as usize) % n
    };
    let mut out = String::new();
    for i in 0..sentences {
        let line = format!("{} {} {}.", subjects[next(6)], verbs[next(6)], objects[next(6)]);
        out.push_str(&line);
        out.push(if i % 4 == 3 { '\n' } else { ' ' });
    }
    out
}

fn temp() -> tempfile::TempDir {
    tempfile::tempdir().expect("a temporary directory")
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

// ---- names, layouts, padding ----------------------------------------------------------------

#[test]
fn parameters_have_hugging_face_names_and_layouts() -> Result<()> {
    let cfg = tiny(64);
    let m = Gpt::new(cfg, 1, Device::Cpu)?;
    let p: BTreeMap<String, Vec<usize>> = m.hf_params()?.into_iter().map(|(n, t)| (n, t.dims().to_vec())).collect();
    let c = cfg.n_embd;
    assert_eq!(p["transformer.wte.weight"], [cfg.vocab_size, c]);
    assert_eq!(p["transformer.wpe.weight"], [64, c]);
    assert_eq!(p["transformer.h.1.attn.c_attn.weight"], [c, 3 * c], "Conv1D: [in, out]");
    assert_eq!(p["transformer.h.1.attn.c_attn.bias"], [3 * c]);
    assert_eq!(p["transformer.h.0.mlp.c_fc.weight"], [c, 4 * c]);
    assert_eq!(p["transformer.h.0.mlp.c_proj.weight"], [4 * c, c]);
    assert_eq!(p["transformer.ln_f.bias"], [c]);
    assert_eq!(p.len(), 4 + 12 * cfg.n_layer);
    assert_eq!(p.values().map(|d| d.iter().product::<usize>()).sum::<usize>(), cfg.num_parameters());
    // Inside, wte has the padded vocabulary, its extra rows zero.
    assert_eq!(m.wte.dims(), [50304, c]);
    assert!(values(&m.wte.narrow(0, cfg.vocab_size, 50304 - cfg.vocab_size)?).iter().all(|&v| v == 0.0));
    // GPT-2 init: N(0, 0.02), residual projections scaled by 1/sqrt(2L).
    let std = |t: &Tensor| {
        let v = values(t);
        (v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>() / v.len() as f64).sqrt()
    };
    assert!((std(&m.blocks[0].c_fc_w) - 0.02).abs() < 0.002);
    assert!((std(&m.blocks[0].mlp_proj_w) - 0.01).abs() < 0.001, "0.02 / sqrt(2 * 2)");
    Ok(())
}

#[test]
fn weights_round_trip_with_and_without_prefix_and_skip_mask_buffers() -> Result<()> {
    let cfg = small_vocab();
    let dir = temp();
    let a = Gpt::new(cfg, 3, Device::Cpu)?;
    // Ours: prefixed names, no lm_head, format pt, real vocabulary.
    let bytes = weights_bytes(&a)?;
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut names = st.names();
    names.sort();
    assert!(names.iter().all(|n| n.starts_with("transformer.")), "{names:?}");
    assert_eq!(st.tensor("transformer.wte.weight").unwrap().shape(), [72, 16]);
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    assert_eq!(meta.metadata().as_ref().unwrap()["format"], "pt");

    let p = dir.path().join("ours.safetensors");
    save_weights(&a, &p)?;
    let b = Gpt::zeroed(cfg, Device::Cpu)?;
    load_weights(&b, &p)?;
    for ((n, x), (_, y)) in a.params().iter().zip(b.params()) {
        assert_eq!(values(x), values(&y), "{n}");
    }

    // As GPT2Model files (and the hub's gpt2) store them: no prefix, with the causal-mask buffers,
    // plus an explicit lm_head.weight; in f16 to exercise conversion.
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = vec![];
    for (n, t) in a.hf_params()? {
        let v: Vec<u8> = values(&t).iter().flat_map(|x| ferrograd_core::f16::from_f32(*x).to_le_bytes()).collect();
        tensors.push((n.strip_prefix("transformer.").unwrap().to_string(), t.dims().to_vec(), v));
    }
    for i in 0..cfg.n_layer {
        tensors.push((format!("h.{i}.attn.bias"), vec![1, 1, 16, 16], vec![0u8; 2 * 256]));
        tensors.push((format!("h.{i}.attn.masked_bias"), vec![], vec![0u8; 2]));
    }
    tensors.push(("lm_head.weight".into(), vec![72, 16], vec![0u8; 2 * 72 * 16]));
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, s, d)| {
            (n.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::F16, s.clone(), d).unwrap())
        })
        .collect();
    let hub = dir.path().join("hub.safetensors");
    safetensors::serialize_to_file(views, None, &hub).unwrap();
    let c = Gpt::zeroed(cfg, Device::Cpu)?;
    load_weights(&c, &hub)?;
    for ((n, x), (_, y)) in a.params().iter().zip(c.params()) {
        let (x, y) = (values(x), values(&y));
        assert!(x.iter().zip(&y).all(|(p, q)| (p - q).abs() <= 1e-3 * p.abs().max(1e-3)), "{n}");
    }

    // A save_pretrained directory loads with its config, and gives the same logits.
    let d = dir.path().join("pretrained");
    save_pretrained(&a, &d)?;
    let (e, note) = from_pretrained(&d, Device::Cpu)?;
    assert!(note.contains("config.json"), "{note}");
    assert_eq!(e.config, cfg);
    let ids = Tensor::from_vec(vec![1u32, 5, 9, 71, 0, 3], (2, 3), Device::Cpu)?;
    let (la, le) = (a.logits(&ids)?, e.logits(&ids)?);
    assert_eq!(la.dims(), [2, 3, 72], "the padded vocabulary is invisible in outputs");
    assert_eq!(values(&la), values(&le));
    Ok(())
}

#[test]
fn bad_weights_files_are_named_errors() -> Result<()> {
    let cfg = small_vocab();
    let dir = temp();
    let a = Gpt::new(cfg, 3, Device::Cpu)?;
    let p = dir.path().join("w.safetensors");
    save_weights(&a, &p)?;
    let other = Gpt::zeroed(GptConfig { n_embd: 32, ..cfg }, Device::Cpu)?;
    let e = load_weights(&other, &p).unwrap_err().to_string();
    assert!(e.contains("w.safetensors") && e.contains("shape"), "{e}");
    let junk = write(dir.path(), "junk.safetensors", b"not a safetensors file");
    let e = load_weights(&a, &junk).unwrap_err().to_string();
    assert!(e.contains("junk.safetensors") && e.contains("safetensors"), "{e}");
    let e = from_pretrained(&dir.path().join("missing"), Device::Cpu).unwrap_err().to_string();
    assert!(e.contains("no such file"), "{e}");
    Ok(())
}

// ---- data -----------------------------------------------------------------------------------

#[test]
fn prepare_writes_llmc_shards_that_decode_to_the_text() -> Result<()> {
    let dir = temp();
    let texts = [generated_text(40, 1), "Second document: naïve café, 日本語.\n".to_string()];
    let files: Vec<PathBuf> =
        texts.iter().enumerate().map(|(i, t)| write(dir.path(), &format!("doc{i}.txt"), t.as_bytes())).collect();
    let out = dir.path().join("shards");
    let cfg = PrepareConfig { val_fraction: 0.25, shard_tokens: 100 };
    let seen = std::sync::atomic::AtomicU64::new(0);
    let r = prepare(&files, &out, &cfg, &|b| {
        seen.fetch_add(b, std::sync::atomic::Ordering::Relaxed);
    })?;
    assert_eq!(seen.into_inner(), r.bytes);
    assert_eq!(r.train_tokens + r.val_tokens, r.tokens);
    assert_eq!(r.val_tokens, (r.tokens as f64 * 0.25).round() as usize);
    assert!(r.train_shards.len() >= 2, "100-token shards");
    let mut stream: Vec<u32> = vec![];
    for p in r.train_shards.iter().chain(&r.val_shards) {
        let bytes = std::fs::read(p).unwrap();
        assert_eq!(i32::from_le_bytes(bytes[0..4].try_into().unwrap()), 20240520);
        assert_eq!(i32::from_le_bytes(bytes[4..8].try_into().unwrap()), 1);
        stream.extend(read_shard(p)?.iter().map(|&t| t as u32));
    }
    let tok = Tokenizer::gpt2()?;
    let docs: Vec<&[u32]> = stream.split(|&t| t == EOT).collect();
    assert_eq!(docs.len(), 3, "each document starts with <|endoftext|>");
    assert!(docs[0].is_empty());
    assert_eq!(tok.decode(docs[1])?, texts[0]);
    assert_eq!(tok.decode(docs[2])?, texts[1]);
    assert!(out.join("prepare.json").is_file());
    Ok(())
}

#[test]
fn prepare_rejects_binary_empty_non_utf8_and_unreadable_files() {
    let dir = temp();
    let good = write(dir.path(), "good.txt", b"Some text.\n");
    let out = dir.path().join("out");
    let cases: Vec<(PathBuf, &str)> = vec![
        (write(dir.path(), "image.png", b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR"), "binary"),
        (write(dir.path(), "empty.txt", b""), "is empty"),
        (write(dir.path(), "blank.txt", b" \n\t\n"), "only whitespace"),
        (write(dir.path(), "latin1.txt", b"caf\xe9 au lait"), "not UTF-8"),
        (dir.path().join("missing.txt"), "cannot read"),
        (dir.path().to_path_buf(), "is a directory"),
    ];
    for (bad, why) in cases {
        let e = prepare(&[good.clone(), bad.clone()], &out, &PrepareConfig::default(), &|_| {}).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains(&bad.display().to_string()) && msg.contains(why), "{why}: {msg}");
        assert!(!out.exists(), "nothing is written when an input is bad ({why})");
    }
    let e = prepare(&[], &out, &PrepareConfig::default(), &|_| {}).unwrap_err();
    assert!(e.to_string().contains("no input files"));
}

#[test]
fn loader_follows_the_documented_order_across_shards() -> Result<()> {
    let dir = temp();
    // Shard 0: 0..30, shard 1: 100..107 (too short for a batch of 2 x 4 + 1), shard 2: 200..220.
    write_shard(&dir.path().join("train_000000.bin"), &(0..30).collect::<Vec<u16>>())?;
    write_shard(&dir.path().join("train_000001.bin"), &(100..107).collect::<Vec<u16>>())?;
    write_shard(&dir.path().join("train_000002.bin"), &(200..220).collect::<Vec<u16>>())?;
    let mut l = TokenLoader::new(dir.path(), "train", 2, 4)?;
    let firsts: Vec<(u32, u32)> = (0..7)
        .map(|_| {
            let (x, y) = l.next_batch().unwrap();
            assert_eq!(x.len(), 8);
            assert_eq!(&x[1..], &y[..7], "targets are the inputs shifted by one");
            (x[0], y[7])
        })
        .collect();
    // 0, 8, 16 fit in shard 0 (16 + 9 <= 30; 24 + 9 > 30), shard 1 is skipped, 200 and 208
    // fit in shard 2 (208 + 9 <= 220), then back to shard 0.
    assert_eq!(firsts, vec![(0, 8), (8, 16), (16, 24), (200, 208), (208, 216), (0, 8), (8, 16)]);
    l.set_position(LoaderPos { shard: 2, pos: 8 })?;
    assert_eq!(l.next_batch()?.0[0], 208);
    let e = TokenLoader::new(dir.path(), "train", 4, 8).err().unwrap().to_string();
    assert!(e.contains("needs 33"), "{e}");
    let e = TokenLoader::new(dir.path(), "val", 1, 4).err().unwrap().to_string();
    assert!(e.contains("gpt prepare"), "{e}");
    Ok(())
}

// ---- training -------------------------------------------------------------------------------

/// Shards of generated text in a temporary directory.
fn text_shards(sentences: usize) -> tempfile::TempDir {
    let dir = temp();
    let f = write(dir.path(), "text.txt", generated_text(sentences, 7).as_bytes());
    prepare(&[f], &dir.path().join("data"), &PrepareConfig { val_fraction: 0.1, shard_tokens: 1 << 20 }, &|_| {})
        .unwrap();
    dir
}

fn cpu_run(dir: &Path, model: GptConfig, steps: u64, batch: usize, context: usize) -> TrainConfig {
    TrainConfig {
        model,
        steps,
        batch: BatchSize::Fixed(batch),
        context,
        precision: Precision::F32,
        lr: 3e-3,
        warmup: Some(2),
        log_every: 5,
        val_every: 0,
        val_batches: 2,
        ..TrainConfig::gpu_defaults(dir.join("data"), dir.join("out"), Device::Cpu)
    }
}

#[test]
fn a_tiny_gpt_learns_generated_text() -> Result<()> {
    let dir = text_shards(600);
    let cfg = TrainConfig { lr: 1e-2, ..cpu_run(dir.path(), tiny(32), 30, 4, 32) };
    let mut losses = vec![];
    let s = ferrograd_models::gpt::train::train(cfg, std::time::Instant::now(), |e| {
        if let ferrograd_models::gpt::train::Event::Logged(st) = e {
            losses.push(st.loss);
        }
    })?;
    let (first, last) = (losses[0], *losses.last().unwrap());
    // Starts near ln(50257) = 10.8; the grammar has a few dozen distinct tokens.
    assert!(first > 9.0 && last < 0.5 * first, "{losses:?}");
    assert!(s.final_val_loss.unwrap() < 0.6 * first, "{s:?}");
    assert!(s.checkpoint.as_ref().unwrap().is_file());
    let exported = s.exported.unwrap();
    assert!(exported.join("config.json").is_file() && exported.join("model.safetensors").is_file());
    let log = std::fs::read_to_string(s.log)?;
    let kinds: Vec<String> = log
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["kind"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(kinds.first().map(String::as_str), Some("start"));
    assert_eq!(kinds.iter().filter(|k| *k == "train").count(), 6);
    assert!(kinds.contains(&"val".to_string()) && kinds.last().map(String::as_str) == Some("summary"));
    Ok(())
}

fn params_and_moments(run: &Run) -> Vec<(String, Vec<f32>)> {
    use ferrograd_nn::optim::Optimizer;
    run.model.params().into_iter().chain(run.opt.state_tensors()).map(|(n, t)| (n, values(&t))).collect()
}

#[test]
fn resume_is_bit_identical_and_padded_rows_stay_zero() -> Result<()> {
    let dir = text_shards(300);
    let mut cfg = cpu_run(dir.path(), small_vocab_gpt2_tokens(), 6, 2, 16);
    cfg.total_batch = Some(2 * 2 * 16); // two micro-batches per step
    let mut straight = Run::new(cfg.clone())?;
    for _ in 0..6 {
        straight.train_step()?;
    }
    let mut first = Run::new(cfg.clone())?;
    for _ in 0..3 {
        first.train_step()?;
    }
    first.save_checkpoint()?;
    drop(first);
    let mut resumed = Run::new(TrainConfig { resume: true, ..cfg.clone() })?;
    assert_eq!(resumed.step, 3);
    for _ in 0..3 {
        resumed.train_step()?;
    }
    let (a, b) = (params_and_moments(&straight), params_and_moments(&resumed));
    assert_eq!(a.len(), b.len());
    for ((n, x), (_, y)) in a.iter().zip(&b) {
        assert!(x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits()), "{n} differs after resuming");
    }
    let v = straight.model.config.vocab_size;
    let pad = straight.model.wte.dims()[0] - v;
    assert!(values(&straight.model.wte.narrow(0, v, pad)?).iter().all(|&x| x == 0.0));
    // A run with other settings refuses the checkpoint.
    let e = Run::new(TrainConfig { resume: true, lr: 1e-3, ..cfg }).err().unwrap().to_string();
    assert!(e.contains("--resume"), "{e}");
    Ok(())
}

/// `--resume` reads `out/checkpoint.safetensors` into place (`load_safetensors_with`, then
/// `checkpoint::from_loaded`): parameters, AdamW moments and step bit for bit as the run that
/// wrote it had them, the padded rows of `wte` zero. A truncated or garbled checkpoint is a typed
/// error naming the file, and a NaN in it names the tensor; none of them panics.
#[test]
fn resume_reads_the_checkpoint_into_place_and_bad_checkpoints_are_named_errors() -> Result<()> {
    let dir = text_shards(300);
    let cfg = cpu_run(dir.path(), small_vocab_gpt2_tokens(), 4, 2, 16);
    let mut first = Run::new(cfg.clone())?;
    for _ in 0..2 {
        first.train_step()?;
    }
    let path = first.save_checkpoint()?;
    let resumed = Run::new(TrainConfig { resume: true, ..cfg.clone() })?;
    assert_eq!(resumed.step, 2);
    let (a, b) = (params_and_moments(&first), params_and_moments(&resumed));
    assert_eq!(a.len(), b.len());
    for ((n, x), (m, y)) in a.iter().zip(&b) {
        assert_eq!(n, m);
        assert!(x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits()), "{n} differs after resuming");
    }
    let v = resumed.model.config.vocab_size;
    let pad = resumed.model.wte.dims()[0] - v;
    assert!(values(&resumed.model.wte.narrow(0, v, pad)?).iter().all(|&x| x == 0.0));

    let good = std::fs::read(&path).unwrap();
    let resume_err = |bytes: &[u8]| -> ferrograd_core::Error {
        std::fs::write(&path, bytes).unwrap();
        match Run::new(TrainConfig { resume: true, ..cfg.clone() }) {
            Ok(_) => panic!("a bad checkpoint was resumed"),
            Err(e) => e,
        }
    };
    let named = |e: &ferrograd_core::Error| e.to_string().contains("checkpoint.safetensors");
    // Cut inside the data section, and inside the header.
    for cut in [good.len() - 3, good.len() / 2, 40] {
        let e = resume_err(&good[..cut]);
        assert!(matches!(e, ferrograd_core::Error::File { .. }) && named(&e), "cut at {cut}: {e}");
    }
    // The header's JSON garbled.
    let mut garbled = good.clone();
    garbled[9] = b'#';
    let e = resume_err(&garbled);
    assert!(matches!(e, ferrograd_core::Error::File { .. }) && named(&e), "{e}");
    // A NaN in the first element of a tensor (the moments too are checked, not only weights).
    let n = 8 + u64::from_le_bytes(good[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&good[8..n]).unwrap();
    let name = "optim.state.transformer.wpe.weight.m";
    let at = n + header[name]["data_offsets"][0].as_u64().unwrap() as usize;
    let mut nan = good.clone();
    nan[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    let e = resume_err(&nan);
    assert!(
        matches!(&e, ferrograd_core::Error::NonFinite { what, index: 0, .. } if what.contains(name)) && named(&e),
        "{e}"
    );
    Ok(())
}

/// GPT-2's vocabulary (the shards hold GPT-2 tokens) with a very small body.
fn small_vocab_gpt2_tokens() -> GptConfig {
    GptConfig { vocab_size: 50257, ..small_vocab() }
}

// ---- sampling -------------------------------------------------------------------------------

/// Under a bf16 autocast scope (as the gpt2_sample example samples on a GPU) the QKV projection
/// writes bf16 while the KV cache is f32: decoding stores into the cache in its dtype and tracks
/// the full forward under the same scope (it failed with a set dtype mismatch on an H200).
#[test]
fn kv_cache_decode_under_bf16_autocast() -> Result<()> {
    let m = Gpt::new(small_vocab(), 11, Device::Cpu)?;
    let ids: Vec<u32> = vec![5, 17, 3, 70, 42, 8];
    let _ac = ferrograd_nn::amp::autocast(DType::BF16)?;
    let full = m.logits(&Tensor::from_vec(ids.clone(), (1, ids.len()), Device::Cpu)?)?;
    let mut dec = Decoder::new(&m, 12)?;
    dec.prefill(&ids[..4])?;
    let got = values(&dec.step(ids[4])?);
    let want = values(&full.narrow(1, 4, 1)?.flatten_all()?);
    let scale = want.iter().fold(0f32, |a, b| a.max(b.abs()));
    let err = want.iter().zip(&got).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(err <= 3e-2 * scale, "max error {err} (scale {scale})");
    Ok(())
}

/// `cast_projections` (what `gpt sample --bf16` does once) decodes as autocast's per-call casts do:
/// the same bf16 values reach the same GEMMs.
#[test]
fn projections_cast_once_decode_as_autocast_casts_them() -> Result<()> {
    for dev in [Some(Device::Cpu), gpu()].into_iter().flatten() {
        let a = Gpt::new(small_vocab(), 11, dev)?;
        let mut b = Gpt::new(small_vocab(), 11, dev)?;
        assert!(b.cast_projections(DType::F32).is_err());
        b.cast_projections(DType::BF16)?;
        assert_eq!(b.blocks[0].c_fc_w.dtype(), DType::BF16);
        assert_eq!(b.blocks[0].ln_1_w.dtype(), DType::F32);
        let ids = [5u32, 17, 3, 70, 42, 8];
        let _ac = ferrograd_nn::amp::autocast(DType::BF16)?;
        let run = |m: &Gpt| -> Result<Vec<f32>> {
            let mut d = Decoder::new(m, 12)?;
            let mut v = values(&d.prefill(&ids[..4])?);
            v.extend(values(&d.step(ids[4])?));
            v.extend(values(&d.step(ids[5])?));
            Ok(v)
        };
        let (want, got) = (run(&a)?, run(&b)?);
        if dev.is_cpu() {
            assert_eq!(want, got);
        } else {
            let scale = want.iter().fold(1e-3f32, |m, v| m.max(v.abs()));
            let err = want.iter().zip(&got).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
            assert!(err <= 1e-3 * scale, "{dev}: max error {err} (scale {scale})");
        }
    }
    Ok(())
}

/// On CUDA the decode step is captured once and replayed for every token: the same logits, bit
/// for bit, as the same step run op by op, in f32 and under a bf16 autocast, for the attention
/// kernels' head dim and the fallback's; and the full forward's logits to rounding (f32).
#[test]
fn decode_graph_replay_equals_eager_steps() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let ids = [5u32, 17, 3, 70, 42, 8, 1, 9];
    for cfg in [cuda_small(72), small_vocab()] {
        let m = Gpt::new(cfg, 11, dev)?;
        let full = values(&m.logits(&Tensor::from_vec(ids.to_vec(), (1, ids.len()), dev)?)?);
        for bf16 in [false, true] {
            let _ac = if bf16 { Some(ferrograd_nn::amp::autocast(DType::BF16)?) } else { None };
            let run = |graph: bool| -> Result<(Vec<Vec<f32>>, bool)> {
                let mut d = Decoder::with_graph(&m, 12, graph)?;
                d.prefill(&ids[..3])?;
                let steps = ids[3..].iter().map(|&t| Ok(values(&d.step(t)?))).collect::<Result<Vec<_>>>()?;
                Ok((steps, d.graph_state().0))
            };
            let ((eager, g0), (replayed, g1)) = (run(false)?, run(true)?);
            assert!(!g0 && g1, "graph modes: eager {g0}, replayed {g1}");
            assert_eq!(eager, replayed, "head dim {}, bf16 {bf16}", cfg.head_dim());
            if !bf16 {
                let v = cfg.vocab_size;
                for (k, got) in replayed.iter().enumerate() {
                    let want = &full[(3 + k) * v..(4 + k) * v];
                    let err = want.iter().zip(got).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                    assert!(err < 1e-4, "position {}: max error {err}", 3 + k);
                }
            }
        }
    }
    Ok(())
}

#[test]
fn kv_cache_decode_matches_the_full_forward() -> Result<()> {
    let cfg = small_vocab();
    let m = Gpt::new(cfg, 11, Device::Cpu)?;
    let ids: Vec<u32> = vec![5, 17, 3, 70, 42, 8, 1];
    let full = m.logits(&Tensor::from_vec(ids.clone(), (1, ids.len()), Device::Cpu)?)?;
    let mut dec = Decoder::new(&m, 12)?;
    let mut got = vec![values(&dec.prefill(&ids[..4])?)];
    for &t in &ids[4..] {
        got.push(values(&dec.step(t)?));
    }
    for (k, pos) in (3..ids.len()).enumerate() {
        let want = values(&full.narrow(1, pos, 1)?.flatten_all()?);
        let err = want.iter().zip(&got[k]).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(err < 1e-5, "position {pos}: max error {err}");
    }
    let e = dec.step(72).unwrap_err().to_string();
    assert!(e.contains("out of range"), "{e}");
    // A prompt in two chunks: the second (3 queries after 2 cached keys) is the offset causal
    // mask that PyTorch's top-left `is_causal` cannot express (ops::attention's fallback).
    let mut dec = Decoder::new(&m, 12)?;
    dec.prefill(&ids[..2])?;
    let chunked = values(&dec.prefill(&ids[2..5])?);
    let want = values(&full.narrow(1, 4, 1)?.flatten_all()?);
    let err = want.iter().zip(&chunked).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(err < 1e-5, "chunked prefill: max error {err}");
    Ok(())
}

/// The fused causal attention the model calls equals attention through the materialized scores
/// (f64, CPU), values and gradients, on the strided q/k/v views of one packed QKV buffer.
#[test]
fn fused_causal_attention_matches_the_materialized_scores() -> Result<()> {
    use ferrograd_models::gpt::ops::{attention, causal_mask, materialized_attention};
    let (b, t, h, d) = (2, 7, 3, 8);
    let qkv = Tensor::randn_with(&mut ferrograd_core::Rng::new(3), 0.0, 1.0, (b, t, 3, h, d), DType::F64, Device::Cpu)?
        .requires_grad();
    let views = |qkv: &Tensor| -> Result<Vec<Tensor>> {
        (0..3).map(|i| qkv.narrow(2, i, 1)?.squeeze(2)?.permute(&[0, 2, 1, 3])).collect()
    };
    let v = views(&qkv)?;
    let mask = causal_mask(t, 0, Device::Cpu)?;
    let fused = attention(&v[0], &v[1], &v[2], 0, || panic!("the fused path needs no mask"))?;
    let plain = materialized_attention(&v[0], &v[1], &v[2], &mask)?;
    let w = Tensor::randn_with(&mut ferrograd_core::Rng::new(4), 0.0, 1.0, (b, h, t, d), DType::F64, Device::Cpu)?;
    let (gf, gp) = (fused.mul(&w)?.sum_all()?.backward()?, plain.mul(&w)?.sum_all()?.backward()?);
    let max_diff = |x: &Tensor, y: &Tensor| -> Result<f64> {
        let (x, y) = (x.to_vec::<f64>()?, y.to_vec::<f64>()?);
        Ok(x.iter().zip(&y).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max))
    };
    assert!(max_diff(&fused.contiguous()?.flatten_all()?, &plain.contiguous()?.flatten_all()?)? < 1e-12);
    let (a, c) = (gf.get(&qkv).unwrap(), gp.get(&qkv).unwrap());
    assert!(max_diff(&a.flatten_all()?, &c.flatten_all()?)? < 1e-12, "gradients of the packed QKV buffer");
    Ok(())
}

#[test]
fn greedy_and_seeded_sampling_are_deterministic() -> Result<()> {
    let m = Gpt::new(small_vocab(), 5, Device::Cpu)?;
    let prompt = [1u32, 2, 3];
    let run = |top_k, temperature, seed| {
        let cfg = SampleConfig { max_new_tokens: 10, temperature, top_k, seed, stop_at_eot: false, graph: true };
        generate(&m, &prompt, &cfg, |_| Ok(())).unwrap().tokens
    };
    let greedy = run(Some(1), 1.0, 0);
    assert_eq!(greedy.len(), 10);
    assert_eq!(greedy, run(Some(1), 1.0, 99), "top-k 1 ignores the seed");
    assert_eq!(greedy, run(None, 0.0, 7), "temperature 0 is greedy");
    // Greedy is the arg-max of the full forward at each step.
    let mut seq = prompt.to_vec();
    for &t in &greedy {
        let l = m.logits(&Tensor::from_vec(seq.clone(), (1, seq.len()), Device::Cpu)?)?;
        let last = values(&l.narrow(1, seq.len() - 1, 1)?.flatten_all()?);
        assert_eq!(t, choose(&last, 0.0, None, 0.0)?);
        seq.push(t);
    }
    let a = run(Some(20), 1.0, 3);
    assert_eq!(a, run(Some(20), 1.0, 3));
    assert_ne!(a, run(Some(20), 1.0, 4), "another seed, another text (10 draws among 20)");
    let e = generate(&m, &[1; 10], &SampleConfig { max_new_tokens: 10, ..Default::default() }, |_| Ok(()));
    assert!(e.unwrap_err().to_string().contains("context of 16"));
    Ok(())
}

#[test]
fn choose_respects_top_k_and_temperature() -> Result<()> {
    let logits = [0.0f32, 3.0, 1.0, 3.0, -2.0];
    assert_eq!(choose(&logits, 1.0, Some(1), 0.9)?, 1, "ties go to the lower index");
    for i in 0..100 {
        let t = choose(&logits, 1.0, Some(2), i as f64 / 100.0)?;
        assert!(t == 1 || t == 3);
    }
    assert_eq!(choose(&logits, 1.0, Some(2), 0.49)?, 1);
    assert_eq!(choose(&logits, 1.0, Some(2), 0.51)?, 3);
    assert!(choose(&logits, 1.0, Some(0), 0.5).is_err());
    assert!(choose(&logits, -1.0, None, 0.5).is_err());
    assert!(choose(&[f32::NAN], 1.0, None, 0.5).is_err());
    Ok(())
}

/// The draw as first written: the whole vocabulary sorted, then the inverse CDF over the top k.
fn choose_by_full_sort(logits: &[f32], temperature: f64, top_k: Option<usize>, u: f64) -> u32 {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    if temperature == 0.0 || top_k == Some(1) {
        return order[0] as u32;
    }
    let top = &order[..top_k.unwrap_or(order.len()).min(order.len())];
    let w: Vec<f64> = top.iter().map(|&i| ((logits[i] - logits[top[0]]) as f64 / temperature).exp()).collect();
    let (target, mut acc) = (u * w.iter().sum::<f64>(), 0.0);
    for (&i, wi) in top.iter().zip(&w) {
        acc += wi;
        if target < acc {
            return i as u32;
        }
    }
    top[top.len() - 1] as u32
}

#[test]
fn choose_selects_as_a_full_sort_would() -> Result<()> {
    // Few distinct values, so ties are everywhere (the lower index wins each).
    let mut state = 12345u64;
    let mut next = || {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (state >> 33) as u32
    };
    for n in [1usize, 2, 7, 100, 1000] {
        let logits: Vec<f32> = (0..n).map(|_| (next() % 13) as f32 * 0.5 - 3.0).collect();
        for k in [None, Some(1), Some(2), Some(5), Some(50), Some(n)] {
            for temp in [0.0, 0.7, 1.0] {
                for j in 0..8 {
                    let u = (j as f64 + 0.5) / 8.0;
                    let want = choose_by_full_sort(&logits, temp, k, u);
                    assert_eq!(choose(&logits, temp, k, u)?, want, "n {n} k {k:?} t {temp} u {u}");
                }
            }
        }
    }
    Ok(())
}

#[test]
fn bf16_autocast_loss_and_gradients_track_f32() -> Result<()> {
    let m = Gpt::new(small_vocab(), 21, Device::Cpu)?;
    let ids: Vec<u32> = (0..32).map(|i| (i * 37 + 5) % 72).collect();
    let x = Tensor::from_vec(ids[..24].to_vec(), (2, 12), Device::Cpu)?;
    let y = Tensor::from_vec(ids[8..].to_vec(), (2, 12), Device::Cpu)?;
    let full = m.loss(&x, &y)?;
    let low = {
        let _ac = ferrograd_nn::amp::autocast(DType::BF16)?;
        m.loss(&x, &y)?
    };
    assert_eq!(low.dtype(), DType::F32);
    let (a, b) = (full.item_f64()?, low.item_f64()?);
    assert!((a - b).abs() < 1e-2 * a, "f32 {a} vs bf16 {b}");
    let (ga, gb) = (full.backward()?, low.backward()?);
    for (n, p) in m.params() {
        let (u, v) = (values(ga.get(&p).unwrap()), values(gb.get(&p).unwrap()));
        assert_eq!(gb.get(&p).unwrap().dtype(), DType::F32, "{n}: master gradients are f32");
        let norm = |w: &[f32]| w.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
        let diff: Vec<f32> = u.iter().zip(&v).map(|(p, q)| p - q).collect();
        assert!(norm(&diff) <= 0.05 * norm(&u) + 1e-6, "{n}: bf16 gradient far from f32");
    }
    Ok(())
}

// ---- CUDA (each test prints one line and passes where no GPU is usable) ----------------------

/// A small model whose head dim (32) the CUDA attention kernels are built for, so that the CUDA
/// runs go through them and not the materialized fallback.
fn cuda_small(vocab_size: usize) -> GptConfig {
    GptConfig { vocab_size, n_embd: 64, ..small_vocab() }
}

#[test]
fn gpt_cuda_training_steps_agree_with_the_cpu() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let dir = text_shards(300);
    let mut cfg = cpu_run(dir.path(), cuda_small(50257), 4, 2, 16);
    cfg.total_batch = Some(2 * 2 * 16);
    let cfg_lr = cfg.lr;
    let mut cpu = Run::new(cfg.clone())?;
    let mut cuda = Run::new(TrainConfig { device: dev, out: dir.path().join("out-cuda"), ..cfg })?;
    for step in 1..=4 {
        let (a, _) = cpu.train_step()?;
        let (b, _) = cuda.train_step()?;
        let (a, b) = (a.item_f64()?, b.item_f64()?);
        assert!((a - b).abs() <= 1e-4 * a.abs(), "step {step}: cpu {a} vs cuda {b}");
    }
    // An Adam step moves every parameter element by about lr whatever its gradient's size, so a
    // parameter that started at 0 (the biases) is only as large as the steps taken: parameters are
    // compared on the larger of their own scale and 4 x lr (an H200 run met c_attn.bias at 9.4e-6
    // against 1e-3 x 8.9e-3, summation-order noise amplified where a gradient element is near eps).
    let n_params = cpu.model.params().len();
    let lr = cfg_lr as f32;
    for (i, ((n, x), (_, y))) in params_and_moments(&cpu).iter().zip(&params_and_moments(&cuda)).enumerate() {
        let err = x.iter().zip(y).map(|(p, q)| (p - q).abs()).fold(0f32, f32::max);
        let own = x.iter().map(|p| p.abs()).fold(0f32, f32::max).max(1e-6);
        let scale = if i < n_params { own.max(4.0 * lr) } else { own };
        assert!(err <= 1e-3 * scale, "{n}: max difference {err} (scale {scale})");
    }
    Ok(())
}

#[test]
fn gpt_cuda_bf16_steps_auto_batch_and_kv_cache() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let dir = text_shards(300);
    let cfg = TrainConfig {
        device: dev,
        precision: Precision::Bf16,
        batch: BatchSize::Auto,
        total_batch: Some(8 * 16),
        ..cpu_run(dir.path(), cuda_small(50257), 3, 1, 16)
    };
    let mut run = Run::new(cfg)?;
    assert_eq!(run.micro_batch, 8, "{:?}", run.info.auto_batch);
    let first = run.train_step()?.0.item_f64()?;
    run.train_step()?;
    let third = run.train_step()?.0.item_f64()?;
    assert!(first.is_finite() && third.is_finite() && third < first, "{first} -> {third}");

    // The KV cache through the kernels (head dim 32) and through the fallback (head dim 8).
    for cfg in [cuda_small(72), small_vocab()] {
        let m = Gpt::new(cfg, 11, dev)?;
        let ids: Vec<u32> = vec![5, 17, 3, 70, 42, 8, 1];
        let full = m.logits(&Tensor::from_vec(ids.clone(), (1, ids.len()), dev)?)?;
        let mut d = Decoder::new(&m, 12)?;
        d.prefill(&ids[..5])?;
        d.step(ids[5])?;
        let got = values(&d.step(ids[6])?);
        let want = values(&full.narrow(1, 6, 1)?.flatten_all()?);
        let err = want.iter().zip(&got).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(err < 1e-4, "head dim {}: max error {err}", cfg.head_dim());
    }
    Ok(())
}

/// Named parameter and moment values.
type Values = Vec<(String, Vec<f32>)>;

/// Parameters, moments and per-step losses of `steps` steps of `cfg`.
fn run_steps(cfg: TrainConfig, steps: usize) -> Result<(Values, Vec<f64>)> {
    let mut run = Run::new(cfg)?;
    let mut losses = vec![];
    for _ in 0..steps {
        losses.push(run.train_step()?.0.item_f64()?);
    }
    Ok((params_and_moments(&run), losses))
}

/// The step captured as a CUDA graph and replayed (warm-up steps, the capture, replays; two
/// micro-batches per step, a warm-up learning rate that changes every step, clipping) against the
/// same steps run eagerly. Bit for bit where every kernel is deterministic: one token per
/// micro-batch (layer norm's backward sums its weight gradients with one atomic per column per
/// block, so more rows than one block would reorder float additions between any two runs) and head
/// dim 8 (the materialized attention; the flash kernel's dQ is accumulated atomically too). With
/// those kernels (head dim 32, 2 x 16 tokens) the two agree to float rounding.
#[test]
fn gpt_cuda_graph_replay_equals_eager_steps() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let dir = text_shards(300);
    // GPT-2 token ids (the shards hold real BPE ids, 50256 included): a 50257-entry vocabulary.
    for (model, batch, context, exact) in [(small_vocab_gpt2_tokens(), 1, 1, true), (cuda_small(50257), 2, 16, false)] {
        let base = TrainConfig {
            device: dev,
            total_batch: Some(2 * batch * context),
            warmup: Some(4),
            grad_clip: 0.05,
            ..cpu_run(dir.path(), model, 7, batch, context)
        };
        let graph = TrainConfig { graph: true, out: dir.path().join("graph"), ..base.clone() };
        let eager = TrainConfig { graph: false, out: dir.path().join("eager"), ..base };
        let (pg, lg) = run_steps(graph, 7)?;
        let (pe, le) = run_steps(eager, 7)?;
        for (step, (a, b)) in lg.iter().zip(&le).enumerate() {
            assert!(if exact { a == b } else { (a - b).abs() <= 1e-5 * b.abs() }, "step {step}: graph {a} eager {b}");
        }
        for ((n, x), (_, y)) in pg.iter().zip(&pe) {
            let err = x.iter().zip(y).map(|(p, q)| (p - q).abs()).fold(0f32, f32::max);
            let scale = y.iter().map(|p| p.abs()).fold(0f32, f32::max).max(1e-6);
            if exact {
                assert!(x == y, "{n}: graph and eager differ by up to {err}");
            } else {
                assert!(err <= 1e-4 * scale, "{n}: max difference {err} (scale {scale})");
            }
        }
    }
    Ok(())
}

/// A bf16 run keeps bf16 copies of the projections' weights, written by AdamW (`cuda::ShadowSet`),
/// and hands AdamW the clip factor instead of scaling the gradients: the same bits as casting at
/// every forward. Graph replay and eager; the exact configuration of the test above (one token a
/// micro-batch, head dim 8) so that every kernel is deterministic.
#[test]
fn gpt_cuda_weight_copies_train_bit_identically() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let dir = text_shards(300);
    for graph in [true, false] {
        let cfg = TrainConfig {
            device: dev,
            precision: Precision::Bf16,
            total_batch: Some(2),
            warmup: Some(3),
            grad_clip: 0.05,
            graph,
            ..cpu_run(dir.path(), small_vocab_gpt2_tokens(), 5, 1, 1)
        };
        let steps = |copies: bool, out: &str| -> Result<(Values, Vec<f64>)> {
            let mut run = Run::new(TrainConfig { out: dir.path().join(out), ..cfg.clone() })?;
            run.set_weight_copies(copies)?;
            assert_eq!(run.weight_copies() > 0, copies, "copies {copies}: {}", run.weight_copies());
            let mut losses = vec![];
            for _ in 0..5 {
                losses.push(run.train_step()?.0.item_f64()?);
            }
            Ok((params_and_moments(&run), losses))
        };
        let (pa, la) = steps(true, "copies")?;
        let (pb, lb) = steps(false, "casts")?;
        assert_eq!(la, lb, "graph {graph}: losses");
        for ((n, x), (_, y)) in pa.iter().zip(&pb) {
            assert!(x == y, "graph {graph}: {n} differs");
        }
    }
    Ok(())
}
