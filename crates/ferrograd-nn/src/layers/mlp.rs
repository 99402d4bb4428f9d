//! `mlp(&[in, h1, ..., out], act, rng)`: Linear, act, Linear, act, ..., Linear in a `Sequential`,
//! so the linears are named `0`, `2`, `4`, ... exactly as the same `nn.Sequential` in PyTorch.

use crate::{Activation, Linear, Sequential};
use ferrograd_core::{Device, Error, Result, Rng};

/// An MLP on the CPU.
pub fn mlp(sizes: &[usize], activation: Activation, rng: &mut Rng) -> Result<Sequential> {
    mlp_on(sizes, activation, rng, Device::Cpu)
}

/// An MLP with its parameters on `device` (the same values on every device for one seed).
pub fn mlp_on(sizes: &[usize], activation: Activation, rng: &mut Rng, device: Device) -> Result<Sequential> {
    if sizes.len() < 2 {
        return Err(Error::InvalidArgument(format!("mlp needs at least input and output sizes, got {sizes:?}")));
    }
    let mut s = Sequential::new();
    for (i, w) in sizes.windows(2).enumerate() {
        if i > 0 {
            s.push(Box::new(activation));
        }
        s.push(Box::new(Linear::new(w[0], w[1], true, rng, device)?));
    }
    Ok(s)
}
