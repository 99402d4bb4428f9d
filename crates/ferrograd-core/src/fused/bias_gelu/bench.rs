//! The bias + GELU workload of `ferrograd bench fused` (twin: `F.gelu(x + b, approximate="tanh")`
//! in bench/torch_fused.py): the forward reads x and writes y (b, one row, is not counted); the
//! backward reads dy and x and writes dx (db, one row, is not counted).

use crate::fused::bench::{fused_backward, row_f64, Workload};
use crate::op::UnaryOp;
use crate::{Result, Tensor};

/// The bias_gelu workload that `ferrograd bench elementwise` times (see [`crate::fused::bench`]).
pub struct BiasGeluBench {
    x: Tensor,
    b: Tensor,
}

impl BiasGeluBench {
    /// `gelu_tanh(x + b)`, `x` `[rows, cols]`, `b` `[cols]`.
    pub fn new(x: Tensor, b: Tensor) -> BiasGeluBench {
        BiasGeluBench { x, b }
    }

    /// The inputs `(x, b)`.
    pub fn inputs(&self) -> (&Tensor, &Tensor) {
        (&self.x, &self.b)
    }

    /// Forward with tracked inputs and the op's backward given `dy`, without the graph walk (as
    /// `torch.autograd.grad(y, (x, b), dy)`): returns `(y, [dx, db])`.
    pub fn forward_backward(&self, dy: &Tensor) -> Result<(Tensor, Vec<Tensor>)> {
        let y = self.x.requires_grad().bias_gelu(&self.b.requires_grad())?;
        let grads = fused_backward(&y, dy, "bias_gelu")?;
        Ok((y.detach(), grads))
    }
}

impl Workload for BiasGeluBench {
    fn name(&self) -> &'static str {
        "bias_gelu"
    }

    fn bytes(&self) -> usize {
        2 * self.x.elem_count() * self.x.dtype().size_in_bytes()
    }

    fn run(&self) -> Result<Tensor> {
        self.x.bias_gelu(&self.b)
    }

    /// `x + b` rounded to the dtype (as the op), then tanh-GELU in f64.
    fn reference(&self, row: usize) -> Result<Vec<f64>> {
        let (x, b) = (row_f64(&self.x, row)?, self.b.to_f64_vec()?);
        let z =
            Tensor::from_vec(x.iter().zip(&b).map(|(x, b)| x + b).collect::<Vec<f64>>(), x.len(), crate::Device::Cpu)?
                .to_dtype(self.x.dtype())?
                .to_f64_vec()?;
        Ok(z.into_iter().map(|v| UnaryOp::GeluTanh.eval_f64(v)).collect())
    }
}
