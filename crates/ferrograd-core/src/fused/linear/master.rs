//! Master weights: a linear (or mlp) whose weights and biases are f32 while `x` is f16/bf16, what
//! autocast means by a matmul over f32 parameters. The op casts the weight down itself, with one
//! dense cast in the weight's own storage order (a transposed view stays a transposed view of the
//! cast: no strided reads), runs the half-precision GEMM, keeps the cast weight for the
//! backward's `dx`, and writes `dW` and `db` in f32 straight from the GEMM (f32 output of an f16/bf16
//! product, `cuda/blaslt`), `dW` in the weight's own layout. The composition it replaces (cast,
//! transpose, linear) ended its backward in a strided cast of a transposed bf16 `dW` to f32 per
//! weight, and a cast per bias.
//!
//! A weight's gradient follows the weight's layout wherever the GEMM can write it so: a weight
//! stored transposed (`w_io.t()`, GPT-2's Conv1D `[in, out]` read as `[out, in]`) gets its gradient
//! written transposed, so the transpose's backward hands the leaf a contiguous `[in, out]`
//! gradient, as PyTorch's `AccumulateGrad` keeps a gradient in its parameter's strides.

use crate::backend::BackendStorage;
use crate::{DType, Layout, Result, Shape, Tensor};

/// Whether a linear over `x` of dtype `x` and parameters of dtype `w` is a master-weight linear
/// (`Some(true)`), a plain one (`Some(false)`), or not allowed (`None`).
pub(super) fn is_master(x: DType, w: DType) -> Option<bool> {
    if w == x {
        Some(false)
    } else if w == DType::F32 && matches!(x, DType::F16 | DType::BF16) {
        Some(true)
    } else {
        None
    }
}

/// The order in which `l` walks its storage when it views a dense block in some dim order:
/// `perm[i]` is the dim stored `i`-th outermost (`[0, 1]` row-major, `[1, 0]` a transposed
/// matrix). `None` for anything else (gaps, overlaps, broadcasts). Size-1 dims go first.
pub(super) fn storage_order(l: &Layout) -> Option<Vec<usize>> {
    let (d, s) = (l.dims(), l.strides());
    let mut perm: Vec<usize> = (0..d.len()).collect();
    perm.sort_by_key(|&i| std::cmp::Reverse(if d[i] == 1 { usize::MAX } else { s[i] }));
    let mut expect = 1usize;
    for &i in perm.iter().rev() {
        if d[i] != 1 && s[i] != expect {
            return None;
        }
        expect = expect.saturating_mul(d[i]);
    }
    Some(perm)
}

/// Whether a 2-D weight is stored transposed (its gradient is then written transposed too).
pub(super) fn stored_transposed(l: &Layout) -> bool {
    l.dims().len() == 2 && storage_order(l).is_some_and(|p| p == [1, 0])
}

/// A weight cast down: the new storage (dense, in the weight's storage order, or row-major when it
/// had none), the shape it is saved under, and the layout that views it as the weight.
pub(super) struct Lowered<S> {
    pub(super) s: S,
    pub(super) saved: Shape,
    pub(super) view: Layout,
}

/// Cast `(s, l)` to `dtype` reading its storage in order (one contiguous cast).
pub(super) fn lower<S: BackendStorage>(s: &S, l: &Layout, dtype: DType) -> Result<Lowered<S>> {
    let Some(perm) = storage_order(l) else {
        let s = s.to_dtype(l, dtype)?;
        return Ok(Lowered { s, saved: l.shape().clone(), view: Layout::contiguous(l.shape().clone()) });
    };
    let stored: Vec<usize> = perm.iter().map(|&i| l.dims()[i]).collect();
    let dense = Layout::contiguous_with_offset(stored.clone(), l.offset());
    // A master weight with a kept copy (`cuda::ShadowSet`, updated by the optimizer) is not cast.
    let cast = match s.kept_cast(&dense, dtype) {
        Some(kept) => kept,
        None => s.to_dtype(&dense, dtype)?,
    };
    // Dim perm[i] of the weight is dim i of the dense copy.
    let mut strides = vec![0; perm.len()];
    for (i, &p) in perm.iter().enumerate() {
        strides[p] = dense.strides()[i];
    }
    Ok(Lowered { s: cast, saved: Shape::from(stored), view: Layout::new(l.shape().clone(), strides, 0) })
}

/// The saved cast of `w` ([`lower`]'s `saved` shape) viewed with `w`'s dims, as the forward read it.
pub(super) fn view_as(saved: &Tensor, w: &Tensor) -> Result<Tensor> {
    match storage_order(w.layout()) {
        Some(perm) => {
            let mut inv = vec![0; perm.len()];
            for (i, &p) in perm.iter().enumerate() {
                inv[p] = i;
            }
            saved.permute(&inv)
        }
        None => Ok(saved.clone()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn storage_orders() {
        let l = Layout::contiguous((3, 4));
        assert_eq!(storage_order(&l), Some(vec![0, 1]));
        let t = l.transpose(0, 1).expect("transpose");
        assert_eq!(storage_order(&t), Some(vec![1, 0]));
        assert!(stored_transposed(&t) && !stored_transposed(&l));
        // A narrowed matrix has gaps; a broadcast overlaps.
        assert_eq!(storage_order(&l.narrow(1, 0, 2).expect("narrow")), None);
        assert_eq!(storage_order(&Layout::new(Shape::from((3, 4)), vec![0, 1], 0)), None);
        // Size-1 dims are anywhere.
        assert_eq!(storage_order(&Layout::new(Shape::from((1, 4)), vec![9, 1], 2)), Some(vec![0, 1]));
        let p = Layout::contiguous((2, 3, 4)).permute(&[2, 0, 1]).expect("permute");
        assert_eq!(storage_order(&p), Some(vec![1, 2, 0]));
    }

    #[test]
    fn lowered_weights_view_the_same_values() -> Result<()> {
        let w = Tensor::from_vec((0..12).map(|v| v as f32 * 0.5).collect::<Vec<_>>(), (3, 4), crate::Device::Cpu)?;
        for v in [w.clone(), w.t()?, w.narrow(1, 1, 2)?] {
            let low = {
                let st = v.storage();
                let cpu = st.as_cpu().ok_or_else(|| crate::Error::Cuda("not on the cpu".into()))?;
                lower(cpu, v.layout(), DType::BF16)?
            };
            let saved = Tensor::from_storage(crate::storage::Storage::Cpu(low.s), low.saved, None);
            let viewed = view_as(&saved, &v)?;
            assert_eq!(viewed.dims(), v.dims());
            assert_eq!(viewed.to_dtype(DType::F32)?.to_vec::<f32>()?, v.contiguous()?.to_vec::<f32>()?);
            assert_eq!(viewed.layout().strides(), low.view.strides());
        }
        Ok(())
    }
}
