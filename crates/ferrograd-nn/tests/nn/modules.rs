//! Layers: parameter names, initialisation, forward values, modes.

use crate::common::*;
use ferrograd_core::{DType, Result, Rng, Tensor};
use ferrograd_nn::module::join_name;
use ferrograd_nn::optim::{Optimizer, Sgd, SgdConfig};
use ferrograd_nn::*;

#[test]
fn mlp_names_match_pytorch_sequential() -> Result<()> {
    let m = mlp(&[3, 4, 5, 2], Activation::Relu, &mut Rng::new(0))?;
    let got: Vec<(String, Vec<usize>)> =
        m.named_parameters().into_iter().map(|(n, t)| (n, t.dims().to_vec())).collect();
    // nn.Sequential(Linear(3,4), ReLU(), Linear(4,5), ReLU(), Linear(5,2)).state_dict()
    let want = [
        ("0.weight", vec![4, 3]),
        ("0.bias", vec![4]),
        ("2.weight", vec![5, 4]),
        ("2.bias", vec![5]),
        ("4.weight", vec![2, 5]),
        ("4.bias", vec![2]),
    ];
    assert_eq!(got.len(), want.len());
    for ((gn, gs), (wn, ws)) in got.iter().zip(&want) {
        assert_eq!((gn.as_str(), gs), (*wn, ws));
    }
    assert_eq!(m.num_parameters(), 4 * 3 + 4 + 5 * 4 + 5 + 2 * 5 + 2);
    assert!(m.parameters().iter().all(|p| p.is_variable() && p.dtype() == DType::F32));
    Ok(())
}

/// A user-defined module with named children, like `self.encoder = nn.Sequential(...)`.
struct AutoEncoder {
    encoder: Sequential,
    norm: LayerNorm,
    decoder: Linear,
}

impl Module for AutoEncoder {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.decoder.forward(&self.norm.forward(&self.encoder.forward(x)?)?)
    }
    fn visit_parameters(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor)) {
        self.encoder.visit_parameters(&join_name(prefix, "encoder"), f);
        self.norm.visit_parameters(&join_name(prefix, "norm"), f);
        self.decoder.visit_parameters(&join_name(prefix, "decoder"), f);
    }
    fn set_training(&mut self, t: bool) {
        self.encoder.set_training(t);
    }
}

#[test]
fn nested_modules_get_hierarchical_names() -> Result<()> {
    let mut rng = Rng::new(1);
    let ae = AutoEncoder {
        encoder: mlp(&[6, 4, 3], Activation::Gelu, &mut rng)?,
        norm: LayerNorm::new(3, CPU)?,
        decoder: Linear::new(3, 6, false, &mut rng, CPU)?,
    };
    let names: Vec<String> = ae.named_parameters().into_iter().map(|(n, _)| n).collect();
    assert_eq!(
        names,
        [
            "encoder.0.weight",
            "encoder.0.bias",
            "encoder.2.weight",
            "encoder.2.bias",
            "norm.weight",
            "norm.bias",
            "decoder.weight"
        ]
    );
    let x = Tensor::randn_with(&mut rng, 0.0, 1.0, (5, 6), DType::F32, CPU)?;
    assert_eq!(ae.forward(&x)?.dims(), [5, 6]);
    Ok(())
}

#[test]
fn linear_init_is_pytorch_kaiming_uniform() -> Result<()> {
    let (fan_in, out) = (16, 64);
    let l = Linear::new(fan_in, out, true, &mut Rng::new(7), CPU)?;
    let bound = 1.0 / (fan_in as f64).sqrt(); // kaiming_uniform(a = sqrt(5)) = 1/sqrt(fan_in)
    let w = vec_f32(&l.weight);
    let b = vec_f32(l.bias.as_ref().expect("bias"));
    assert!(w.iter().chain(&b).all(|&v| (v as f64).abs() < bound), "outside ±{bound}");
    let max = w.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
    assert!(max > 0.9 * bound, "weights should fill the range: max {max}");
    let mean = w.iter().map(|&v| v as f64).sum::<f64>() / w.len() as f64;
    assert!(mean.abs() < 0.03, "mean {mean}");
    // Exactly the seeded uniform draws: weight first, then bias, from one stream.
    let mut rng = Rng::new(7);
    let w2 = Tensor::rand_with(&mut rng, -bound, bound, (out, fan_in), DType::F32, CPU)?;
    let b2 = Tensor::rand_with(&mut rng, -bound, bound, out, DType::F32, CPU)?;
    assert_bits_eq(&l.weight, &w2, "weight");
    assert_bits_eq(l.bias.as_ref().expect("bias"), &b2, "bias");
    Ok(())
}

#[test]
fn linear_forward_is_x_wt_plus_b() -> Result<()> {
    let w = Tensor::from_vec(vec![1f32, 2., 3., 4., 5., 6.], (2, 3), CPU)?;
    let b = Tensor::from_vec(vec![0.5f32, -1.0], 2, CPU)?;
    let l = Linear::from_tensors(w, Some(b));
    assert!(l.weight.is_variable() && l.in_features() == 3 && l.out_features() == 2);
    let x = Tensor::from_vec(vec![1f32, 0., -1., 2., 1., 0.], (2, 3), CPU)?;
    // rows: [1,0,-1]·[1,2,3] = -2, ·[4,5,6] = -2; [2,1,0]·[1,2,3] = 4, ·[4,5,6] = 13
    assert_close(&vec_f32(&l.forward(&x)?), &[-1.5, -3.0, 4.5, 12.0], 0.0, "linear");
    // Batch dims broadcast: [2, 1, 3] -> [2, 1, 2].
    assert_eq!(l.forward(&x.reshape((2, 1, 3))?)?.dims(), [2, 1, 2]);
    Ok(())
}

#[test]
fn linear_forward_act_fuses_the_activation() -> Result<()> {
    let mut rng = Rng::new(9);
    let l = Linear::new(6, 5, true, &mut rng, CPU)?;
    let x = Tensor::randn_with(&mut rng, 0.0, 1.0, (2, 3, 6), DType::F32, CPU)?;
    let y = l.forward(&x)?;
    for (act, want) in [(LinearActivation::GeluTanh, y.gelu_tanh()?), (LinearActivation::Relu, y.relu()?)] {
        let want: Vec<f64> = vec_f32(&want).iter().map(|&v| v as f64).collect();
        assert_close(&vec_f32(&l.forward_act(&x, act)?), &want, 1e-6, &format!("{act:?}"));
    }
    // The weight and bias get gradients through the fused op, named as before.
    let grads = l.forward_act(&x, LinearActivation::GeluTanh)?.sqr()?.sum_all()?.backward()?;
    assert!(grads.get(&l.weight).is_some() && grads.get(l.bias.as_ref().expect("bias")).is_some());
    Ok(())
}

#[test]
fn embedding_and_layer_norm() -> Result<()> {
    let mut rng = Rng::new(3);
    let e = Embedding::new(100, 32, &mut rng, CPU)?;
    let w = vec_f32(&e.weight);
    let mean = w.iter().map(|&v| v as f64).sum::<f64>() / w.len() as f64;
    let var = w.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / w.len() as f64;
    assert!(mean.abs() < 0.05 && (var - 1.0).abs() < 0.1, "N(0,1) init: mean {mean} var {var}");
    let ids = Tensor::from_vec(vec![3u32, 7, 3, 99], (2, 2), CPU)?;
    let out = e.forward(&ids)?;
    assert_eq!(out.dims(), [2, 2, 32]);
    assert_bits_eq(
        &out.narrow(0, 0, 1)?.narrow(1, 0, 1)?.flatten_all()?,
        &e.weight.narrow(0, 3, 1)?.flatten_all()?,
        "row 3",
    );

    let ln = LayerNorm::new(32, CPU)?;
    let names: Vec<String> = ln.named_parameters().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["weight", "bias"]);
    let y = ln.forward(&out.reshape((4, 32))?)?;
    for row in y.to_vec2::<f32>()? {
        let m = row.iter().map(|&v| v as f64).sum::<f64>() / 32.0;
        let v = row.iter().map(|&x| (x as f64 - m).powi(2)).sum::<f64>() / 32.0;
        assert!(m.abs() < 1e-5 && (v - 1.0).abs() < 1e-3, "normalised row: mean {m} var {v}");
    }
    Ok(())
}

#[test]
fn dropout_train_and_eval() -> Result<()> {
    let rng = SharedRng::new(11);
    let mut net = Sequential::new().add(Dropout::new(0.5, rng.clone())?);
    let x = Tensor::ones((64, 64), DType::F32, CPU)?;
    let y = vec_f32(&net.forward(&x)?);
    let zeros = y.iter().filter(|&&v| v == 0.0).count();
    assert!((1500..2600).contains(&zeros), "about half dropped: {zeros}");
    assert!(y.iter().all(|&v| v == 0.0 || v == 2.0), "survivors scaled by 1/(1-p)");
    // The same generator state gives the same mask.
    let state = rng.get();
    let a = vec_f32(&net.forward(&x)?);
    rng.set(state);
    let b = vec_f32(&net.forward(&x)?);
    assert_eq!(a, b);
    net.eval();
    assert_eq!(vec_f32(&net.forward(&x)?), vec![1.0; 64 * 64]);
    net.train();
    assert_ne!(vec_f32(&net.forward(&x)?), vec![1.0; 64 * 64]);
    assert!(Dropout::new(1.0, rng).is_err());
    Ok(())
}

#[test]
fn activations_match_tensor_ops() -> Result<()> {
    let x = Tensor::from_vec(vec![-2f32, -0.5, 0.0, 0.5, 2.0], 5, CPU)?;
    let pairs: [(&dyn Module, Tensor); 5] =
        [(&Relu, x.relu()?), (&Gelu, x.gelu()?), (&Tanh, x.tanh()?), (&Sigmoid, x.sigmoid()?), (&Silu, x.silu()?)];
    for (m, want) in pairs {
        assert_bits_eq(&m.forward(&x)?, &want, "activation");
    }
    assert_eq!("gelu".parse::<Activation>()?, Activation::Gelu);
    assert!("softplus".parse::<Activation>().is_err());
    assert!(mlp(&[3], Activation::Relu, &mut Rng::new(0)).is_err());
    Ok(())
}

#[test]
fn parameters_keep_identity_across_steps() -> Result<()> {
    let m = mlp(&[2, 3, 1], Activation::Tanh, &mut Rng::new(5))?;
    let before: Vec<_> = m.parameters().iter().map(|p| (p.id(), vec_f32(p))).collect();
    let mut opt = Sgd::new(m.named_parameters(), SgdConfig { lr: 0.1, ..Default::default() })?;
    let x = Tensor::ones((4, 2), DType::F32, CPU)?;
    for _ in 0..3 {
        let loss = m.forward(&x)?.sqr()?.mean_all()?;
        opt.step(&loss.backward()?)?;
    }
    for ((id, v), p) in before.iter().zip(m.parameters()) {
        assert_eq!(*id, p.id(), "same leaf");
        assert!(p.is_variable() && p.op().is_none());
        assert_ne!(*v, vec_f32(&p), "updated in place");
    }
    Ok(())
}
