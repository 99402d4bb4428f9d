//! Observers and QAT `Linear` (`src/quant/`): min-max and moving-average ranges by hand, symmetric
//! and affine scale / zero point (PyTorch's formulas), per channel, typed errors; `QatLinear`
//! equals the float linear of the fake-quantized input and weight, trains (gradients reach the
//! weight and bias through the straight-through estimator), and freezes its observers.

use ferrograd_core::{DType, Device, Error, FakeQuant, Result, Rng, Tensor};
use ferrograd_nn::quant::{Observer, ObserverKind, QScheme, QatLinear};
use ferrograd_nn::{Linear, Module};

const CPU: Device = Device::Cpu;

fn t(v: &[f32], dims: &[usize]) -> Tensor {
    Tensor::from_vec(v.to_vec(), dims.to_vec(), CPU).expect("tensor")
}

fn close(a: &[f64], b: &[f64]) {
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        assert!((x - y).abs() <= 1e-6 * (1.0 + y.abs()), "{a:?} vs {b:?}");
    }
}

#[test]
fn min_max_symmetric_and_affine() -> Result<()> {
    let mut o = Observer::new(ObserverKind::MinMax, QScheme::Symmetric, -127, 127, None)?;
    assert!(o.qparams().is_err(), "nothing observed yet");
    o.observe(&t(&[-1.0, 2.0], &[2]))?;
    o.observe(&t(&[-3.0, 0.5], &[2]))?;
    let (lo, hi) = o.range().expect("range");
    assert_eq!((lo.to_f64_vec()?, hi.to_f64_vec()?), (vec![-3.0], vec![2.0]));
    let p = o.qparams()?;
    close(&p.scale.to_f64_vec()?, &[3.0 / 127.0]);
    assert_eq!(p.zero_point.to_f64_vec()?, [0.0]);
    let mut a = Observer::new(ObserverKind::MinMax, QScheme::Affine, 0, 255, None)?;
    a.observe(&t(&[-3.0, 2.0], &[2]))?;
    let p = a.qparams()?;
    close(&p.scale.to_f64_vec()?, &[5.0 / 255.0]);
    close(&p.zero_point.to_f64_vec()?, &[153.0]); // 0 - (-3) / (5 / 255)
                                                  // A range that does not contain 0 is widened to it (PyTorch's min_neg / max_pos).
    let mut b = Observer::new(ObserverKind::MinMax, QScheme::Affine, 0, 255, None)?;
    b.observe(&t(&[1.0, 2.0], &[2]))?;
    close(&b.qparams()?.zero_point.to_f64_vec()?, &[0.0]);
    Ok(())
}

#[test]
fn moving_average_and_per_channel() -> Result<()> {
    let mut o = Observer::new(ObserverKind::MovingAverage(0.5), QScheme::Symmetric, -127, 127, None)?;
    o.observe(&t(&[-1.0, 2.0], &[2]))?;
    o.observe(&t(&[-3.0, 0.5], &[2]))?;
    let (lo, hi) = o.range().expect("range");
    assert_eq!((lo.to_f64_vec()?, hi.to_f64_vec()?), (vec![-2.0], vec![1.25]));
    let mut c = Observer::weight_int8(0);
    c.observe(&t(&[1.0, -4.0, 0.5, 2.0, 0.0, 0.0], &[3, 2]))?;
    close(&c.qparams()?.scale.to_f64_vec()?, &[4.0 / 127.0, 2.0 / 127.0, f32::EPSILON as f64]);
    assert!(matches!(c.observe(&t(&[1.0; 4], &[4, 1])).unwrap_err(), Error::Shape { .. }), "4 channels after 3");
    assert!(Observer::new(ObserverKind::MinMax, QScheme::Affine, 3, 3, None).is_err());
    assert!(Observer::new(ObserverKind::MovingAverage(2.0), QScheme::Affine, 0, 255, None).is_err());
    let mut axis = Observer::weight_int8(2);
    assert!(matches!(axis.observe(&t(&[1.0; 4], &[2, 2])).unwrap_err(), Error::Shape { .. }));
    Ok(())
}

#[test]
fn qat_linear_is_the_linear_of_fake_quantized_tensors() -> Result<()> {
    let mut rng = Rng::new(1);
    let lin = Linear::new(16, 8, true, &mut rng, CPU)?;
    let qat = QatLinear::new(lin.clone());
    let x = Tensor::randn_with(&mut rng, 0.0, 1.0, (4, 16), DType::F32, CPU)?;
    let y = qat.forward(&x)?;
    // By hand: weight per row max|w| / 127, input per tensor max|x| / 127 (first batch).
    let wmax: Vec<f32> =
        lin.weight.abs()?.max(1, false)?.to_f64_vec()?.iter().map(|v| (*v as f32) * (2.0 / 254.0)).collect();
    let ws = Tensor::from_vec(wmax, 8, CPU)?;
    let wq = lin.weight.fake_quantize(
        &ws,
        &Tensor::zeros(8, DType::F32, CPU)?,
        FakeQuant { qmin: -127, qmax: 127, axis: Some(0), grad_factor: None },
    )?;
    let xmax = x.abs()?.max(vec![0, 1], false)?.to_f64_vec()?[0] as f32 * (2.0 / 254.0);
    let xq = x.fake_quantize(
        &t(&[xmax], &[1]),
        &t(&[0.0], &[1]),
        FakeQuant { qmin: -127, qmax: 127, axis: None, grad_factor: None },
    )?;
    let want = Linear { weight: wq, bias: lin.bias.clone() }.forward(&xq)?;
    let (a, b) = (y.to_f64_vec()?, want.to_f64_vec()?);
    for (p, q) in a.iter().zip(&b) {
        assert!((p - q).abs() <= 1e-5 * (1.0 + q.abs()), "{p} vs {q}");
    }
    // Close to the float layer (int8 keeps ~1% of the products' norm).
    let f = lin.forward(&x)?.to_f64_vec()?;
    let e = ferrograd_core::fused::bench::rel_err(&a, &f);
    assert!(e < 3e-2 && e > 0.0, "rel err {e}");
    Ok(())
}

#[test]
fn qat_linear_trains_and_freezes() -> Result<()> {
    let mut rng = Rng::new(2);
    let mut qat = QatLinear::new(Linear::new(16, 4, true, &mut rng, CPU)?);
    let x = Tensor::randn_with(&mut rng, 0.0, 1.0, (32, 16), DType::F32, CPU)?;
    let target = Tensor::randn_with(&mut rng, 0.0, 1.0, (32, 4), DType::F32, CPU)?;
    let loss_of = |q: &QatLinear| -> Result<Tensor> { q.forward(&x)?.mse_loss(&target) };
    let first = loss_of(&qat)?.item_f64()?;
    for _ in 0..60 {
        let loss = loss_of(&qat)?;
        let g = loss.backward()?;
        for p in qat.parameters() {
            let gp = g.get(&p).ok_or_else(|| Error::Backward("a parameter got no gradient".into()))?;
            p.set(&p.detach().sub(&gp.mul_scalar(0.1)?)?)?;
        }
    }
    let last = loss_of(&qat)?.item_f64()?;
    assert!(last < 0.9 * first, "QAT loss {first} -> {last}");
    // Frozen observers keep their range whatever comes in.
    qat.freeze_observers(true);
    let before = qat.observers().1.range().map(|(a, b)| (a.to_f64_vec(), b.to_f64_vec()));
    qat.forward(&x.mul_scalar(100.0)?)?;
    let after = qat.observers().1.range().map(|(a, b)| (a.to_f64_vec(), b.to_f64_vec()));
    assert_eq!(format!("{before:?}"), format!("{after:?}"));
    Ok(())
}
