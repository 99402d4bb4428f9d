//! Helpers shared by the test modules.

use ferrograd_core::{DType, Device, Result, Rng, Tensor};

pub const CPU: Device = Device::Cpu;

/// `cuda:0` when a GPU is usable; otherwise prints why the test is skipped and returns None.
pub fn cuda(test: &str) -> Option<Device> {
    match ferrograd_core::cuda::CudaDevice::get(0) {
        Ok(_) => Some(Device::Cuda(0)),
        Err(e) => {
            eprintln!("skipping {test}: no usable GPU ({e})");
            None
        }
    }
}

pub fn vec_f32(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32).and_then(|t| t.to_vec::<f32>()).expect("readable f32 tensor")
}

pub fn assert_close(got: &[f32], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g as f64 - w).abs();
        assert!(err <= tol * (1.0 + w.abs()), "{what}[{i}]: got {g}, want {w} (err {err:e})");
    }
}

/// Bitwise equality of two f32 tensors.
pub fn assert_bits_eq(a: &Tensor, b: &Tensor, what: &str) {
    let (x, y) = (vec_f32(a), vec_f32(b));
    let same = x.len() == y.len() && x.iter().zip(&y).all(|(p, q)| p.to_bits() == q.to_bits());
    assert!(same, "{what}: tensors differ");
}

/// A synthetic regression set: x ~ N(0, 1) of width `d`, y = sin(x . w) + 0.5 x0.
pub fn regression_data(n: usize, d: usize, seed: u64) -> Result<(Tensor, Tensor)> {
    let mut rng = Rng::new(seed);
    let x = Tensor::randn_with(&mut rng, 0.0, 1.0, (n, d), DType::F32, CPU)?;
    let w = Tensor::randn_with(&mut rng, 0.0, 0.7, (d, 1), DType::F32, CPU)?;
    let y = x.matmul(&w)?.sin()?.add(&x.narrow(1, 0, 1)?.mul_scalar(0.5)?)?;
    Ok((x, y))
}
