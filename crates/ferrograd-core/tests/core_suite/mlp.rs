//! The "done when" test of the foundation issue: a 2-layer MLP trained with plain SGD, written
//! directly against the tensor API (leaf variables, backward, in-place `set` under no_grad),
//! drives a synthetic regression loss (y = sin(x) on [-3, 3]) down by more than 100x on the CPU.

use ferrograd_core::{no_grad, DType, Device, Result, Rng, Tensor};

const CPU: Device = Device::Cpu;

struct Mlp {
    w1: Tensor,
    b1: Tensor,
    w2: Tensor,
    b2: Tensor,
}

impl Mlp {
    fn new(rng: &mut Rng, hidden: usize, dtype: DType) -> Result<Mlp> {
        // Unit input weights and biases spread over [-2, 2] put the tanh knees across the data;
        // output weights ~ 1/sqrt(H).
        let w1 = Tensor::randn_with(rng, 0.0, 1.0, (1, hidden), dtype, CPU)?.requires_grad();
        let b1 = Tensor::rand_with(rng, -2.0, 2.0, hidden, dtype, CPU)?.requires_grad();
        let w2 = Tensor::randn_with(rng, 0.0, 1.0 / (hidden as f64).sqrt(), (hidden, 1), dtype, CPU)?.requires_grad();
        let b2 = Tensor::zeros(1, dtype, CPU)?.requires_grad();
        Ok(Mlp { w1, b1, w2, b2 })
    }

    fn params(&self) -> [&Tensor; 4] {
        [&self.w1, &self.b1, &self.w2, &self.b2]
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.matmul(&self.w1)?.add(&self.b1)?.tanh()?.matmul(&self.w2)?.add(&self.b2)
    }

    /// One full-batch SGD step; returns the loss before the update. The learning rate must stay below
    /// 2 / (largest Hessian eigenvalue) ~ 2 / (2 * mean |h|^2 * H): about 0.06 for 32 saturating
    /// tanh units, so plain SGD with lr 0.1 diverges here.
    fn step(&self, x: &Tensor, y: &Tensor, lr: f64) -> Result<f64> {
        let loss = self.forward(x)?.mse_loss(y)?;
        let grads = loss.backward()?;
        let _g = no_grad();
        for p in self.params() {
            let g = grads.get(p).expect("every parameter gets a gradient");
            p.set(&p.sub(&g.mul_scalar(lr)?)?)?;
        }
        loss.item_f64()
    }
}

fn data(n: usize, dtype: DType) -> Result<(Tensor, Tensor)> {
    let x = Tensor::arange(-3.0, 3.0 + 1e-9, 6.0 / (n - 1) as f64, dtype, CPU)?.reshape((n, 1))?;
    let y = x.sin()?;
    Ok((x, y))
}

fn train(dtype: DType, steps: usize, lr: f64) -> Result<(f64, f64)> {
    let mut rng = Rng::new(2024);
    let model = Mlp::new(&mut rng, 32, dtype)?;
    let (x, y) = data(64, dtype)?;
    let first = model.step(&x, &y, lr)?;
    for _ in 1..steps {
        let l = model.step(&x, &y, lr)?;
        assert!(l.is_finite(), "loss diverged");
    }
    let last = model.forward(&x)?.mse_loss(&y)?.item_f64()?;
    Ok((first, last))
}

#[test]
fn mlp_sgd_reduces_loss_100x_f32() -> Result<()> {
    let (first, last) = train(DType::F32, 2500, 0.05)?;
    eprintln!("mlp f32: loss {first:.4e} -> {last:.4e} ({:.0}x)", first / last);
    assert!(first / last > 100.0, "loss went from {first} to {last}, only {:.1}x", first / last);
    Ok(())
}

#[test]
fn mlp_sgd_reduces_loss_100x_f64() -> Result<()> {
    let (first, last) = train(DType::F64, 2500, 0.05)?;
    eprintln!("mlp f64: loss {first:.4e} -> {last:.4e} ({:.0}x)", first / last);
    assert!(first / last > 100.0, "loss went from {first} to {last}, only {:.1}x", first / last);
    Ok(())
}

#[test]
fn parameters_keep_identity_across_updates() -> Result<()> {
    // `set` writes in place: the leaf (and its id) survives, so a GradStore keyed by the leaf keeps
    // working from one step to the next, and the update is not recorded in any graph.
    let mut rng = Rng::new(1);
    let model = Mlp::new(&mut rng, 4, DType::F32)?;
    let (x, y) = data(8, DType::F32)?;
    let id = model.w1.id();
    let before = model.w1.to_vec::<f32>()?;
    model.step(&x, &y, 0.5)?;
    assert_eq!(model.w1.id(), id);
    assert!(model.w1.is_variable() && model.w1.op().is_none());
    assert_ne!(model.w1.to_vec::<f32>()?, before);
    // The same update written with detach instead of no_grad gives the same numbers.
    let m2 = Mlp::new(&mut Rng::new(1), 4, DType::F32)?;
    let grads = m2.forward(&x)?.mse_loss(&y)?.backward()?;
    for p in m2.params() {
        let g = grads.get(p).unwrap().detach();
        p.set(&p.detach().sub(&g.mul_scalar(0.5)?)?)?;
    }
    assert_eq!(m2.w1.to_vec::<f32>()?, model.w1.to_vec::<f32>()?);
    Ok(())
}
