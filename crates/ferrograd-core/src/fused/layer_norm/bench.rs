//! The layer norm workload of `ferrograd bench elementwise` (`layer_norm RxC`; PyTorch twin:
//! `F.layer_norm(x, (cols,), w, b, eps)` in bench/torch_elementwise.py): f32 rows with a weight and
//! a bias, one read of x and one write of y (w and b, one row each, are not counted).

use crate::fused::bench::{row_f64, Workload};
use crate::{Result, Tensor};

/// The layer_norm workload that `ferrograd bench elementwise` times (see [`crate::fused::bench`]).
pub struct LayerNormBench {
    x: Tensor,
    w: Tensor,
    b: Tensor,
    eps: f64,
}

impl LayerNormBench {
    /// Layer norm of `x` (`[rows, cols]`) with weight `w` and bias `b` (`[cols]`).
    pub fn new(x: Tensor, w: Tensor, b: Tensor, eps: f64) -> LayerNormBench {
        LayerNormBench { x, w, b, eps }
    }
}

impl Workload for LayerNormBench {
    fn name(&self) -> &'static str {
        "layer_norm"
    }

    fn bytes(&self) -> usize {
        2 * self.x.elem_count() * self.x.dtype().size_in_bytes()
    }

    fn run(&self) -> Result<Tensor> {
        self.x.layer_norm(Some(&self.w), Some(&self.b), self.eps)
    }

    fn reference(&self, r: usize) -> Result<Vec<f64>> {
        let (x, w, b) = (row_f64(&self.x, r)?, self.w.to_f64_vec()?, self.b.to_f64_vec()?);
        let n = x.len() as f64;
        let mean = x.iter().sum::<f64>() / n;
        let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
        let rstd = 1.0 / (var + self.eps).sqrt();
        Ok(x.iter().zip(w).zip(b).map(|((v, w), b)| (v - mean) * rstd * w + b).collect())
    }
}
