//! The fused classifier workload of `ferrograd bench fused` (`classifier fwd+bwd RxC`; twin:
//! `F.log_softmax` + `F.nll_loss` forward and backward in bench/torch_fused.py): the mean loss and
//! the logits' gradient of `[R, C]` logits. The fewest bytes: the logits read once and their
//! gradient written once (2 x N elements: the kernel keeps each row in shared memory between its
//! two passes).

use crate::fused::bench::{row_f64, Workload};
use crate::{DType, Result, Rng, Tensor};

use super::ClassifierOpts;

/// The fused classifier workload that `ferrograd bench elementwise` times (see [`crate::fused::bench`]).
pub struct ClassifierBench {
    x: Tensor,
    t: Tensor,
}

impl ClassifierBench {
    /// Logits `x` (`[rows, cols]`) and class ids drawn uniformly from `rng` on `x`'s device.
    pub fn new(x: Tensor, rng: &mut Rng) -> Result<ClassifierBench> {
        let (rows, cols) = (x.dims()[0], x.dims()[1]);
        let u = Tensor::rand_with(rng, 0.0, cols as f64, rows, DType::F64, crate::Device::Cpu)?;
        let t = u.to_dtype(DType::U32)?.to_device(x.device())?;
        Ok(ClassifierBench { x, t })
    }

    /// `(loss, dlogits)` into a new gradient buffer (the timed call: the logits stay intact so
    /// that every repetition sees the same input).
    pub fn loss_grad(&self) -> Result<(Tensor, Tensor)> {
        self.x.classifier_loss_grad(&self.t, ClassifierOpts::default())
    }

    /// The logits `[rows, classes]`.
    pub fn logits(&self) -> &Tensor {
        &self.x
    }

    /// The target class per row (u32).
    pub fn targets(&self) -> &Tensor {
        &self.t
    }
}

impl Workload for ClassifierBench {
    fn name(&self) -> &'static str {
        "classifier"
    }

    fn bytes(&self) -> usize {
        2 * self.x.elem_count() * self.x.dtype().size_in_bytes()
    }

    /// The gradient of the mean loss with respect to the logits.
    fn run(&self) -> Result<Tensor> {
        Ok(self.loss_grad()?.1)
    }

    fn reference(&self, r: usize) -> Result<Vec<f64>> {
        let (x, rows) = (row_f64(&self.x, r)?, self.x.dims()[0] as f64);
        let t = self.t.narrow(0, r, 1)?.to_f64_vec()?[0] as usize;
        let m = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let s: f64 = x.iter().map(|v| (v - m).exp()).sum();
        Ok(x.iter().enumerate().map(|(j, v)| ((v - m).exp() / s - (j == t) as u8 as f64) / rows).collect())
    }
}
