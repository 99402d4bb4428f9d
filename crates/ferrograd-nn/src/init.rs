//! Parameter initialisations, PyTorch's defaults, drawn from a seeded Philox stream so that the
//! same seed gives the same weights on every device.

use ferrograd_core::{DType, Device, Result, Rng, Shape, Tensor};

/// Uniform in `[-bound, bound)` as a leaf variable.
pub fn uniform(rng: &mut Rng, bound: f64, shape: impl Into<Shape>, device: Device) -> Result<Tensor> {
    Ok(Tensor::rand_with(rng, -bound, bound, shape, DType::F32, device)?.requires_grad())
}

/// `kaiming_uniform_(w, a)` with fan-in mode and leaky-ReLU gain: bound =
/// `sqrt(2 / (1 + a^2)) * sqrt(3 / fan_in)`. PyTorch's `nn.Linear` uses `a = sqrt(5)`, which makes
/// the bound exactly `1 / sqrt(fan_in)`.
pub fn kaiming_uniform(
    rng: &mut Rng,
    a: f64,
    fan_in: usize,
    shape: impl Into<Shape>,
    device: Device,
) -> Result<Tensor> {
    // The same arithmetic as `torch.nn.init.kaiming_uniform_`, in the same order.
    let gain = (2.0 / (1.0 + a * a)).sqrt();
    let std = gain / (fan_in.max(1) as f64).sqrt();
    let bound = 3f64.sqrt() * std;
    uniform(rng, bound, shape, device)
}

/// Normal with `mean` and `std` as a leaf variable (`nn.Embedding`: N(0, 1)).
pub fn normal(rng: &mut Rng, mean: f64, std: f64, shape: impl Into<Shape>, device: Device) -> Result<Tensor> {
    Ok(Tensor::randn_with(rng, mean, std, shape, DType::F32, device)?.requires_grad())
}

/// A constant leaf variable (`nn.LayerNorm`: weight 1, bias 0).
pub fn constant(value: f64, shape: impl Into<Shape>, device: Device) -> Result<Tensor> {
    Ok(Tensor::full(value, shape, DType::F32, device)?.requires_grad())
}
