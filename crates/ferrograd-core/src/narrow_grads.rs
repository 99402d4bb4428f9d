//! The gradients that `narrow` nodes hand their input during a backward walk, kept as slices until
//! the input's gradient is needed (`backprop.rs`): then one `cat` of the slices, with the gaps as
//! stride-0 zeros, gives the sum of the slices each padded to the input's shape, without the
//! padded buffers and the adds. A split of one tensor into parts (Mamba's input projection into x
//! and z, its x projection into dt, B and C; a fused QKV into q, k, v) has its gradient written
//! once. Slices along different dims, or overlapping ones, are padded and summed in arrival order,
//! as a plain narrow gradient would be.

use crate::{Result, Tensor, TensorId};
use std::collections::HashMap;

struct Slice {
    dim: usize,
    start: usize,
    g: Tensor,
}

/// Slices of gradients by the id of the tensor they were narrowed from (with that tensor's dims).
#[derive(Default)]
pub(crate) struct NarrowGrads(HashMap<TensorId, (Vec<usize>, Vec<Slice>)>);

impl NarrowGrads {
    /// `g`, the gradient of `x.narrow(dim, start, _)`, for `x`.
    pub(crate) fn push(&mut self, x: &Tensor, dim: usize, start: usize, g: Tensor) {
        self.0.entry(x.id()).or_insert_with(|| (x.dims().to_vec(), vec![])).1.push(Slice { dim, start, g });
    }

    /// The whole gradient of `x`: what `grads` holds for it plus its slices (`None`: neither).
    pub(crate) fn take(&mut self, grads: &mut HashMap<TensorId, Tensor>, x: &Tensor) -> Result<Option<Tensor>> {
        let g = grads.remove(&x.id());
        let Some((dims, slices)) = self.0.remove(&x.id()) else { return Ok(g) };
        let joined = join(&dims, slices)?;
        Ok(Some(match g {
            Some(g) => g.add(&joined)?,
            None => joined,
        }))
    }
}

/// `g` (the gradient of a narrow of length `g.dims()[dim]` at `start`) placed in `dims` between
/// zeros: the plain narrow gradient.
pub(crate) fn padded(dims: &[usize], dim: usize, start: usize, g: &Tensor) -> Result<Tensor> {
    let len = g.dims()[dim];
    let mut parts = vec![];
    if start > 0 {
        parts.push(zeros(dims, dim, start, g)?);
    }
    parts.push(g.clone());
    if start + len < dims[dim] {
        parts.push(zeros(dims, dim, dims[dim] - start - len, g)?);
    }
    Tensor::cat(&parts, dim)
}

/// `n` zeros along `dim` (`dims` elsewhere) as a view of one zero of g's dtype and device: cat
/// writes them without a buffer or a fill of their own.
fn zeros(dims: &[usize], dim: usize, n: usize, g: &Tensor) -> Result<Tensor> {
    let mut d = dims.to_vec();
    d[dim] = n;
    Tensor::zeros((), g.dtype(), g.device())?.broadcast_as(d)
}

fn join(dims: &[usize], slices: Vec<Slice>) -> Result<Tensor> {
    let Some(first) = slices.first() else {
        return Err(crate::Error::Backward("a narrow gradient with no slices".into()));
    };
    let dim = first.dim;
    let mut order: Vec<usize> = (0..slices.len()).collect();
    order.sort_by_key(|&i| slices[i].start);
    let end = |s: &Slice| s.start + s.g.dims()[s.dim];
    let disjoint = order.windows(2).all(|w| end(&slices[w[0]]) <= slices[w[1]].start);
    if !(disjoint && slices.iter().all(|s| s.dim == dim)) {
        let mut sum = padded(dims, first.dim, first.start, &first.g)?;
        for s in &slices[1..] {
            sum = sum.add(&padded(dims, s.dim, s.start, &s.g)?)?;
        }
        return Ok(sum);
    }
    let mut parts = vec![];
    let mut at = 0;
    for &i in &order {
        let s = &slices[i];
        if s.start > at {
            parts.push(zeros(dims, dim, s.start - at, &s.g)?);
        }
        at = end(s);
        parts.push(s.g.clone());
    }
    if at < dims[dim] {
        parts.push(zeros(dims, dim, dims[dim] - at, &first.g)?);
    }
    Tensor::cat(&parts, dim)
}
