//! The residual-add + layer norm workloads of `ferrograd bench fused` (twin: `x + r` then
//! `F.layer_norm` in bench/torch_fused.py): rows with a weight and a bias; the forward reads x and r
//! and writes h and y (w and b, one row each, are not counted).

use crate::fused::bench::{fused_backward_folding, row_f64, Workload};
use crate::{Error, Result, Tensor};

/// The add_layer_norm workload that `ferrograd bench elementwise` times (see [`crate::fused::bench`]).
pub struct AddLayerNormBench {
    x: Tensor,
    r: Tensor,
    w: Tensor,
    b: Tensor,
    eps: f64,
}

impl AddLayerNormBench {
    /// `x + r` then layer norm, `x`, `r` `[rows, cols]`, weight `w` and bias `b` `[cols]`.
    pub fn new(x: Tensor, r: Tensor, w: Tensor, b: Tensor, eps: f64) -> AddLayerNormBench {
        AddLayerNormBench { x, r, w, b, eps }
    }

    /// The inputs `(x, r, w, b)` (the forward+backward bench tracks gradients of them).
    pub fn inputs(&self) -> (&Tensor, &Tensor, &Tensor, &Tensor) {
        (&self.x, &self.r, &self.w, &self.b)
    }

    /// Forward and backward given the gradients arriving at `h` (`dh`, from the next residual) and
    /// at `y` (`dy`): what the tape runs for this op, without the graph walk (as
    /// `torch.autograd.grad((h, y), (x, r, w, b), (dh, dy))`): the forward with tracked inputs, then
    /// layer norm's backward kernel on `y`'s record with `dh` as h's pending gradient, which it
    /// folds into dh's store (`dx = dr = dh_ln + dh`, dweight, dbias). Returns
    /// `(y, [dx, dweight, dbias])`.
    pub fn forward_backward(&self, dh: &Tensor, dy: &Tensor) -> Result<(Tensor, Vec<Tensor>)> {
        let vars = [&self.x, &self.r, &self.w, &self.b].map(|t| t.requires_grad());
        let (_h, y) = self.forward(&vars[0], &vars[1], &vars[2], &vars[3])?;
        // y's record has the inputs (h, weight, bias).
        let pending = [Some(dh.clone()), None, None];
        let mut grads = fused_backward_folding(&y, dy, &pending, "add_layer_norm")?.into_iter();
        let (Some(dx), Some(dw), Some(db)) = (grads.next(), grads.next(), grads.next()) else {
            return Err(Error::Backward("add_layer_norm bench: fewer than 3 gradients".into()));
        };
        Ok((y, vec![dx, dw, db]))
    }

    /// `(h, y)`.
    pub fn forward(&self, x: &Tensor, r: &Tensor, w: &Tensor, b: &Tensor) -> Result<(Tensor, Tensor)> {
        x.add_layer_norm(r, Some(w), Some(b), self.eps)
    }
}

impl Workload for AddLayerNormBench {
    fn name(&self) -> &'static str {
        "add_layer_norm"
    }

    fn bytes(&self) -> usize {
        4 * self.x.elem_count() * self.x.dtype().size_in_bytes()
    }

    /// `y` (the row the reference gives; `h` is checked by the tests).
    fn run(&self) -> Result<Tensor> {
        Ok(self.forward(&self.x, &self.r, &self.w, &self.b)?.1)
    }

    fn reference(&self, row: usize) -> Result<Vec<f64>> {
        let (x, r) = (row_f64(&self.x, row)?, row_f64(&self.r, row)?);
        // h rounded to the dtype, as the op does.
        let h =
            Tensor::from_vec(x.iter().zip(&r).map(|(a, b)| a + b).collect::<Vec<f64>>(), x.len(), crate::Device::Cpu)?
                .to_dtype(self.x.dtype())?
                .to_f64_vec()?;
        let (w, b) = (self.w.to_f64_vec()?, self.b.to_f64_vec()?);
        let n = h.len() as f64;
        let mean = h.iter().sum::<f64>() / n;
        let var = h.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
        let rstd = 1.0 / (var + self.eps).sqrt();
        Ok(h.iter().zip(w).zip(b).map(|((v, w), b)| (v - mean) * rstd * w + b).collect())
    }
}
