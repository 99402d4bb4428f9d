//! Each optimizer against numbers worked out by hand from its formula on a two-element parameter,
//! plus accumulation, clipping and schedules.

use crate::common::*;
use ferrograd_core::{DType, GradStore, Result, Tensor};
use ferrograd_nn::optim::*;

fn param(v: &[f32]) -> Result<Tensor> {
    Ok(Tensor::from_slice(v, v.len(), CPU)?.requires_grad())
}

/// Gradient of `sum(p * c)`: the constant `c` = [0.5, 3.0].
fn linear_grads(p: &Tensor) -> Result<GradStore> {
    let c = Tensor::from_vec(vec![0.5f32, 3.0], 2, CPU)?;
    p.mul(&c)?.sum_all()?.backward()
}

/// Gradient of `sum(p^2) / 2`: `p` itself.
fn quadratic_grads(p: &Tensor) -> Result<GradStore> {
    p.sqr()?.sum_all()?.mul_scalar(0.5)?.backward()
}

fn named(p: &Tensor) -> Vec<(String, Tensor)> {
    vec![("w".to_string(), p.clone())]
}

#[test]
fn sgd_plain_and_weight_decay() -> Result<()> {
    let p = param(&[1.0, -2.0])?;
    let mut opt = Sgd::new(named(&p), SgdConfig { lr: 0.1, ..Default::default() })?;
    opt.step(&linear_grads(&p)?)?;
    // p - lr * c = [1 - 0.05, -2 - 0.3]
    assert_close(&vec_f32(&p), &[0.95, -2.3], 1e-7, "sgd");

    let p = param(&[1.0, -2.0])?;
    let mut opt = Sgd::new(named(&p), SgdConfig { lr: 0.1, weight_decay: 0.1, ..Default::default() })?;
    opt.step(&linear_grads(&p)?)?;
    // g = c + 0.1 p = [0.6, 2.8]; p - 0.1 g = [0.94, -2.28]
    assert_close(&vec_f32(&p), &[0.94, -2.28], 1e-7, "sgd wd");
    assert_eq!(opt.step_count(), 1);
    assert!(opt.state_tensors().is_empty(), "no momentum, no buffers");
    Ok(())
}

#[test]
fn sgd_momentum_two_steps() -> Result<()> {
    let p = param(&[1.0, -2.0])?;
    let mut opt = Sgd::new(named(&p), SgdConfig { lr: 0.1, momentum: 0.9, ..Default::default() })?;
    opt.step(&linear_grads(&p)?)?;
    // step 1: buf = c; p = p - 0.1 c = [0.95, -2.3]
    assert_close(&vec_f32(&p), &[0.95, -2.3], 1e-7, "momentum step 1");
    opt.step(&linear_grads(&p)?)?;
    // step 2: buf = 0.9 c + c = 1.9 c = [0.95, 5.7]; p = [0.95 - 0.095, -2.3 - 0.57]
    assert_close(&vec_f32(&p), &[0.855, -2.87], 1e-6, "momentum step 2");
    assert_close(&vec_f32(&opt.state_tensors()[0].1), &[0.95, 5.7], 1e-6, "buffer");
    assert_eq!(opt.state_tensors()[0].0, "w.momentum_buffer");
    Ok(())
}

#[test]
fn sgd_nesterov_two_steps() -> Result<()> {
    let p = param(&[1.0, -2.0])?;
    let mut opt = Sgd::new(named(&p), SgdConfig { lr: 0.1, momentum: 0.9, nesterov: true, ..Default::default() })?;
    opt.step(&linear_grads(&p)?)?;
    // step 1: buf = c; g = c + 0.9 buf = 1.9 c; p = [1 - 0.095, -2 - 0.57]
    assert_close(&vec_f32(&p), &[0.905, -2.57], 1e-6, "nesterov step 1");
    opt.step(&linear_grads(&p)?)?;
    // step 2: buf = 1.9 c; g = c + 0.9 * 1.9 c = 2.71 c; p = [0.905 - 0.1355, -2.57 - 0.813]
    assert_close(&vec_f32(&p), &[0.7695, -3.383], 1e-6, "nesterov step 2");
    assert!(Sgd::new(named(&p), SgdConfig { nesterov: true, ..Default::default() }).is_err());
    Ok(())
}

#[test]
fn adam_two_steps_on_a_quadratic() -> Result<()> {
    let p = param(&[1.0, -2.0])?;
    let mut opt = Adam::new(named(&p), AdamConfig { lr: 0.1, ..Default::default() })?;
    opt.step(&quadratic_grads(&p)?)?;
    // step 1: g = p; m = 0.1 g, v = 0.001 g^2; m^ = g, v^ = g^2; p -= 0.1 g / (|g| + 1e-8)
    //   = [1 - 0.1, -2 + 0.1] (to 1e-9). Tolerances are f32's: core forms 1 - beta2 in f32,
    //   0.00099998713 (1.3e-5 relative), which moves this step by about 6e-7.
    assert_close(&vec_f32(&p), &[0.9, -1.9], 1e-6, "adam step 1");
    opt.step(&quadratic_grads(&p)?)?;
    // step 2: g = [0.9, -1.9]
    //   m = 0.9 [0.1, -0.2] + 0.1 [0.9, -1.9] = [0.18, -0.37]
    //   v = 0.999 [0.001, 0.004] + 0.001 [0.81, 3.61] = [0.001809, 0.007606]
    //   m^ = m / 0.19 = [0.947368, -1.947368];  v^ = v / 0.001999 = [0.904952, 3.804902]
    //   p -= 0.1 m^ / sqrt(v^) = [0.9 - 0.0995877, -1.9 + 0.0998335]
    assert_close(&vec_f32(&p), &[0.8004122, -1.8001665], 1e-6, "adam step 2");
    let st = opt.state_tensors();
    assert_eq!((st[0].0.as_str(), st[1].0.as_str()), ("w.m", "w.v"));
    assert_close(&vec_f32(&st[0].1), &[0.18, -0.37], 1e-6, "m");
    assert_close(&vec_f32(&st[1].1), &[0.001809, 0.007606], 1e-6, "v");
    assert_eq!((opt.step_count(), opt.kind()), (2, "adam"));
    Ok(())
}

#[test]
fn adam_vs_adamw_weight_decay() -> Result<()> {
    // Adam (L2): g = c + 0.1 p = [0.6, 2.8]; first step moves each weight by lr * sign(g).
    let p = param(&[1.0, -2.0])?;
    let mut opt = Adam::new(named(&p), AdamConfig { lr: 0.1, weight_decay: 0.1, ..Default::default() })?;
    opt.step(&linear_grads(&p)?)?;
    assert_close(&vec_f32(&p), &[0.9, -2.1], 1e-6, "adam + L2");
    // AdamW: p *= 1 - lr * wd = 0.99 -> [0.99, -1.98], then -= lr * sign(c) -> [0.89, -2.08].
    let p = param(&[1.0, -2.0])?;
    let mut opt = adamw(named(&p), 0.1, 0.1)?;
    opt.step(&linear_grads(&p)?)?;
    assert_close(&vec_f32(&p), &[0.89, -2.08], 1e-6, "adamw");
    assert_eq!(opt.kind(), "adamw");
    Ok(())
}

#[test]
fn params_without_gradients_are_left_alone() -> Result<()> {
    let (a, b) = (param(&[1.0, -2.0])?, param(&[5.0])?);
    let mut opt = Adam::new(vec![("a".into(), a.clone()), ("b".into(), b.clone())], Default::default())?;
    opt.step(&linear_grads(&a)?)?;
    assert_eq!(vec_f32(&b), [5.0]);
    assert_ne!(vec_f32(&a), [1.0, -2.0]);
    opt.step(&GradStore::default())?;
    assert_eq!(opt.step_count(), 1, "an empty store is not a step");
    let f64_param = Tensor::zeros(2, DType::F64, CPU)?.requires_grad();
    assert!(Adam::new(vec![("x".into(), f64_param)], Default::default()).is_err());
    Ok(())
}

#[test]
fn accumulating_half_batches_equals_the_full_batch() -> Result<()> {
    let (x, y) = regression_data(8, 3, 1)?;
    let w = Tensor::from_vec(vec![0.1f32, -0.2, 0.3], (3, 1), CPU)?.requires_grad();
    let loss = |x: &Tensor, y: &Tensor| x.matmul(&w)?.mse_loss(y);
    let full = loss(&x, &y)?.backward()?;
    let mut acc = GradAccumulator::new();
    for half in 0..2 {
        let (xs, ys) = (x.narrow(0, 4 * half, 4)?, y.narrow(0, 4 * half, 4)?);
        acc.backward_scaled(&loss(&xs, &ys)?, 0.5)?;
    }
    assert_eq!(acc.micro_steps(), 2);
    let want: Vec<f64> = vec_f32(full.get(&w).expect("grad")).iter().map(|&v| v as f64).collect();
    assert_close(&vec_f32(acc.grads().get(&w).expect("grad")), &want, 1e-6, "accumulated");
    acc.zero_grad();
    assert!(acc.grads().is_empty() && acc.micro_steps() == 0);
    acc.backward(&loss(&x, &y)?)?;
    assert_close(&vec_f32(acc.grads().get(&w).expect("grad")), &want, 1e-6, "after zero_grad");
    Ok(())
}

#[test]
fn clip_grad_norm_scales_on_device() -> Result<()> {
    let (a, b) = (param(&[0.0, 0.0])?, param(&[0.0])?);
    let make = || -> Result<GradStore> {
        let mut g = GradStore::default();
        g.insert(&a, Tensor::from_vec(vec![3f32, 0.0], 2, CPU)?);
        g.insert(&b, Tensor::from_vec(vec![4f32], 1, CPU)?);
        Ok(g)
    };
    let params = [a.clone(), b.clone()];
    let mut g = make()?;
    let norm = clip_grad_norm(&mut g, &params, 1.0)?;
    assert_eq!(norm.rank(), 0, "a device scalar");
    assert_close(&vec_f32(&norm), &[5.0], 1e-7, "norm");
    // scale = 1 / (5 + 1e-6)
    assert_close(&vec_f32(g.get(&a).expect("a")), &[0.6, 0.0], 1e-6, "clipped a");
    assert_close(&vec_f32(g.get(&b).expect("b")), &[0.8], 1e-6, "clipped b");
    let mut g = make()?;
    clip_grad_norm(&mut g, &params, 10.0)?;
    assert_eq!(vec_f32(g.get(&a).expect("a")), [3.0, 0.0], "below the limit: untouched (scale exactly 1)");
    assert_close(&vec_f32(&grad_norm(&GradStore::default(), &params)?), &[0.0], 0.0, "no grads");
    assert!(clip_grad_norm(&mut g, &params, -1.0).is_err());
    Ok(())
}

#[test]
fn lr_schedules() {
    let c = LrSchedule::Constant { lr: 0.3 };
    assert_eq!((c.lr_at(0), c.lr_at(1000)), (0.3, 0.3));
    let lin = LrSchedule::WarmupLinear { peak: 1.0, warmup: 4, total: 12, end: 0.0 };
    let want = [(0, 0.25), (1, 0.5), (3, 1.0), (4, 1.0), (8, 0.5), (10, 0.25), (12, 0.0), (50, 0.0)];
    for (s, w) in want {
        assert!((lin.lr_at(s) - w).abs() < 1e-12, "linear at {s}: {}", lin.lr_at(s));
    }
    let cos = LrSchedule::WarmupCosine { peak: 1.0, warmup: 2, total: 6, min: 0.1 };
    // after warmup: 0.1 + 0.45 (1 + cos(pi * (s - 2) / 4))
    let want = [(0, 0.5), (1, 1.0), (2, 1.0), (3, 0.1 + 0.45 * (1.0 + 0.5f64.sqrt())), (4, 0.55), (6, 0.1), (9, 0.1)];
    for (s, w) in want {
        assert!((cos.lr_at(s) - w).abs() < 1e-12, "cosine at {s}: {}", cos.lr_at(s));
    }
}
