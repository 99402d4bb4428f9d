//! What a fused op's `bench.rs` provides: the workload `ferrograd bench elementwise` times and
//! checks, next to the op it measures (the PyTorch twin is `bench/torch_elementwise.py`).

use crate::fused::FusedCtx;
use crate::op::Op;
use crate::{Error, Result, Tensor};

/// One fused op on fixed inputs: the call that is timed, the bytes it must move at the least
/// (every input read once, every output written once), and a float64 reference of one output row
/// for the correctness check that runs before timing.
pub trait Workload {
    /// The row name in the bench table (paired with the PyTorch twin's row by it).
    fn name(&self) -> &'static str;
    /// The fewest bytes one call moves.
    fn bytes(&self) -> usize;
    /// One call: the tensor whose rows `reference` describes.
    fn run(&self) -> Result<Tensor>;
    /// Row `r` of what `run` returns, computed in f64 on the host from the inputs.
    fn reference(&self, r: usize) -> Result<Vec<f64>>;
}

/// ‖x − y‖ / ‖y‖ in f64; infinite when the lengths differ or a value is not finite.
pub fn rel_err(x: &[f64], y: &[f64]) -> f64 {
    if x.len() != y.len() || x.iter().chain(y).any(|v| !v.is_finite()) {
        return f64::INFINITY;
    }
    let num: f64 = x.iter().zip(y).map(|(a, b)| (a - b) * (a - b)).sum();
    let den: f64 = y.iter().map(|b| b * b).sum();
    if num == 0.0 {
        0.0
    } else {
        (num / den).sqrt()
    }
}

/// The op's own backward on the record of `out` (made by a fused op from tracked inputs), given the
/// gradient of its output, without the graph walk: what a bench times as "the backward". Every
/// input must get a gradient; `what` names the bench in errors.
pub(crate) fn fused_backward(out: &Tensor, grad: &Tensor, what: &str) -> Result<Vec<Tensor>> {
    fused_backward_folding(out, grad, &[], what)
}

/// [`fused_backward`] with the inputs' pending gradients handed to the backward as the walk hands
/// them (`FusedOp::folds_pending`: one entry per input, `None` where nothing is pending).
pub(crate) fn fused_backward_folding(
    out: &Tensor,
    grad: &Tensor,
    pending: &[Option<Tensor>],
    what: &str,
) -> Result<Vec<Tensor>> {
    let Some(Op::Fused(rec)) = out.op() else {
        return Err(Error::Backward(format!("{what} bench: the output was not recorded as a fused op")));
    };
    let _g = crate::no_grad();
    let ctx = FusedCtx { inputs: &rec.inputs, output: out, saved: &rec.saved, pending };
    rec.op
        .backward(&ctx, grad)?
        .into_iter()
        .map(|g| g.ok_or_else(|| Error::Backward(format!("{what} bench: an input got no gradient"))))
        .collect()
}

/// Row `r` of a 2-d tensor as f64.
pub(crate) fn row_f64(t: &Tensor, r: usize) -> Result<Vec<f64>> {
    t.narrow(0, r, 1)?.to_f64_vec()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fused::cross_entropy::bench::CrossEntropyBench;
    use crate::fused::layer_norm::bench::LayerNormBench;
    use crate::fused::softmax::bench::SoftmaxBench;
    use crate::{DType, Device, Rng};

    /// Every workload's float64 reference agrees with its op, run in f64 on the CPU.
    #[test]
    fn references_match_the_ops_in_f64() -> Result<()> {
        let mut rng = Rng::new(3);
        let (r, c) = (5, 7);
        let x = Tensor::randn_with(&mut rng, 0.0, 2.0, (r, c), DType::F64, Device::Cpu)?;
        let w = Tensor::rand_with(&mut rng, 0.5, 1.5, c, DType::F64, Device::Cpu)?;
        let b = Tensor::randn_with(&mut rng, 0.0, 1.0, c, DType::F64, Device::Cpu)?;
        let loads: Vec<Box<dyn Workload>> = vec![
            Box::new(SoftmaxBench::new(x.clone())),
            Box::new(LayerNormBench::new(x.clone(), w, b, 1e-5)),
            Box::new(CrossEntropyBench::new(x.clone(), &mut rng)?),
        ];
        for load in &loads {
            assert_eq!(load.bytes() % (r * c * 8), 0, "{}", load.name());
            let out = load.run()?;
            for row in 0..r {
                let (got, want) = (row_f64(&out, row)?, load.reference(row)?);
                for (g, w) in got.iter().zip(&want) {
                    assert!((g - w).abs() <= 1e-12 * (1.0 + w.abs()), "{} row {row}: {g} vs {w}", load.name());
                }
            }
        }
        // The references themselves: a softmax row sums to 1 and keeps the order of x; a layer
        // norm row with unit weight and zero bias sums to 0.
        let x = Tensor::from_vec(vec![1.0f64, -2.0, 3.0], (1, 3), Device::Cpu)?;
        let s = SoftmaxBench::new(x.clone()).reference(0)?;
        assert!((s.iter().sum::<f64>() - 1.0).abs() < 1e-12 && s[2] > s[0] && s[0] > s[1]);
        let (one, zero) = (Tensor::ones(3, DType::F64, Device::Cpu)?, Tensor::zeros(3, DType::F64, Device::Cpu)?);
        let ln = LayerNormBench::new(x, one, zero, 1e-5).reference(0)?;
        assert!(ln.iter().sum::<f64>().abs() < 1e-12);
        Ok(())
    }
}
