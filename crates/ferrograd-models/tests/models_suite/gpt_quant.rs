//! int8 GPT-2 (issue 18) on the CPU, and on CUDA where a GPU is usable: a quantized model's logits
//! within a stated tolerance of the float model's, QAT's forward equal to W8A8 inference, QAT
//! gradients, the int8 file's round trip and its errors, the KV-cache decode in int8.

use crate::common;

use common::gpu;
use ferrograd_core::cuda::set_poison_allocations;
use ferrograd_core::{DType, Device, Error, Result, Rng, Tensor};
use ferrograd_models::gpt::quant::{
    self, drop_float_projections, int8_bytes, is_int8_file, load_int8, save_int8, Linears, QuantMode,
};
use ferrograd_models::gpt::sample::Decoder;
use ferrograd_models::gpt::{Gpt, GptConfig};

/// Two layers, 4 heads of 16, a small vocabulary: fast on the CPU, its head dim one the CUDA
/// attention kernels are built for.
fn small() -> GptConfig {
    GptConfig { vocab_size: 96, n_positions: 32, n_layer: 2, n_head: 4, n_embd: 64, layer_norm_epsilon: 1e-5 }
}

/// A model whose weights are not GPT-2's tiny init: N(0, 0.02) plus a few larger values per
/// projection, so that per-channel ranges differ (what per-channel scales are for) and the logits
/// are far from zero.
fn model(device: Device) -> Result<Gpt> {
    let m = Gpt::new(small(), 7, device)?;
    let mut rng = Rng::new(11);
    for (i, b) in m.blocks.iter().enumerate() {
        for (j, w) in [&b.c_attn_w, &b.attn_proj_w, &b.c_fc_w, &b.mlp_proj_w].into_iter().enumerate() {
            let v = Tensor::randn_with(&mut rng, 0.0, 0.15, w.shape().clone(), DType::F32, Device::Cpu)?;
            let wide = w.to_device(Device::Cpu)?.mul_scalar(4.0)?.add(&v.mul_scalar(0.3 + 0.1 * (i + j) as f64)?)?;
            w.set(&wide.to_device(device)?)?;
        }
    }
    Ok(m)
}

fn ids(device: Device) -> Result<Tensor> {
    let v: Vec<u32> = (0..2 * 24).map(|i| ((i * 37 + 11) % 96) as u32).collect();
    Tensor::from_vec(v, (2, 24), device)
}

fn values(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64).unwrap().to_device(Device::Cpu).unwrap().to_vec::<f64>().unwrap()
}

/// `||a - b|| / ||b||`
fn rel(a: &[f64], b: &[f64]) -> f64 {
    let d: f64 = a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum();
    let n: f64 = b.iter().map(|y| y * y).sum();
    (d / n).sqrt()
}

fn logits_in(m: &mut Gpt, linears: Linears) -> Result<Vec<f64>> {
    m.linears = linears;
    let _g = ferrograd_core::no_grad();
    Ok(values(&m.logits(&ids(m.device())?)?))
}

fn int8(m: &mut Gpt, mode: QuantMode) -> Result<Linears> {
    quant::quantize(m, mode)?;
    Ok(std::mem::take(&mut m.linears))
}

/// The stated tolerance: int8 logits (f32 activations) within 3% (relative L2) of the float
/// model's, and not equal to them (the int8 path ran).
const LOGITS_TOL: f64 = 0.03;

#[test]
fn int8_logits_are_within_the_stated_tolerance_of_the_float_models() -> Result<()> {
    let mut m = model(Device::Cpu)?;
    let float = logits_in(&mut m, Linears::Float)?;
    let scale = float.iter().fold(0.0f64, |a, v| a.max(v.abs()));
    assert!(scale > 0.1, "logits too small to test with: max {scale}");
    for mode in [QuantMode::W8A16, QuantMode::W8A8] {
        let l = int8(&mut m, mode)?;
        let q = logits_in(&mut m, l)?;
        let e = rel(&q, &float);
        println!("{mode}: relative L2 error of the logits {e:.5}");
        assert!(e < LOGITS_TOL && e > 1e-5, "{mode}: relative error {e}");
    }
    Ok(())
}

#[test]
fn qat_forward_is_what_w8a8_inference_computes() -> Result<()> {
    let mut m = model(Device::Cpu)?;
    let float = logits_in(&mut m, Linears::Float)?;
    let l = int8(&mut m, QuantMode::W8A8)?;
    let w8a8 = logits_in(&mut m, l)?;
    let qat = logits_in(&mut m, Linears::Qat)?;
    let (e_qat, e_float) = (rel(&qat, &w8a8), rel(&float, &w8a8));
    println!("QAT vs W8A8 {e_qat:.2e}, float vs W8A8 {e_float:.2e}");
    // Same integers, different float association (and the odd rounding tie): far closer to W8A8
    // than the float model is.
    assert!(e_qat < 0.02 * e_float, "QAT {e_qat} vs float {e_float}");
    Ok(())
}

#[test]
fn qat_gradients_pass_straight_through_to_every_weight() -> Result<()> {
    let mut m = model(Device::Cpu)?;
    m.linears = Linears::Qat;
    let x = ids(Device::Cpu)?;
    let y = Tensor::from_vec((0..48u32).map(|i| (i * 5 + 3) % 96).collect::<Vec<_>>(), (2, 24), Device::Cpu)?;
    let loss = m.loss(&x, &y)?;
    let g = loss.backward()?;
    for (name, p) in m.params() {
        let gp = g.get(&p).ok_or_else(|| Error::InvalidArgument(format!("no gradient for {name}")))?;
        let v = values(gp);
        assert!(v.iter().all(|x| x.is_finite()), "{name}: non-finite gradient");
        if name.contains("c_attn.weight") || name.contains("c_fc.weight") || name.contains("c_proj.weight") {
            assert!(v.iter().any(|x| *x != 0.0), "{name}: zero gradient");
        }
    }
    Ok(())
}

#[test]
fn the_int8_file_round_trips_exactly_and_is_four_times_smaller() -> Result<()> {
    let dir = tempfile::tempdir().map_err(|e| Error::InvalidArgument(e.to_string()))?;
    let path = dir.path().join("int8.safetensors");
    let mut m = model(Device::Cpu)?;
    let proj_f32: usize = m
        .blocks
        .iter()
        .map(|b| {
            4 * (b.c_attn_w.elem_count()
                + b.attn_proj_w.elem_count()
                + b.c_fc_w.elem_count()
                + b.mlp_proj_w.elem_count())
        })
        .sum();
    quant::quantize(&mut m, QuantMode::W8A8)?;
    let sizes = save_int8(&m, &path)?;
    assert!(is_int8_file(&path));
    let ratio = proj_f32 as f64 / sizes.int8_bytes as f64;
    assert!(ratio > 3.7 && ratio < 4.0, "projection weights {proj_f32} -> {} bytes ({ratio:.2}x)", sizes.int8_bytes);
    let l = m.linears.clone();
    let before = logits_in(&mut m, l)?;
    let mut back = load_int8(&path, Device::Cpu, None)?;
    let (Linears::Int8 { mode: ma, blocks: a }, Linears::Int8 { mode: mb, blocks: b }) = (&m.linears, &back.linears)
    else {
        panic!("not int8 after loading");
    };
    assert_eq!((ma, mb), (&QuantMode::W8A8, &QuantMode::W8A8));
    for (x, y) in a.iter().zip(b) {
        for (p, q) in
            [(&x.c_attn, &y.c_attn), (&x.attn_proj, &y.attn_proj), (&x.c_fc, &y.c_fc), (&x.mlp_proj, &y.mlp_proj)]
        {
            assert_eq!(p.q.to_vec::<i8>()?, q.q.to_vec::<i8>()?);
            assert_eq!(p.scale.to_vec::<f32>()?, q.scale.to_vec::<f32>()?);
        }
    }
    // The float projections are gone; the rest is as it was.
    assert!(back.blocks.iter().all(|b| b.c_fc_w.elem_count() == 0));
    for ((n, p), (_, q)) in m.hf_params()?.iter().zip(back.hf_params()?.iter()) {
        if q.elem_count() > 0 {
            assert_eq!(values(p), values(q), "{n}");
        }
    }
    let l = back.linears.clone();
    let after = logits_in(&mut back, l)?;
    assert_eq!(before, after);
    // The same file runs as W8A16 when asked (the int8 weights serve both modes).
    let w16 = load_int8(&path, Device::Cpu, Some(QuantMode::W8A16))?;
    assert!(matches!(w16.linears, Linears::Int8 { mode: QuantMode::W8A16, .. }));
    // Writing it again gives the same bytes.
    assert_eq!(int8_bytes(&back)?.0, std::fs::read(&path).map_err(|e| Error::InvalidArgument(e.to_string()))?);
    Ok(())
}

#[test]
fn int8_files_and_modes_refuse_bad_input_with_typed_errors() -> Result<()> {
    let dir = tempfile::tempdir().map_err(|e| Error::InvalidArgument(e.to_string()))?;
    let mut m = model(Device::Cpu)?;
    // Not quantized: nothing to write, nothing to drop.
    assert!(matches!(int8_bytes(&m), Err(Error::InvalidArgument(_))));
    assert!(matches!(drop_float_projections(&mut m), Err(Error::InvalidArgument(_))));
    assert!(matches!("w4a4".parse::<QuantMode>(), Err(Error::InvalidArgument(s)) if s.contains("w4a4")));
    // A float file is not an int8 file.
    let float = dir.path().join("float.safetensors");
    ferrograd_models::gpt::hf::save_weights(&m, &float)?;
    assert!(!is_int8_file(&float));
    let e = load_int8(&float, Device::Cpu, None).unwrap_err();
    assert!(matches!(&e, Error::File { msg, .. } if msg.contains("not an int8")), "{e}");
    // Missing, truncated, or with a tensor of the wrong dtype.
    let e = load_int8(&dir.path().join("nope"), Device::Cpu, None).unwrap_err();
    assert!(matches!(e, Error::File { .. }), "{e}");
    quant::quantize(&mut m, QuantMode::W8A16)?;
    let (bytes, _) = int8_bytes(&m)?;
    let cut = dir.path().join("cut.safetensors");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).map_err(|e| Error::InvalidArgument(e.to_string()))?;
    let e = load_int8(&cut, Device::Cpu, None).unwrap_err();
    assert!(matches!(e, Error::File { .. }), "{e}");
    // An i8 tensor relabelled as u8 in the header (same length: the offsets stay valid).
    let n = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap_or_default()) as usize;
    let header = String::from_utf8_lossy(&bytes[8..n]).replacen("\"I8\"", "\"U8\"", 1);
    assert_eq!(header.len(), n - 8);
    let mut bad = bytes[..8].to_vec();
    bad.extend_from_slice(header.as_bytes());
    bad.extend_from_slice(&bytes[n..]);
    let tampered = dir.path().join("tampered.safetensors");
    std::fs::write(&tampered, bad).map_err(|e| Error::InvalidArgument(e.to_string()))?;
    let e = load_int8(&tampered, Device::Cpu, None).unwrap_err();
    assert!(matches!(&e, Error::File { msg, .. } if msg.contains("_int8") && msg.contains("expected I8")), "{e}");
    Ok(())
}

#[test]
fn int8_decode_with_the_kv_cache_matches_the_full_forward() -> Result<()> {
    let mut m = model(Device::Cpu)?;
    quant::quantize(&mut m, QuantMode::W8A8)?;
    drop_float_projections(&mut m)?;
    let _g = ferrograd_core::no_grad();
    let prompt: Vec<u32> = vec![5, 17, 40, 3, 88, 9];
    let full = values(&m.logits(&Tensor::from_vec(prompt.clone(), (1, 6), Device::Cpu)?)?);
    let last = &full[5 * 96..];
    let mut d = Decoder::new(&m, 16)?;
    let pre = values(&d.prefill(&prompt[..5])?);
    assert!(rel(&pre, &full[4 * 96..5 * 96]) < 1e-5);
    let step = values(&d.step(prompt[5])?);
    let e = rel(&step, last);
    assert!(e < 1e-5, "decode vs full forward {e}");
    Ok(())
}

// ---- CUDA (passes with a line where no GPU is usable) -------------------------------------------

#[test]
fn cuda_int8_gpt_agrees_with_the_cpu_in_f32_and_stays_close_in_bf16() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    set_poison_allocations(true);
    for mode in [QuantMode::W8A16, QuantMode::W8A8] {
        let mut cpu = model(Device::Cpu)?;
        let mut cuda = model(dev)?;
        let float = logits_in(&mut cpu, Linears::Float)?;
        let (lc, lg) = (int8(&mut cpu, mode)?, int8(&mut cuda, mode)?);
        let a = logits_in(&mut cpu, lc)?;
        let b = logits_in(&mut cuda, lg.clone())?;
        let e = rel(&b, &a);
        println!("{mode}: CUDA vs CPU {e:.2e}");
        assert!(e < 1e-3, "{mode}: CUDA vs CPU {e}");
        let bf16 = {
            let _ac = ferrograd_nn::amp::autocast(DType::BF16)?;
            logits_in(&mut cuda, lg)?
        };
        let e = rel(&bf16, &float);
        println!("{mode} bf16 on CUDA vs float {e:.4}");
        assert!(e < 2.0 * LOGITS_TOL, "{mode} bf16: {e}");
    }
    set_poison_allocations(false);
    Ok(())
}

#[test]
fn cuda_qat_step_has_finite_gradients() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let mut m = model(dev)?;
    m.linears = Linears::Qat;
    let _ac = ferrograd_nn::amp::autocast(DType::BF16)?;
    let x = ids(dev)?;
    let loss = m.loss(&x, &x)?;
    let g = loss.backward()?;
    for (name, p) in m.params() {
        let gp = g.get(&p).ok_or_else(|| Error::InvalidArgument(format!("no gradient for {name}")))?;
        assert!(values(gp).iter().all(|v| v.is_finite()), "{name}");
    }
    Ok(())
}
