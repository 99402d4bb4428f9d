//! Checkpoints: round trip, bit-identical resume, typed errors for bad files, and a fuzz test
//! feeding random and mutated bytes to the loader.

use crate::common::*;
use ferrograd_core::{DType, Result, Rng, Tensor};
use ferrograd_nn::checkpoint::{self, CheckpointError, TrainState, FORMAT};
use ferrograd_nn::data::{DataLoader, LoaderConfig, TensorDataset};
use ferrograd_nn::optim::{adamw, Adam, LrSchedule, Optimizer, Sgd, SgdConfig};
use ferrograd_nn::trainer::{ProgressMode, Trainer, TrainerConfig};
use ferrograd_nn::*;
use proptest::prelude::*;
use std::sync::Arc;

fn small_model(seed: u64) -> Result<Sequential> {
    mlp(&[3, 5, 2], Activation::Tanh, &mut Rng::new(seed))
}

/// A model and an Adam optimizer after two steps, so every state tensor is non-zero.
fn trained(seed: u64) -> Result<(Sequential, Adam)> {
    let m = small_model(seed)?;
    let mut opt = Adam::new(m.named_parameters(), Default::default())?;
    let x = Tensor::randn_with(&mut Rng::new(9), 0.0, 1.0, (4, 3), DType::F32, CPU)?;
    for _ in 0..2 {
        opt.step(&m.forward(&x)?.sqr()?.mean_all()?.backward()?)?;
    }
    Ok((m, opt))
}

/// `m2` and `opt2` hold, bit for bit, what `m` and `opt` (trained two steps) saved.
fn assert_restored(m: &Sequential, opt: &Adam, m2: &Sequential, opt2: &Adam) {
    for ((n, a), (_, b)) in m.named_parameters().iter().zip(m2.named_parameters()) {
        assert_bits_eq(a, &b, n);
    }
    for ((n, a), (_, b)) in opt.state_tensors().iter().zip(opt2.state_tensors()) {
        assert_bits_eq(a, &b, n);
    }
    assert_eq!(opt2.step_count(), 2);
}

fn state() -> TrainState {
    let mut s = TrainState { step: 42, ..Default::default() };
    s.rngs.insert("dropout".into(), Rng { seed: u64::MAX - 3, offset: 1 << 40 });
    s.extra.insert("epoch".into(), "3".into());
    s
}

#[test]
fn the_same_state_is_always_the_same_bytes() -> std::result::Result<(), Box<dyn std::error::Error>> {
    // The header's metadata (format, step, rngs, optim, extra.*) once came out in HashMap order,
    // different for every save: two data-parallel ranks holding the same weights wrote different
    // files. Six entries have 720 orders, so twenty saves agree by chance with no sorting.
    let (m, opt) = trained(1)?;
    let first = checkpoint::to_bytes(&m, Some(&opt), &state(), "a")?;
    for _ in 0..20 {
        assert_eq!(checkpoint::to_bytes(&m, Some(&opt), &state(), "a")?, first);
    }
    // Still a valid file whose header lists its keys in order.
    let n = u64::from_le_bytes(first[..8].try_into().unwrap()) as usize;
    let header = std::str::from_utf8(&first[8..8 + n]).unwrap();
    let (f, s) = (header.find("\"format\"").unwrap(), header.find("\"step\"").unwrap());
    assert!(f < s, "{header}");
    let m2 = small_model(2)?;
    checkpoint::from_bytes(&first, "a", &m2, None)?;
    Ok(())
}

#[test]
fn round_trip_restores_everything_bitwise() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("ckpt.safetensors");
    let (m, opt) = trained(1)?;
    checkpoint::save(&path, &m, Some(&opt), &state())?;
    let names: Vec<_> =
        std::fs::read_dir(dir.path())?.map(|e| e.map(|e| e.file_name())).collect::<std::io::Result<_>>()?;
    assert_eq!(names, vec![std::ffi::OsString::from("ckpt.safetensors")], "no temporary files left");

    let m2 = small_model(2)?;
    let mut opt2 = Adam::new(m2.named_parameters(), Default::default())?;
    let ids: Vec<_> = m2.parameters().iter().map(|p| p.id()).collect();
    let st = checkpoint::load(&path, &m2, Some(&mut opt2))?;
    assert_eq!(st, state());
    assert_restored(&m, &opt, &m2, &opt2);
    assert_eq!(ids, m2.parameters().iter().map(|p| p.id()).collect::<Vec<_>>(), "parameters keep identity");

    // The file is a plain weights file too: loading without an optimizer ignores optim.* entries.
    let m3 = small_model(3)?;
    assert_eq!(checkpoint::load(&path, &m3, None)?.step, 42);
    assert_bits_eq(&m.parameters()[0], &m3.parameters()[0], "weights only");

    // Saving again replaces the file atomically.
    checkpoint::save(&path, &m3, None, &TrainState::default())?;
    assert_eq!(checkpoint::load(&path, &m2, None)?.step, 0);
    Ok(())
}

/// A file read with `load_safetensors` restores through `from_loaded` exactly as `load` restores
/// it, with the same checks: both share one implementation.
#[test]
fn from_loaded_restores_what_load_restores() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("ckpt.safetensors");
    let (m, opt) = trained(1)?;
    checkpoint::save(&path, &m, Some(&opt), &state())?;
    let quiet = checkpoint::ReadOptions { log: false, ..Default::default() };
    let loaded = checkpoint::load_safetensors_with(&path, CPU, quiet)?;

    let m2 = small_model(2)?;
    let mut opt2 = Adam::new(m2.named_parameters(), Default::default())?;
    let st = checkpoint::from_loaded(&loaded, &m2, Some(&mut opt2), Default::default())?;
    assert_eq!(st, state());
    assert_restored(&m, &opt, &m2, &opt2);

    // Two reads of one file, merged (the model's tensors and the optimizer's apart), are the file.
    let is_state = |n: &str| n.starts_with(checkpoint::OPTIM_PREFIX);
    let not_state = |n: &str| !is_state(n);
    let mut part =
        checkpoint::load_safetensors_with(&path, CPU, checkpoint::ReadOptions { only: Some(&not_state), ..quiet })?;
    let rest =
        checkpoint::load_safetensors_with(&path, CPU, checkpoint::ReadOptions { only: Some(&is_state), ..quiet })?;
    let m3 = small_model(3)?;
    let mut opt3 = Adam::new(m3.named_parameters(), Default::default())?;
    // Half a file misses the optimizer's tensors, named.
    let e = checkpoint::from_loaded(&part, &m3, Some(&mut opt3), Default::default()).unwrap_err();
    assert!(matches!(e, CheckpointError::Missing { .. }) && e.to_string().contains("ckpt.safetensors"), "{e}");
    part.tensors.extend(rest.tensors);
    checkpoint::from_loaded(&part, &m3, Some(&mut opt3), Default::default())?;
    assert_bits_eq(&m.parameters()[0], &m3.parameters()[0], "merged reads");

    // The same typed errors as the other paths: a shape that differs, a tensor the model lacks.
    let wide = mlp(&[3, 8, 2], Activation::Relu, &mut Rng::new(0))?;
    match checkpoint::from_loaded(&loaded, &wide, None, Default::default()) {
        Err(CheckpointError::Shape { name, path, .. }) => {
            assert_eq!(name, "0.weight");
            assert!(path.ends_with("ckpt.safetensors"), "{path}");
        }
        other => panic!("expected a shape error, got {other:?}"),
    }
    let lin = Linear::new(3, 5, true, &mut Rng::new(0), CPU)?;
    let e = checkpoint::from_loaded(&loaded, &lin, None, Default::default()).unwrap_err();
    assert!(matches!(e, CheckpointError::Missing { .. }), "{e}");
    Ok(())
}

/// Model with dropout, AdamW, cosine schedule, clipping, accumulation, shuffled loader.
struct Run {
    model: Sequential,
    dropout: SharedRng,
    trainer: Trainer<Adam>,
    loader: DataLoader,
}

fn run(seed: u64) -> Result<Run> {
    let mut rng = Rng::new(seed);
    let dropout = SharedRng::new(seed + 100);
    let model = Sequential::new()
        .add(Linear::new(4, 16, true, &mut rng, CPU)?)
        .add(Tanh)
        .add(Dropout::new(0.1, dropout.clone())?)
        .add(Linear::new(16, 1, true, &mut rng, CPU)?);
    let opt = adamw(model.named_parameters(), 1e-2, 0.01)?;
    let config = TrainerConfig {
        max_steps: 0,
        log_every: 1,
        grad_accum: 2,
        clip_grad_norm: Some(0.5),
        schedule: Some(LrSchedule::WarmupCosine { peak: 2e-2, warmup: 3, total: 12, min: 1e-3 }),
        progress: ProgressMode::Quiet,
        ..Default::default()
    };
    let (x, y) = regression_data(40, 4, 77)?;
    let ds = Arc::new(TensorDataset::new(vec![x, y])?);
    let loader = DataLoader::new(ds, LoaderConfig { batch_size: 6, shuffle: true, seed: 5, ..Default::default() })?;
    Ok(Run { model, dropout, trainer: Trainer::new(opt, config)?, loader })
}

fn fit_to(r: &mut Run, steps: u64) -> Result<Vec<(u64, f64)>> {
    r.trainer.config.max_steps = steps;
    let model = &r.model;
    Ok(r.trainer.fit(&r.loader, |b| model.forward(&b.tensors[0])?.mse_loss(&b.tensors[1]))?.losses)
}

#[test]
fn resume_continues_bit_identically() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("run.safetensors");
    let mut a = run(1)?;
    let first = fit_to(&mut a, 7)?;
    assert_eq!(first.len(), 7);
    let mut st = a.trainer.state();
    st.rngs.insert("dropout".into(), a.dropout.get());
    checkpoint::save(&path, &a.model, Some(&a.trainer.optimizer), &st)?;
    let rest_a = fit_to(&mut a, 12)?;

    let mut b = run(2)?; // different initial weights and dropout stream, all overwritten by load
    let st = checkpoint::load(&path, &b.model, Some(&mut b.trainer.optimizer))?;
    b.trainer.resume(&st)?;
    b.dropout.set(st.rngs["dropout"]);
    let rest_b = fit_to(&mut b, 12)?;

    assert_eq!(rest_a.len(), 5);
    let bits = |v: &[(u64, f64)]| v.iter().map(|(s, l)| (*s, l.to_bits())).collect::<Vec<_>>();
    assert_eq!(bits(&rest_a), bits(&rest_b), "loss curves after resuming:\n{rest_a:?}\n{rest_b:?}");
    for ((n, p), (_, q)) in a.model.named_parameters().iter().zip(b.model.named_parameters()) {
        assert_bits_eq(p, &q, n);
    }
    assert!(rest_a.last().map_or(0.0, |l| l.1) < first[0].1, "and it trains");
    Ok(())
}

fn saved_bytes(m: &dyn Module, opt: Option<&dyn Optimizer>) -> Result<Vec<u8>> {
    Ok(checkpoint::to_bytes(m, opt, &state(), "mem")?)
}

#[test]
fn wrong_shape_dtype_missing_unexpected_are_named() -> Result<()> {
    let wide = mlp(&[3, 8, 2], Activation::Relu, &mut Rng::new(0))?;
    let target = small_model(1)?;
    let before = vec_f32(&target.parameters()[0]);
    match checkpoint::from_bytes(&saved_bytes(&wide, None)?, "wide", &target, None) {
        Err(CheckpointError::Shape { name, expected, got, .. }) => {
            assert_eq!((name.as_str(), expected, got), ("0.weight", vec![5, 3], vec![8, 3]))
        }
        other => panic!("expected a shape error, got {other:?}"),
    }
    // A later mismatch (2.weight) leaves earlier tensors untouched: everything is checked first.
    let other_out = mlp(&[3, 5, 4], Activation::Relu, &mut Rng::new(0))?;
    let e = checkpoint::from_bytes(&saved_bytes(&other_out, None)?, "out", &target, None).unwrap_err();
    assert_eq!(e.tensor_name(), Some("2.weight"), "{e}");
    assert_eq!(vec_f32(&target.parameters()[0]), before);

    let f64_lin = Linear::from_tensors(Tensor::zeros((2, 3), DType::F64, CPU)?, None);
    let f32_lin = Linear::new(3, 2, false, &mut Rng::new(0), CPU)?;
    match checkpoint::from_bytes(&saved_bytes(&f64_lin, None)?, "f64", &f32_lin, None) {
        Err(e @ CheckpointError::DType { .. }) => {
            assert_eq!(e.tensor_name(), Some("weight"));
            assert!(e.to_string().contains("F64") && e.to_string().contains("f32"), "{e}");
        }
        other => panic!("expected a dtype error, got {other:?}"),
    }
    let with_bias = Linear::new(3, 2, true, &mut Rng::new(0), CPU)?;
    match checkpoint::from_bytes(&saved_bytes(&f32_lin, None)?, "nobias", &with_bias, None) {
        Err(CheckpointError::Missing { name, .. }) => assert_eq!(name, "bias"),
        other => panic!("expected a missing-tensor error, got {other:?}"),
    }
    match checkpoint::from_bytes(&saved_bytes(&with_bias, None)?, "bias", &f32_lin, None) {
        Err(CheckpointError::Unexpected { name, .. }) => assert_eq!(name, "bias"),
        other => panic!("expected an unexpected-tensor error, got {other:?}"),
    }
    // Core's error type carries the message (for code that uses `ferrograd_core::Result`).
    let core: ferrograd_core::Error = CheckpointError::Missing { path: "f".into(), name: "bias".into() }.into();
    assert!(
        matches!(&core, ferrograd_core::Error::File { path, msg } if path == "f" && msg.contains("bias")),
        "{core}"
    );
    Ok(())
}

#[test]
fn optimizer_state_mismatches_are_reported() -> Result<()> {
    let (m, adam) = trained(1)?;
    let bytes = saved_bytes(&m, Some(&adam))?;
    let mut sgd = Sgd::new(m.named_parameters(), SgdConfig { momentum: 0.9, ..Default::default() })?;
    let e = checkpoint::from_bytes(&bytes, "adam", &m, Some(&mut sgd)).unwrap_err();
    assert!(matches!(&e, CheckpointError::Metadata { key, .. } if key == "optim"), "{e}");
    let plain = saved_bytes(&m, None)?;
    let mut adam2 = Adam::new(m.named_parameters(), Default::default())?;
    let e = checkpoint::from_bytes(&plain, "plain", &m, Some(&mut adam2)).unwrap_err();
    assert!(e.to_string().contains("no optimizer state"), "{e}");
    Ok(())
}

#[test]
fn truncated_and_corrupt_files_give_typed_errors() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let (m, opt) = trained(1)?;
    let bytes = saved_bytes(&m, Some(&opt))?;
    let header_end = 8 + u64::from_le_bytes(bytes[..8].try_into()?) as usize;
    let fresh = || -> Result<(Sequential, Adam)> {
        let m = small_model(5)?;
        let o = Adam::new(m.named_parameters(), Default::default())?;
        Ok((m, o))
    };
    for cut in (0..bytes.len()).step_by(7).chain([bytes.len() - 1]) {
        let (m2, mut o2) = fresh()?;
        let e = checkpoint::from_bytes(&bytes[..cut], "cut", &m2, Some(&mut o2)).unwrap_err();
        if cut >= header_end {
            assert!(matches!(e, CheckpointError::Truncated { .. }), "cut at {cut}: {e}");
            assert!(e.tensor_name().is_some(), "names the tensor: {e}");
        } else {
            assert!(matches!(e, CheckpointError::Corrupt { .. }), "cut at {cut}: {e}");
        }
    }
    let mut garbled = bytes.clone();
    garbled[9] = b'#';
    let (m2, _) = fresh()?;
    assert!(matches!(checkpoint::from_bytes(&garbled, "g", &m2, None), Err(CheckpointError::Corrupt { .. })));

    // Bad metadata values name their key.
    let mut meta = std::collections::HashMap::new();
    meta.insert("format".to_string(), FORMAT.to_string());
    meta.insert("step".to_string(), "forty-two".to_string());
    let data = [0u8; 4 * 15];
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![5, 3], &data[..])
        .map_err(|e| format!("{e}"))?;
    let file = safetensors::serialize([("0.weight", view)], Some(meta)).map_err(|e| format!("{e}"))?;
    let lin = Linear::new(3, 5, false, &mut Rng::new(0), CPU)?;
    let wrapped = Sequential::new().add(lin);
    match checkpoint::from_bytes(&file, "meta", &wrapped, None) {
        Err(CheckpointError::Metadata { key, .. }) => assert_eq!(key, "step"),
        other => panic!("expected a metadata error, got {other:?}"),
    }

    let dir = tempfile::tempdir()?;
    let missing_dir = dir.path().join("no/such/dir/x.safetensors");
    assert!(matches!(checkpoint::save(&missing_dir, &m, None, &state()), Err(CheckpointError::Io { .. })));
    assert!(matches!(checkpoint::load(&missing_dir, &m, None), Err(CheckpointError::Io { .. })));
    Ok(())
}

fn valid_file() -> Vec<u8> {
    static FILE: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    FILE.get_or_init(|| {
        let (m, opt) = trained(1).expect("model");
        saved_bytes(&m, Some(&opt)).expect("bytes")
    })
    .clone()
}

/// Load into a fresh model and optimizer; any outcome but a panic is fine, and errors must say
/// something.
fn try_load(bytes: &[u8]) {
    let m = small_model(5).expect("model");
    let mut o = Adam::new(m.named_parameters(), Default::default()).expect("optimizer");
    if let Err(e) = checkpoint::from_bytes(bytes, "fuzz", &m, Some(&mut o)) {
        assert!(!e.to_string().is_empty());
    }
}

/// The same bytes as a file through `load_safetensors` (the path every device load starts with):
/// any outcome but a panic, and errors name the file.
fn try_load_file(bytes: &[u8]) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("fuzz.safetensors");
    std::fs::write(&path, bytes).expect("write");
    let quiet = checkpoint::ReadOptions { log: false, ..Default::default() };
    if let Err(e) = checkpoint::load_safetensors_with(&path, CPU, quiet) {
        assert!(e.to_string().contains("fuzz.safetensors"), "{e}");
    }
}

fn header_json() -> impl Strategy<Value = String> {
    let num = prop_oneof![0u64..64, any::<u64>(), Just(u64::MAX), Just(1u64 << 61)];
    let dtype = prop::sample::select(vec!["F32", "F64", "BF16", "U8", "I64", "BOOL", "F4", "nope"]);
    prop::collection::vec((dtype, prop::collection::vec(num.clone(), 0..3), num.clone(), num), 1..4).prop_map(|ts| {
        let body: Vec<String> = ts
            .iter()
            .enumerate()
            .map(|(i, (d, shape, s, e))| {
                let name = ["0.weight", "0.bias", "optim.state.0.weight.m"][i % 3];
                format!("\"{name}\":{{\"dtype\":\"{d}\",\"shape\":{shape:?},\"data_offsets\":[{s},{e}]}}")
            })
            .collect();
        format!("{{{}}}", body.join(","))
    })
}

/// Cases per property: 256, or `FERROGRAD_PROPTEST_CASES` (CI's bounded harness step runs more).
fn cases() -> u32 {
    std::env::var("FERROGRAD_PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(256)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..400)) {
        try_load(&bytes);
        try_load_file(&bytes);
    }

    #[test]
    fn mutated_files_never_panic(
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
        in_header in any::<bool>(),
        cut in prop::option::of(any::<prop::sample::Index>()),
    ) {
        let mut b = valid_file();
        let header_end = 8 + u64::from_le_bytes(b[..8].try_into().expect("8 bytes")) as usize;
        let span = if in_header { header_end } else { b.len() };
        for (i, v) in edits {
            let at = i.index(span);
            b[at] = v;
        }
        if let Some(c) = cut {
            let at = c.index(b.len());
            b.truncate(at);
        }
        try_load(&b);
        try_load_file(&b);
    }

    #[test]
    fn crafted_headers_never_panic(json in header_json(), data_len in 0usize..64) {
        let mut b = (json.len() as u64).to_le_bytes().to_vec();
        b.extend(json.as_bytes());
        b.extend(std::iter::repeat_n(0u8, data_len));
        try_load(&b);
        try_load_file(&b);
    }
}
