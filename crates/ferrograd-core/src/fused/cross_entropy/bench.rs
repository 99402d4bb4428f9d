//! The cross-entropy workload of `ferrograd bench elementwise` (`cross_entropy RxC`; PyTorch twin:
//! `F.cross_entropy` then `torch.autograd.grad` in bench/torch_elementwise.py): the loss and the
//! logits' gradient of f32 `[R, C]` logits, as a training step needs them. The fewest bytes: the
//! forward reads the logits, the backward reads them again and writes their gradient (the per-row
//! outputs are C times smaller and not counted).

use crate::fused::bench::{row_f64, Workload};
use crate::{DType, Error, Result, Rng, Tensor};

/// The cross_entropy workload that `ferrograd bench elementwise` times (see [`crate::fused::bench`]).
pub struct CrossEntropyBench {
    x: Tensor,
    t: Tensor,
}

impl CrossEntropyBench {
    /// Logits `x` (`[rows, cols]`) and class ids drawn uniformly from `rng` on `x`'s device.
    pub fn new(x: Tensor, rng: &mut Rng) -> Result<CrossEntropyBench> {
        let (rows, cols) = (x.dims()[0], x.dims()[1]);
        let u = Tensor::rand_with(rng, 0.0, cols as f64, rows, DType::F64, crate::Device::Cpu)?;
        let t = u.to_dtype(DType::U32)?.to_device(x.device())?;
        Ok(CrossEntropyBench { x, t })
    }
}

impl Workload for CrossEntropyBench {
    fn name(&self) -> &'static str {
        "cross_entropy"
    }

    fn bytes(&self) -> usize {
        3 * self.x.elem_count() * self.x.dtype().size_in_bytes()
    }

    /// The gradient of the mean loss with respect to the logits.
    fn run(&self) -> Result<Tensor> {
        let x = self.x.requires_grad();
        let grads = x.cross_entropy(&self.t, None)?.backward()?;
        grads.get(&x).cloned().ok_or_else(|| Error::Backward("cross_entropy: no gradient for the logits".into()))
    }

    fn reference(&self, r: usize) -> Result<Vec<f64>> {
        let (x, rows) = (row_f64(&self.x, r)?, self.x.dims()[0] as f64);
        let t = self.t.narrow(0, r, 1)?.to_f64_vec()?[0] as usize;
        let m = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let s: f64 = x.iter().map(|v| (v - m).exp()).sum();
        Ok(x.iter().enumerate().map(|(j, v)| ((v - m).exp() / s - (j == t) as u8 as f64) / rows).collect())
    }
}
