//! `y = x W^T + b` with PyTorch's `nn.Linear` layout and initialisation, through the fused
//! linear op (`ferrograd_core::fused::linear`: on CUDA one cuBLASLt matmul whose epilogue adds the
//! bias, and applies an activation for [`Linear::forward_act`]). Under an autocast scope the layer
//! runs in the low dtype and the output comes back as f32.

use crate::{amp, init, Module};
use ferrograd_core::fused::linear::linear;
pub use ferrograd_core::fused::linear::Activation as LinearActivation;
use ferrograd_core::{DType, Device, Result, Rng, Tensor};

/// A fully connected layer (`nn.Linear`): `y = x W^T + b` over the last dim of `x`
/// (`[.., in] -> [.., out]`).
#[derive(Debug, Clone)]
pub struct Linear {
    /// `[out_features, in_features]`
    pub weight: Tensor,
    /// `[out_features]`
    pub bias: Option<Tensor>,
}

impl Linear {
    /// Weight and bias uniform in `±1/sqrt(in_features)`: PyTorch's `kaiming_uniform_(a=sqrt(5))`
    /// for the weight and its fan-in bound for the bias, drawn weight first, then bias.
    pub fn new(in_features: usize, out_features: usize, bias: bool, rng: &mut Rng, device: Device) -> Result<Self> {
        let weight = init::kaiming_uniform(rng, 5f64.sqrt(), in_features, (out_features, in_features), device)?;
        let bias = if bias {
            let bound = if in_features > 0 { 1.0 / (in_features as f64).sqrt() } else { 0.0 };
            Some(init::uniform(rng, bound, out_features, device)?)
        } else {
            None
        };
        Ok(Linear { weight, bias })
    }

    /// A layer around existing tensors (made leaf variables if they are not already).
    pub fn from_tensors(weight: Tensor, bias: Option<Tensor>) -> Self {
        let leaf = |t: Tensor| if t.is_variable() { t } else { t.requires_grad() };
        Linear { weight: leaf(weight), bias: bias.map(leaf) }
    }

    /// Input features (the weight's second dim).
    pub fn in_features(&self) -> usize {
        self.weight.dims().get(1).copied().unwrap_or(0)
    }

    /// Output features (the weight's first dim).
    pub fn out_features(&self) -> usize {
        self.weight.dims().first().copied().unwrap_or(0)
    }
}

impl Linear {
    /// `act(x W^T + b)` as one fused op: on CUDA the activation (GELU in its tanh form, ReLU) runs
    /// in the matmul's epilogue and its backward needs no separate pass over the output.
    pub fn forward_act(&self, x: &Tensor, act: LinearActivation) -> Result<Tensor> {
        match amp::autocast_dtype() {
            // The low-dtype copies are differentiable casts, so the f32 master weight and bias
            // receive f32 gradients.
            Some(low) if x.dtype().is_float() => {
                let b = self.bias.as_ref().map(|b| b.to_dtype(low)).transpose()?;
                linear(&x.to_dtype(low)?, &self.weight.to_dtype(low)?, b.as_ref(), act)?.to_dtype(DType::F32)
            }
            _ => linear(x, &self.weight, self.bias.as_ref(), act),
        }
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_act(x, LinearActivation::None)
    }

    fn visit_parameters(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor)) {
        f(crate::module::join_name(prefix, "weight"), &self.weight);
        if let Some(b) = &self.bias {
            f(crate::module::join_name(prefix, "bias"), b);
        }
    }
}
