//! `FERROGRAD_ATTENTION=math`: attention composed from primitive ops, differentiated through them
//! (no fused op): `softmax(scale q k^T + causal bias) v`. It materialises the `Tq x Tk` scores in
//! the input dtype, as PyTorch's "math" backend does: a reference for debugging the fused paths,
//! not a fast path. Dropout is not offered here (its mask is the fused kernels' Philox mapping).

use super::Problem;
use crate::{Error, Result, Tensor};

pub(super) fn composed(q: &Tensor, k: &Tensor, v: &Tensor, pb: &Problem, dropout_p: f64) -> Result<Tensor> {
    if dropout_p > 0.0 {
        return Err(Error::InvalidArgument(format!(
            "FERROGRAD_ATTENTION=math does not apply dropout (dropout_p = {dropout_p}); use flash or cudnn"
        )));
    }
    let mut s = q.matmul(&k.transpose(2, 3)?)?.mul_scalar(pb.scale)?;
    if pb.causal {
        let (tq, tk) = (pb.tq, pb.tk);
        let bias: Vec<f32> = (0..tq * tk).map(|e| if e % tk > e / tk { f32::NEG_INFINITY } else { 0.0 }).collect();
        s = s.add(&Tensor::from_vec(bias, (tq, tk), q.device())?.to_dtype(q.dtype())?)?;
    }
    s.softmax(-1)?.matmul(v)
}
