//! Layer norm over the last dim (`nn.LayerNorm(d)`: weight 1, bias 0, eps 1e-5). Norms stay in f32
//! under autocast: a low-precision input is cast up first.

use crate::{amp, init, Module};
use ferrograd_core::{DType, Device, Result, Tensor};

/// Layer norm over the last dim (`nn.LayerNorm(dim)`): `(x - mean) / sqrt(var + eps) * weight + bias`.
#[derive(Debug, Clone)]
pub struct LayerNorm {
    /// Scale `[dim]`, ones at first; `None` without affine parameters.
    pub weight: Option<Tensor>,
    /// Shift `[dim]`, zeros at first.
    pub bias: Option<Tensor>,
    /// Added to the variance.
    pub eps: f64,
}

impl LayerNorm {
    /// Weight 1, bias 0, eps 1e-5 (PyTorch's defaults), f32 on `device`.
    pub fn new(dim: usize, device: Device) -> Result<Self> {
        Self::with_options(dim, 1e-5, true, device)
    }

    /// `affine = false` drops weight and bias (`elementwise_affine=False`).
    pub fn with_options(dim: usize, eps: f64, affine: bool, device: Device) -> Result<Self> {
        let (weight, bias) = if affine {
            (Some(init::constant(1.0, dim, device)?), Some(init::constant(0.0, dim, device)?))
        } else {
            (None, None)
        };
        Ok(LayerNorm { weight, bias, eps })
    }
}

impl Module for LayerNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let low = matches!(x.dtype(), DType::BF16 | DType::F16);
        let x = if low && amp::autocast_dtype().is_some() { x.to_dtype(DType::F32)? } else { x.clone() };
        x.layer_norm(self.weight.as_ref(), self.bias.as_ref(), self.eps)
    }

    fn visit_parameters(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor)) {
        if let Some(w) = &self.weight {
            f(crate::module::join_name(prefix, "weight"), w);
        }
        if let Some(b) = &self.bias {
            f(crate::module::join_name(prefix, "bias"), b);
        }
    }
}
