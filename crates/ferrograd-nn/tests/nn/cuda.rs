//! The same training code on a GPU: each test skips with one line when no GPU is usable.

use crate::common::*;
use ferrograd_core::{DType, Device, Result, Rng, Tensor};
use ferrograd_nn::amp::autocast;
use ferrograd_nn::data::{measure_overlap, DataLoader, LoaderConfig, OverlapConfig, OverlapReport, TensorDataset};
use ferrograd_nn::optim::{Adam, AdamConfig, Optimizer, Sgd, SgdConfig};
use ferrograd_nn::*;
use std::sync::Arc;

/// Losses of 50 full-batch Adam steps of a small MLP on `device`, from one seed.
fn loss_curve(device: Device) -> Result<Vec<f64>> {
    let model = mlp_on(&[4, 32, 32, 1], Activation::Tanh, &mut Rng::new(123), device)?;
    let (x, y) = regression_data(64, 4, 9)?;
    let (x, y) = (x.to_device(device)?, y.to_device(device)?);
    let mut opt = Adam::new(model.named_parameters(), AdamConfig { lr: 1e-2, ..Default::default() })?;
    let mut losses = Vec::with_capacity(50);
    for _ in 0..50 {
        let loss = model.forward(&x)?.mse_loss(&y)?;
        losses.push(loss.item_f64()?);
        opt.step(&loss.backward()?)?;
    }
    Ok(losses)
}

#[test]
fn cpu_and_cuda_loss_curves_agree() -> Result<()> {
    let Some(gpu) = cuda("cpu_and_cuda_loss_curves_agree") else { return Ok(()) };
    let (cpu, dev) = (loss_curve(CPU)?, loss_curve(gpu)?);
    for (i, (a, b)) in cpu.iter().zip(&dev).enumerate() {
        let rel = (a - b).abs() / a.abs().max(1e-12);
        assert!(rel < 1e-4, "step {i}: cpu {a} vs cuda {b} (rel {rel:e})");
    }
    eprintln!("loss {:.4} -> {:.4} on both devices", cpu[0], cpu[49]);
    assert!(cpu[49] < cpu[0] * 0.5);
    Ok(())
}

#[test]
fn cuda_learns_xor_and_regression() -> Result<()> {
    let Some(gpu) = cuda("cuda_learns_xor_and_regression") else { return Ok(()) };
    crate::learn::check_xor(gpu)?;
    let (before, after) = crate::learn::regression(gpu)?;
    eprintln!("cuda regression: mse {before:.4} -> {after:.2e}");
    assert!(before / after > 50.0, "mse {before} -> {after}");
    Ok(())
}

#[test]
fn cuda_optimizer_steps_match_hand_values() -> Result<()> {
    let Some(gpu) = cuda("cuda_optimizer_steps_match_hand_values") else { return Ok(()) };
    let p = Tensor::from_vec(vec![1f32, -2.0], 2, gpu)?.requires_grad();
    let mut sgd = Sgd::new(
        vec![("w".into(), p.clone())],
        SgdConfig { lr: 0.1, momentum: 0.9, nesterov: true, ..Default::default() },
    )?;
    let c = Tensor::from_vec(vec![0.5f32, 3.0], 2, gpu)?;
    for _ in 0..2 {
        sgd.step(&p.mul(&c)?.sum_all()?.backward()?)?;
    }
    assert_close(&vec_f32(&p), &[0.7695, -3.383], 1e-6, "nesterov on cuda");
    let q = Tensor::from_vec(vec![1f32, -2.0], 2, gpu)?.requires_grad();
    let mut adam = Adam::new(vec![("w".into(), q.clone())], AdamConfig { lr: 0.1, ..Default::default() })?;
    for _ in 0..2 {
        adam.step(&q.sqr()?.sum_all()?.mul_scalar(0.5)?.backward()?)?;
    }
    assert_close(&vec_f32(&q), &[0.8004122, -1.8001665], 1e-6, "adam on cuda");
    // 100 parameters: three launches of the fused kernel, same result as on the CPU.
    let make = |d: Device| -> Result<Vec<(String, Tensor)>> {
        let mut rng = Rng::new(5);
        (0..100)
            .map(|i| {
                Ok((format!("p{i}"), Tensor::randn_with(&mut rng, 0.0, 1.0, (3, 7), DType::F32, d)?.requires_grad()))
            })
            .collect()
    };
    let (pc, pg) = (make(CPU)?, make(gpu)?);
    for ps in [&pc, &pg] {
        let mut opt = optim::adamw(ps.clone(), 1e-2, 0.1)?;
        let loss = ps.iter().map(|(_, p)| p.sqr()?.sum_all()).collect::<Result<Vec<_>>>()?;
        let total = Tensor::stack(&loss, 0)?.sum_all()?;
        opt.step(&total.backward()?)?;
    }
    for ((n, a), (_, b)) in pc.iter().zip(&pg) {
        let want: Vec<f64> = vec_f32(a).iter().map(|&v| v as f64).collect();
        assert_close(&vec_f32(b), &want, 1e-6, n);
    }
    Ok(())
}

#[test]
fn cuda_loader_delivers_pinned_batches_on_device() -> Result<()> {
    let Some(gpu) = cuda("cuda_loader_delivers_pinned_batches_on_device") else { return Ok(()) };
    // Small batches pinned anyway (some share pages and fall back to pageable copies), and 2 MiB
    // batches pinned by the default threshold.
    for (n, d, batch_size, pin_min_bytes) in [(50, 3, 8, 0), (2048, 1024, 512, 1 << 20)] {
        let (x, y) = regression_data(n, d, 2)?;
        let ds = Arc::new(TensorDataset::new(vec![x, y])?);
        let cfg = LoaderConfig { batch_size, seed: 4, pin_min_bytes, ..Default::default() };
        let cpu = DataLoader::new(ds.clone(), cfg.clone())?;
        let dev = DataLoader::new(ds, LoaderConfig { device: gpu, ..cfg })?;
        for epoch in 0..3 {
            for (a, b) in cpu.epoch(epoch).zip(dev.epoch(epoch)) {
                let (a, b) = (a?, b?);
                assert_eq!((a.index, b.tensors[0].device()), (b.index, gpu));
                for (ta, tb) in a.tensors.iter().zip(&b.tensors) {
                    assert_bits_eq(ta, tb, "batch");
                }
            }
        }
    }
    Ok(())
}

#[test]
fn cuda_checkpoint_round_trip() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let Some(gpu) = cuda("cuda_checkpoint_round_trip") else { return Ok(()) };
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("gpu.safetensors");
    let m = mlp_on(&[3, 6, 2], Activation::Relu, &mut Rng::new(1), gpu)?;
    let mut opt = Adam::new(m.named_parameters(), Default::default())?;
    let x = Tensor::ones((4, 3), DType::F32, gpu)?;
    opt.step(&m.forward(&x)?.sqr()?.mean_all()?.backward()?)?;
    checkpoint::save(&path, &m, Some(&opt), &Default::default())?;
    let m2 = mlp_on(&[3, 6, 2], Activation::Relu, &mut Rng::new(2), gpu)?;
    let mut opt2 = Adam::new(m2.named_parameters(), Default::default())?;
    checkpoint::load(&path, &m2, Some(&mut opt2))?;
    for ((n, a), (_, b)) in opt.state_tensors().iter().zip(opt2.state_tensors()) {
        assert_bits_eq(a, &b, n);
    }
    // Continue one step on both: bit-identical on the same device.
    for (mm, oo) in [(&m, &mut opt), (&m2, &mut opt2)] {
        oo.step(&mm.forward(&x)?.sqr()?.mean_all()?.backward()?)?;
    }
    for ((n, a), (_, b)) in m.named_parameters().iter().zip(m2.named_parameters()) {
        assert_bits_eq(a, &b, n);
    }
    Ok(())
}

#[test]
fn cuda_autocast_bf16_close_to_f32() -> Result<()> {
    let Some(gpu) = cuda("cuda_autocast_bf16_close_to_f32") else { return Ok(()) };
    let model = mlp_on(&[64, 128, 16], Activation::Gelu, &mut Rng::new(3), gpu)?;
    let x = Tensor::randn_with(&mut Rng::new(4), 0.0, 1.0, (32, 64), DType::F32, gpu)?;
    let y32 = vec_f32(&model.forward(&x)?);
    let y16 = {
        let _g = autocast(DType::BF16)?;
        model.forward(&x)?
    };
    assert_eq!(y16.dtype(), DType::F32);
    let y16 = vec_f32(&y16);
    let num: f64 = y16.iter().zip(&y32).map(|(a, b)| (*a as f64 - *b as f64).powi(2)).sum();
    let den: f64 = y32.iter().map(|b| (*b as f64).powi(2)).sum();
    assert!((num / den).sqrt() < 2e-2, "bf16 rel err {}", (num / den).sqrt());
    Ok(())
}

/// max |a - b| / max |b|, in f64.
fn max_rel(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "lengths");
    let diff = a.iter().zip(b).map(|(x, y)| (*x as f64 - *y as f64).abs()).fold(0.0, f64::max);
    let scale = b.iter().map(|y| (*y as f64).abs()).fold(0.0, f64::max);
    if diff.is_nan() {
        f64::INFINITY
    } else {
        diff / scale.max(1e-30)
    }
}

/// `nn::Linear` in bf16 on the GPU, through the fused linear op (cuBLASLt epilogue): with bf16
/// parameters, and with f32 master parameters under a bf16 autocast scope (bias cast too, f32
/// gradients back). Output and every gradient against the same layer on the CPU; GELU (tanh) and
/// ReLU fused, 3-D input, sizes a multiple of 8 so the cuBLASLt path (not the fallback) runs.
#[test]
fn cuda_linear_bf16_matches_cpu() -> Result<()> {
    let Some(gpu) = cuda("cuda_linear_bf16_matches_cpu") else { return Ok(()) };
    let mut rng = Rng::new(21);
    let master = Linear::new(48, 40, true, &mut rng, CPU)?;
    let x = Tensor::randn_with(&mut rng, 0.0, 1.0, (3, 5, 48), DType::F32, CPU)?;
    let dy = Tensor::randn_with(&mut rng, 0.0, 1.0, (3, 5, 40), DType::F32, CPU)?;
    let bias = master.bias.as_ref().expect("bias");
    for act in [LinearActivation::GeluTanh, LinearActivation::Relu, LinearActivation::None] {
        for autocast_on in [false, true] {
            // One dtype for the run: bf16 everywhere, or f32 tensors with bf16 inside the layer.
            let d = if autocast_on { DType::F32 } else { DType::BF16 };
            let run = |dev: Device| -> Result<Vec<Vec<f32>>> {
                let l = Linear::from_tensors(
                    master.weight.to_dtype(d)?.to_device(dev)?.detach(),
                    Some(bias.to_dtype(d)?.to_device(dev)?.detach()),
                );
                let xv = x.to_dtype(d)?.to_device(dev)?.requires_grad();
                let y = {
                    let _g = autocast_on.then(|| autocast(DType::BF16)).transpose()?;
                    l.forward_act(&xv, act)?
                };
                assert_eq!(y.dtype(), d, "{act:?} autocast={autocast_on}: output dtype");
                let g = y.backward_with(&dy.to_dtype(d)?.to_device(dev)?)?;
                let mut out = vec![vec_f32(&y)];
                for t in [&xv, &l.weight, l.bias.as_ref().expect("bias")] {
                    let gt = g.get(t).expect("gradient");
                    assert_eq!((gt.dtype(), gt.device()), (d, dev), "{act:?} autocast={autocast_on}: gradient");
                    out.push(vec_f32(gt));
                }
                Ok(out)
            };
            let (want, got) = (run(CPU)?, run(gpu)?);
            for (name, (c, g)) in ["y", "dx", "dw", "db"].iter().zip(want.iter().zip(&got)) {
                let e = max_rel(g, c);
                // bf16 rounding of the output (2^-8) and of dz, f32 accumulation in another order.
                assert!(e <= 1.6e-2, "{act:?} autocast={autocast_on} {name}: max rel err {e:e}");
            }
        }
    }
    Ok(())
}

#[test]
fn overlap_efficiency_formula_and_measurement() -> Result<()> {
    // Perfect hiding, none, and half.
    assert_eq!(OverlapReport::efficiency_of(4.0, 2.0, 4.0), 1.0);
    assert_eq!(OverlapReport::efficiency_of(4.0, 2.0, 6.0), 0.0);
    assert_eq!(OverlapReport::efficiency_of(4.0, 2.0, 5.0), 0.5);
    assert_eq!(OverlapReport::efficiency_of(0.0, 2.0, 2.0), 0.0);
    assert!(measure_overlap(CPU, &OverlapConfig::default()).is_err(), "nothing to overlap on the CPU");
    let Some(gpu) = cuda("overlap_efficiency_formula_and_measurement") else { return Ok(()) };
    let cfg = OverlapConfig {
        matmul_size: 1024,
        matmuls: 4,
        transfer_bytes: 16 << 20,
        warmup: 2,
        iters: 5,
        ..Default::default()
    };
    for cfg in [cfg, OverlapConfig::default()] {
        let r = measure_overlap(gpu, &cfg)?;
        eprintln!("overlap: {}", serde_json::to_string(&r).unwrap_or_default());
        assert!(r.compute_ms > 0.0 && r.transfer_ms > 0.0 && r.overlapped_ms > 0.0 && r.efficiency.is_finite());
    }
    Ok(())
}

/// One eager training step through nn's own pieces (layers, `clip_grad_norm`, AdamW) after two
/// warm-up steps: the host waits it makes, by driver call name (`ferrograd_core::cuda::SyncCounter`).
/// With `embedding`, token ids go through an `Embedding` and the loss is cross entropy.
fn host_waits_of_an_nn_step(device: Device, embedding: bool) -> Result<Vec<(&'static str, u64)>> {
    const VOCAB: usize = 50;
    const CLASSES: usize = 10;
    const BATCH: usize = 64;
    let mut rng = Rng::new(21);
    let embed = if embedding { Some(Embedding::new(VOCAB, 16, &mut rng, device)?) } else { None };
    let out = if embedding { CLASSES } else { 1 };
    let model = mlp_on(&[16, 48, 48, out], Activation::Relu, &mut rng, device)?;
    let mut named = model.named_parameters();
    if let Some(e) = &embed {
        named.extend(e.named_parameters().into_iter().map(|(k, v)| (format!("embed.{k}"), v)));
    }
    let params: Vec<Tensor> = named.iter().map(|(_, p)| p.clone()).collect();
    let mut opt = ferrograd_nn::optim::adamw(named, 3e-3, 0.01)?;
    let batch = |rng: &mut Rng| -> Result<(Tensor, Tensor)> {
        if embedding {
            let ids = |k: usize, rng: &mut Rng| {
                Tensor::rand_with(rng, 0.0, k as f64, BATCH, DType::F32, CPU)?.to_dtype(DType::U32)?.to_device(device)
            };
            Ok((ids(VOCAB, rng)?, ids(CLASSES, rng)?))
        } else {
            let x = Tensor::randn_with(rng, 0.0, 1.0, (BATCH, 16), DType::F32, device)?;
            let y = x.sum(1, true)?.tanh()?;
            Ok((x, y))
        }
    };
    let data = (0..3).map(|_| batch(&mut rng)).collect::<Result<Vec<_>>>()?;
    let step = |opt: &mut ferrograd_nn::optim::Adam, x: &Tensor, y: &Tensor| -> Result<Tensor> {
        let loss = match &embed {
            Some(e) => model.forward(&e.forward(x)?)?.cross_entropy(y, None)?,
            None => model.forward(x)?.mse_loss(y)?,
        };
        let mut grads = loss.backward()?;
        ferrograd_nn::optim::clip_grad_norm(&mut grads, &params, 1.0)?;
        opt.step(&grads)?;
        Ok(loss.detach())
    };
    for (x, y) in &data[..2] {
        step(&mut opt, x, y)?;
    }
    if let Device::Cuda(i) = device {
        ferrograd_core::cuda::CudaDevice::get(i)?.synchronize()?;
    }
    let counter = ferrograd_core::cuda::SyncCounter::start();
    let loss = step(&mut opt, &data[2].0, &data[2].1)?;
    let calls = counter.calls();
    assert!(loss.item_f64()?.is_finite());
    Ok(calls)
}

#[test]
fn cuda_nn_mlp_step_with_clip_and_adamw_makes_no_host_wait() -> Result<()> {
    let Some(gpu) = cuda("cuda_nn_mlp_step_with_clip_and_adamw_makes_no_host_wait") else { return Ok(()) };
    let calls = host_waits_of_an_nn_step(gpu, false)?;
    assert!(calls.is_empty(), "a warmed-up nn training step made host-waiting driver calls: {calls:?}");
    Ok(())
}

#[test]
fn cuda_nn_embedding_cross_entropy_step_makes_no_host_wait() -> Result<()> {
    let Some(gpu) = cuda("cuda_nn_embedding_cross_entropy_step_makes_no_host_wait") else { return Ok(()) };
    let calls = host_waits_of_an_nn_step(gpu, true)?;
    assert!(calls.is_empty(), "a warmed-up embedding + cross-entropy step made host-waiting driver calls: {calls:?}");
    Ok(())
}

/// The same step on the CPU (no driver, so nothing is counted): keeps the test model exercised
/// where no GPU is.
#[test]
fn nn_step_counter_runs_on_the_cpu() -> Result<()> {
    for embedding in [false, true] {
        assert_eq!(host_waits_of_an_nn_step(CPU, embedding)?, vec![], "embedding {embedding}");
    }
    Ok(())
}
