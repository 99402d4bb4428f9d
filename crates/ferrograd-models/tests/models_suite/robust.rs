//! Monster Walk on bad input (issue 11): non-finite `--init` weights are refused unless allowed,
//! training stops at the first non-finite loss naming the step (or skips such steps), batches and
//! plans that cannot be honoured are errors before any work, and the weights file stays exactly
//! what the PyTorch twin (`bench/monster_walk_torch.py`) reads and writes.

use ferrograd_core::{Device, Error, Result, Tensor};
use ferrograd_models::monster_walk::model::LAYERS;
use ferrograd_models::monster_walk::{run, Autoencoder, PlanRequest, TrainConfig};
use std::path::{Path, PathBuf};

fn dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("fg-mw-robust-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

fn cfg(init: Option<&Path>) -> TrainConfig {
    TrainConfig {
        plan: PlanRequest::Copies(1),
        epochs: 2,
        init: init.map(Path::to_path_buf),
        ..TrainConfig::spec_defaults(Device::Cpu)
    }
}

/// Seed-1 weights with element `at` of tensor `layer` (0.weight = 0, 0.bias = 1, ...) set to `v`.
fn weights_with(path: &Path, layer: usize, at: usize, v: f32) -> Result<()> {
    let m = Autoencoder::init(1, Device::Cpu)?;
    let p = &m.parameters()[layer];
    let mut data = p.to_vec::<f32>()?;
    data[at] = v;
    p.set(&Tensor::from_vec(data, p.dims().to_vec(), Device::Cpu)?)?;
    m.save(path)
}

#[test]
fn non_finite_init_weights_are_refused_unless_allowed() -> Result<()> {
    let d = dir("init");
    for (layer, v, name) in [(0, f32::NAN, "0.weight"), (1, f32::INFINITY, "0.bias")] {
        let p = d.join(format!("bad-{layer}.safetensors"));
        weights_with(&p, layer, 3, v)?;
        let e = run(&cfg(Some(&p)), |_| {}).unwrap_err();
        assert!(matches!(e, Error::NonFinite { index: 3, .. }), "{e}");
        assert!(e.to_string().contains(name), "{e}");
        // Allowed in, the first step's loss is not finite and training stops there (issue 11: an
        // inf bias trained 20 epochs of inf/NaN and exited 0, saving NaN weights).
        let c = TrainConfig { allow_nonfinite: true, save: Some(d.join("out.safetensors")), ..cfg(Some(&p)) };
        let e = run(&c, |_| {}).unwrap_err();
        assert!(matches!(e, Error::NonFiniteLoss { step: 1, epoch: 1, .. }), "{e}");
        assert!(!d.join("out.safetensors").exists(), "nothing saved from a failed run");
    }
    std::fs::remove_dir_all(&d)?;
    Ok(())
}

#[test]
fn huge_finite_weights_stop_at_the_first_infinite_loss_or_are_skipped() -> Result<()> {
    let d = dir("huge");
    let p = d.join("big.safetensors");
    weights_with(&p, 0, 0, 1e38)?;
    let e = run(&cfg(Some(&p)), |_| {}).unwrap_err().to_string();
    assert!(e.contains("at step 1 (epoch 1)") && e.contains("--skip-nonfinite"), "{e}");
    // Skipping undoes every step here (the weights never change), which is an error too.
    let e = run(&TrainConfig { skip_nonfinite: true, ..cfg(Some(&p)) }, |_| {}).unwrap_err().to_string();
    assert!(e.contains("every step of epoch 1"), "{e}");
    std::fs::remove_dir_all(&d)?;
    Ok(())
}

#[test]
fn impossible_batches_and_plans_are_errors_before_any_work() {
    // Issue 11: `--batch 99999999` trained with 5041 and reported 99999999.
    let e = run(&TrainConfig { batch: 99_999_999, ..cfg(None) }, |_| {}).unwrap_err().to_string();
    assert!(e.contains("--batch 99999999") && e.contains("5041"), "{e}");
    // `--copies u64::MAX`: capacity overflow (exit 101) before; now a typed error at once.
    let e = run(&TrainConfig { plan: PlanRequest::Copies(usize::MAX), ..cfg(None) }, |_| {}).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("far too large"), "{e}");
    // `--copies 1000` (100 GiB) or `--budget 1000TB` on a small machine: aborts and OOM kills
    // before; now refused up front with the figures (unless this machine really has the room).
    for plan in [PlanRequest::Copies(1_000_000), PlanRequest::Budget(1_000_000_000_000_000)] {
        let e = run(&TrainConfig { plan, ..cfg(None) }, |_| {}).unwrap_err();
        assert!(matches!(e, Error::HostOutOfMemory { available: Some(_), .. }), "{e}");
        assert!(e.to_string().contains("monster-walk's plan"), "{e}");
    }
}

#[test]
fn the_weights_file_is_the_pytorch_twins() -> Result<()> {
    let d = dir("twin");
    let p = d.join("w.safetensors");
    let m = Autoencoder::init(7, Device::Cpu)?;
    m.save(&p)?;
    // Plain safetensors: nn.Sequential names, F32, [out, in] weights, no optimizer entries.
    let bytes = std::fs::read(&p)?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| Error::InvalidArgument(e.to_string()))?;
    let mut names: Vec<String> = st.names().into_iter().map(String::from).collect();
    names.sort();
    let mut want = Autoencoder::names();
    want.sort();
    assert_eq!(names, want);
    for (i, &(fan_in, fan_out)) in LAYERS.iter().enumerate() {
        let w = st.tensor(&format!("{}.weight", 2 * i)).map_err(|e| Error::InvalidArgument(e.to_string()))?;
        assert_eq!((w.dtype(), w.shape()), (safetensors::Dtype::F32, &[fan_out, fan_in][..]));
        let b = st.tensor(&format!("{}.bias", 2 * i)).map_err(|e| Error::InvalidArgument(e.to_string()))?;
        assert_eq!(b.shape(), &[fan_out]);
    }
    // A file as `save_file(model.state_dict())` writes it (no metadata at all) loads too.
    let views: Vec<(String, Vec<u8>, Vec<usize>)> = Autoencoder::names()
        .into_iter()
        .zip(m.parameters())
        .map(|(n, t)| Ok((n, t.to_vec::<f32>()?.iter().flat_map(|x| x.to_le_bytes()).collect(), t.dims().to_vec())))
        .collect::<Result<_>>()?;
    let tv = views
        .iter()
        .map(|(n, b, s)| {
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b).map(|v| (n.clone(), v))
        })
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| Error::InvalidArgument(e.to_string()))?;
    let plain = safetensors::serialize(tv, None).map_err(|e| Error::InvalidArgument(e.to_string()))?;
    let torch_like = d.join("torch.safetensors");
    std::fs::write(&torch_like, plain)?;
    let back = Autoencoder::load(&torch_like, Device::Cpu)?;
    for (a, b) in m.parameters().iter().zip(back.parameters()) {
        assert_eq!(a.to_vec::<f32>()?, b.to_vec::<f32>()?);
    }
    // Seeded init is the draw it always was: per layer, weight then bias, uniform in
    // ±1/sqrt(fan_in) from one Philox stream (so `--seed N` runs reproduce earlier results).
    let mut rng = ferrograd_core::Rng::new(0);
    let b = 1.0 / 71f64.sqrt();
    let w0 = Tensor::rand_with(&mut rng, -b, b, (47, 71), ferrograd_core::DType::F32, Device::Cpu)?;
    assert_eq!(Autoencoder::init(0, Device::Cpu)?.parameters()[0].to_vec::<f32>()?, w0.to_vec::<f32>()?);
    std::fs::remove_dir_all(&d)?;
    Ok(())
}
