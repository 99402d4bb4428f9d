//! Autocast and the dynamic loss scaler.

use crate::common::*;
use ferrograd_core::{DType, GradStore, Result, Rng, Tensor};
use ferrograd_nn::amp::*;
use ferrograd_nn::optim::{Optimizer, Sgd, SgdConfig};
use ferrograd_nn::*;

fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| (*x as f64 - *y as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

#[test]
fn autocast_forward_and_grads_stay_close_to_f32() -> Result<()> {
    let mut rng = Rng::new(4);
    let model = mlp(&[16, 32, 8], Activation::Gelu, &mut rng)?;
    let x = Tensor::randn_with(&mut rng, 0.0, 1.0, (10, 16), DType::F32, CPU)?;
    let run = |low: Option<DType>| -> Result<(Vec<f32>, Vec<Vec<f32>>)> {
        let _g = low.map(autocast).transpose()?;
        let y = model.forward(&x)?;
        assert_eq!(y.dtype(), DType::F32, "autocast returns f32 activations");
        let grads = y.sqr()?.mean_all()?.backward()?;
        let g = model
            .parameters()
            .iter()
            .map(|p| {
                let g = grads.get(p).expect("grad");
                assert_eq!(g.dtype(), DType::F32, "master weights get f32 grads");
                vec_f32(g)
            })
            .collect();
        Ok((vec_f32(&y), g))
    };
    let (y32, g32) = run(None)?;
    for (low, tol) in [(DType::BF16, 2e-2), (DType::F16, 3e-3)] {
        let (y, g) = run(Some(low))?;
        let e = rel_err(&y, &y32);
        assert!(e < tol && e > 0.0, "{low} forward rel err {e}");
        for (a, b) in g.iter().zip(&g32) {
            let e = rel_err(a, b);
            assert!(e < 4.0 * tol, "{low} grad rel err {e}");
        }
    }
    assert!(model.parameters().iter().all(|p| p.dtype() == DType::F32), "params untouched");
    Ok(())
}

#[test]
fn autocast_scopes_nest_and_restore() -> Result<()> {
    assert_eq!(autocast_dtype(), None);
    {
        let _a = autocast(DType::BF16)?;
        {
            let _b = autocast(DType::F16)?;
            assert_eq!(autocast_dtype(), Some(DType::F16));
        }
        assert_eq!(autocast_dtype(), Some(DType::BF16));
        // Norms stay f32: a bf16 activation is cast up.
        let ln = LayerNorm::new(4, CPU)?;
        let h = Tensor::ones((2, 4), DType::BF16, CPU)?;
        assert_eq!(ln.forward(&h)?.dtype(), DType::F32);
    }
    assert_eq!(autocast_dtype(), None);
    assert!(autocast(DType::F32).is_err());
    assert_eq!(with_autocast(DType::BF16, || Ok(autocast_dtype()))?, Some(DType::BF16));
    Ok(())
}

fn setup() -> Result<(Tensor, Sgd)> {
    let p = Tensor::from_vec(vec![1f32, 2.0], 2, CPU)?.requires_grad();
    let opt = Sgd::new(vec![("p".into(), p.clone())], SgdConfig { lr: 0.5, ..Default::default() })?;
    Ok((p, opt))
}

fn scaled_grads(s: &GradScaler, p: &Tensor) -> Result<GradStore> {
    // loss = sum(p * [0.25, -1]): true gradient [0.25, -1].
    let c = Tensor::from_vec(vec![0.25f32, -1.0], 2, CPU)?;
    s.scale_loss(&p.mul(&c)?.sum_all()?)?.backward()
}

#[test]
fn grad_scaler_skips_infs_backs_off_and_grows() -> Result<()> {
    let (p, mut opt) = setup()?;
    let cfg = GradScalerConfig { init_scale: 1024.0, growth_interval: 3, ..Default::default() };
    let mut s = GradScaler::new(cfg)?;

    // A clean step: gradients are unscaled exactly, the update uses the true gradient.
    let mut g = scaled_grads(&s, &p)?;
    assert_eq!(vec_f32(g.get(&p).expect("grad")), [256.0, -1024.0]);
    assert!(s.step(&mut opt, &mut g)?);
    assert_eq!(vec_f32(&p), [1.0 - 0.125, 2.0 + 0.5]);
    assert_eq!(s.state().growth_tracker, 1);

    // Injected inf and nan: no update, the scale halves each time, the tracker resets.
    for bad in [f32::INFINITY, f32::NAN, f32::NEG_INFINITY] {
        let before = vec_f32(&p);
        let mut g = scaled_grads(&s, &p)?;
        g.insert(&p, Tensor::from_vec(vec![bad, 1.0], 2, CPU)?);
        let scale = s.scale();
        assert!(!s.step(&mut opt, &mut g)?, "step with {bad} must be skipped");
        assert_eq!(vec_f32(&p), before);
        assert_eq!(s.scale(), scale * 0.5);
        assert_eq!(s.state().growth_tracker, 0);
    }
    assert_eq!((s.scale(), s.state().skipped, opt.step_count()), (128.0, 3, 1));

    // Three clean steps in a row double the scale.
    for i in 0..3 {
        let mut g = scaled_grads(&s, &p)?;
        assert!(s.step(&mut opt, &mut g)?);
        assert_eq!(s.scale(), if i < 2 { 128.0 } else { 256.0 });
    }

    // Unscaling before clipping happens once per step even if asked twice.
    let mut g = scaled_grads(&s, &p)?;
    let params = [p.clone()];
    assert!(!s.unscale(&mut g, &params)?);
    assert!(!s.unscale(&mut g, &params)?);
    assert_eq!(vec_f32(g.get(&p).expect("grad")), [0.25, -1.0]);
    s.update(false);

    // A disabled scaler (bf16) is the identity.
    let off = GradScaler::new(GradScalerConfig { enabled: false, ..Default::default() })?;
    assert_eq!(off.scale(), 1.0);
    assert!(GradScaler::new(GradScalerConfig { backoff_factor: 1.5, ..Default::default() }).is_err());
    Ok(())
}
