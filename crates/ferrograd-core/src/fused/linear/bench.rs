//! The workload of `ferrograd bench linear` (timing and report in
//! `crates/ferrograd-cli/src/bench/linear.rs`, PyTorch twin `bench/torch_linear.py`): one linear
//! layer with bias and an activation, forward then backward from a given output gradient, at the
//! shapes of GPT-2's MLP (16 sequences of 1024 tokens).

use super::{linear, Activation};
use crate::{DType, Device, GradStore, Result, Rng, Tensor};

/// One problem: `rows` tokens, `in_features` -> `out_features`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Case {
    pub rows: usize,
    pub in_features: usize,
    pub out_features: usize,
}

/// GPT-2 small's MLP (768 -> 3072 and back) and GPT-2 medium's first layer (1024 -> 4096), for
/// 16 x 1024 tokens.
pub const GPT2: &[Case] = &[
    Case { rows: 16 * 1024, in_features: 768, out_features: 3072 },
    Case { rows: 16 * 1024, in_features: 3072, out_features: 768 },
    Case { rows: 16 * 1024, in_features: 1024, out_features: 4096 },
];

impl Case {
    /// `768->3072 rows=16384`: the row name in the table, the JSON and the twin's output.
    pub fn name(&self) -> String {
        format!("{}->{} rows={}", self.in_features, self.out_features, self.rows)
    }

    /// Forward FLOPs (the matmul): 2 rows in out.
    pub fn forward_flops(&self) -> f64 {
        2.0 * self.rows as f64 * self.in_features as f64 * self.out_features as f64
    }

    /// Forward + backward FLOPs: the forward matmul and the two gradient matmuls (dx, dW).
    pub fn step_flops(&self) -> f64 {
        3.0 * self.forward_flops()
    }
}

/// A layer's tensors: `x ~ N(0, 1)`, weight and bias uniform in `±1/sqrt(in)` (nn.Linear's
/// initialisation), output gradient `~ N(0, 1)`. Weight and bias require grad, x does too (a
/// hidden layer's input), so all three gradients are computed.
pub struct Inputs {
    pub x: Tensor,
    pub w: Tensor,
    pub b: Tensor,
    pub dy: Tensor,
}

impl Inputs {
    pub fn new(case: Case, dtype: DType, device: Device, rng: &mut Rng) -> Result<Inputs> {
        let Case { rows, in_features: k, out_features: n } = case;
        let bound = 1.0 / (k as f64).sqrt();
        Ok(Inputs {
            x: Tensor::randn_with(rng, 0.0, 1.0, (rows, k), dtype, device)?.requires_grad(),
            w: Tensor::rand_with(rng, -bound, bound, (n, k), dtype, device)?.requires_grad(),
            b: Tensor::rand_with(rng, -bound, bound, n, dtype, device)?.requires_grad(),
            dy: Tensor::randn_with(rng, 0.0, 1.0, (rows, n), dtype, device)?,
        })
    }

    /// The fused op: forward, then backward from `dy`.
    pub fn fused_step(&self, act: Activation) -> Result<(Tensor, GradStore)> {
        let y = linear(&self.x, &self.w, Some(&self.b), act)?;
        let g = y.backward_with(&self.dy)?;
        Ok((y, g))
    }

    /// The same layer from primitive ops (matmul, add, activation), each its own kernel and its
    /// own backward rule: what the fusion saves.
    pub fn unfused_step(&self, act: Activation) -> Result<(Tensor, GradStore)> {
        let z = self.x.matmul(&self.w.t()?)?.add(&self.b)?;
        let y = match act {
            Activation::None => z,
            Activation::GeluTanh => z.gelu_tanh()?,
            Activation::Relu => z.relu()?,
        };
        let g = y.backward_with(&self.dy)?;
        Ok((y, g))
    }
}
