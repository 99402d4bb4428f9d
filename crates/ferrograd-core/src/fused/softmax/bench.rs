//! The softmax workload of `ferrograd bench elementwise` (`softmax RxC`; PyTorch twin:
//! `torch.softmax(x, dim=-1)` in bench/torch_elementwise.py): f32 rows, one read and one write.

use crate::fused::bench::{row_f64, Workload};
use crate::{Result, Tensor};

/// The softmax workload that `ferrograd bench elementwise` times (see [`crate::fused::bench`]).
pub struct SoftmaxBench {
    x: Tensor,
}

impl SoftmaxBench {
    /// Softmax over the last dim of `x` (`[rows, cols]`).
    pub fn new(x: Tensor) -> SoftmaxBench {
        SoftmaxBench { x }
    }
}

impl Workload for SoftmaxBench {
    fn name(&self) -> &'static str {
        "softmax"
    }

    fn bytes(&self) -> usize {
        2 * self.x.elem_count() * self.x.dtype().size_in_bytes()
    }

    fn run(&self) -> Result<Tensor> {
        self.x.softmax(-1isize)
    }

    fn reference(&self, r: usize) -> Result<Vec<f64>> {
        let x = row_f64(&self.x, r)?;
        let m = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = x.iter().map(|v| (v - m).exp()).collect();
        let s: f64 = e.iter().sum();
        Ok(e.iter().map(|v| v / s).collect())
    }
}
