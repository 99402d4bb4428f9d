//! The op families a backend implements. `Storage` dispatches to the CPU or CUDA implementation;
//! both implement this trait, and one shared test suite checks them against each other.
//!
//! Conventions: every method reads its inputs through their `Layout` (strided, broadcast or offset
//! views are read in place) and returns a new contiguous storage of the output's logical shape.

use crate::op::{ArgReduceOp, BinaryOp, CmpOp, ReduceOp, UnaryOp};
use crate::{DType, Device, Layout, Result};

/// Sizes of a (batched) matrix product: `batch` products of `[m, k] x [k, n]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatmulDims {
    /// Number of independent products.
    pub batch: usize,
    /// Rows of the left operand and of the result.
    pub m: usize,
    /// Columns of the right operand and of the result.
    pub n: usize,
    /// The contracted dimension.
    pub k: usize,
}

/// The ops every backend's storage implements (CPU: [`CpuStorage`](crate::cpu::CpuStorage), CUDA:
/// [`CudaStorage`](crate::cuda::CudaStorage)). Users call [`Tensor`](crate::Tensor) methods; this
/// trait is what a new backend would implement.
pub trait BackendStorage: Sized {
    /// The element type held.
    fn dtype(&self) -> DType;
    /// The device the elements live on.
    fn device(&self) -> Device;

    /// A contiguous copy of the viewed elements.
    fn copy_strided(&self, l: &Layout) -> Result<Self>;
    /// Copy the viewed elements into `dst` (contiguous) starting at element `dst_offset`.
    fn copy_strided_into(&self, l: &Layout, dst: &mut Self, dst_offset: usize) -> Result<()>;
    /// Copy the viewed elements into the view `dl` of `dst`: element i of one (row-major order)
    /// to element i of the other. `dl` has `l`'s element count, lies inside `dst` and does not
    /// overlap itself: [`check_view_dst`]. (`Tensor::cat`
    /// along any dim: each input into its slice of the output.)
    fn copy_into_view(&self, l: &Layout, dst: &mut Self, dl: &Layout) -> Result<()>;
    /// The viewed elements converted to `dtype`.
    fn to_dtype(&self, l: &Layout, dtype: DType) -> Result<Self>;
    /// A kept copy of `to_dtype(l, dtype)`'s result, when the backend holds one (a master weight's
    /// low-precision copy that the optimizer keeps current: `cuda/shadow.rs`); `None`: cast.
    fn kept_cast(&self, _l: &Layout, _dtype: DType) -> Option<Self> {
        None
    }

    /// An elementwise map of the viewed elements.
    fn unary(&self, l: &Layout, op: UnaryOp) -> Result<Self>;
    /// Both layouts have the output's shape (broadcasting is done by the caller with stride-0 views).
    fn binary(&self, l: &Layout, rhs: &Self, rl: &Layout, op: BinaryOp) -> Result<Self>;
    /// Elementwise comparison; the result is u8 (0 or 1).
    fn cmp(&self, l: &Layout, rhs: &Self, rl: &Layout, op: CmpOp) -> Result<Self>;
    /// `self` is the condition (any dtype, non-zero = true); all three layouts share one shape.
    fn where_cond(&self, l: &Layout, t: &Self, tl: &Layout, f: &Self, fl: &Layout) -> Result<Self>;

    /// Reduce over `dims` (sorted); the output keeps them as size 1.
    fn reduce(&self, l: &Layout, op: ReduceOp, dims: &[usize]) -> Result<Self>;
    /// Index of the max/min along `dim` as u32, `dim` kept as size 1; first index wins ties.
    fn arg_reduce(&self, l: &Layout, op: ArgReduceOp, dim: usize) -> Result<Self>;

    /// Batched matmul; both layouts are rank >= 2 with identical (possibly broadcast) batch dims.
    fn matmul(&self, l: &Layout, rhs: &Self, rl: &Layout, dims: MatmulDims) -> Result<Self>;

    /// Select slices along `dim` with an integer index vector (any integer dtype, 1-D).
    fn index_select(&self, l: &Layout, ids: &Self, il: &Layout, dim: usize) -> Result<Self>;
    /// `out[i][j][k] = self[i][ids[i][j][k]][k]` for dim 1 (PyTorch's gather).
    fn gather(&self, l: &Layout, ids: &Self, il: &Layout, dim: usize) -> Result<Self>;
    /// `dst[.., ids[j], ..] = self[.., j, ..]` along `dim`, in place (`torch.index_copy_`): `dl` is a
    /// contiguous view of `dst` (offset honoured); `self` viewed through `sl` has `dl`'s dims with
    /// the number of ids at `dim`.
    #[allow(clippy::too_many_arguments)]
    fn index_copy_into(
        &self,
        sl: &Layout,
        ids: &Self,
        il: &Layout,
        dst: &mut Self,
        dl: &Layout,
        dim: usize,
    ) -> Result<()>;
    /// `out = self; out.index_select(dim, ids) += src` (self contiguous, the backward of index_select).
    fn index_add(&self, l: &Layout, ids: &Self, il: &Layout, src: &Self, sl: &Layout, dim: usize) -> Result<Self>;
    /// `out = self; out[.. ids[i][j] ..] += src[i][j]` (the backward of gather).
    fn scatter_add(&self, l: &Layout, ids: &Self, il: &Layout, src: &Self, sl: &Layout, dim: usize) -> Result<Self>;
}

/// The checks of [`BackendStorage::copy_into_view`] for a destination of `dst_len` elements.
pub fn check_view_dst(l: &Layout, dl: &Layout, dst_len: usize) -> Result<()> {
    let op = "copy_into_view";
    if l.elem_count() != dl.elem_count() {
        return Err(crate::shape_err!(op, "{:?} into a view of {:?}", l.dims(), dl.dims()));
    }
    if dl.elem_count() == 0 {
        return Ok(());
    }
    // Distinct elements must land on distinct places (the kernels write them in parallel): with the
    // dims of size above 1 sorted by stride, each stride must pass everything the smaller ones
    // reach. (Sufficient, and what every view made by narrow, permute or slicing satisfies.)
    let mut by_stride: Vec<(usize, usize)> =
        dl.dims().iter().zip(dl.strides()).filter(|(&d, _)| d > 1).map(|(&d, &s)| (s, d)).collect();
    by_stride.sort_unstable();
    let mut reach = 0usize;
    for (s, d) in by_stride {
        if s <= reach || s == 0 {
            return Err(crate::shape_err!(
                op,
                "the destination view {:?} (strides {:?}) repeats elements",
                dl.dims(),
                dl.strides()
            ));
        }
        reach = reach.saturating_add((d - 1).saturating_mul(s));
    }
    let last = dl
        .dims()
        .iter()
        .zip(dl.strides())
        .try_fold(dl.offset(), |acc, (&d, &s)| acc.checked_add((d - 1).checked_mul(s)?));
    match last {
        Some(i) if i < dst_len => Ok(()),
        _ => Err(crate::shape_err!(
            op,
            "the destination view {:?} (offset {}) overflows {dst_len} elements",
            dl.dims(),
            dl.offset()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::check_view_dst;
    use crate::{Layout, Shape};

    #[test]
    fn view_destinations_are_checked() {
        let src = Layout::contiguous(Shape::from(vec![3, 4]));
        let out = Layout::contiguous(Shape::from(vec![3, 10]));
        assert!(check_view_dst(&src, &out.narrow(1, 6, 4).unwrap(), 30).is_ok());
        let err = |dl: &Layout, len: usize| check_view_dst(&src, dl, len).unwrap_err().to_string();
        assert!(err(&out.narrow(1, 6, 3).unwrap(), 30).contains("into a view"), "count");
        assert!(err(&out.narrow(1, 6, 4).unwrap(), 29).contains("overflows"), "past the end");
        let repeated = Layout::new(Shape::from(vec![3, 4]), vec![0, 1], 0);
        assert!(err(&repeated, 30).contains("repeats elements"), "stride 0");
        let overlapping = Layout::new(Shape::from(vec![3, 4]), vec![2, 1], 0);
        assert!(err(&overlapping, 30).contains("repeats elements"), "rows overlapping the next");
        let transposed = Layout::new(Shape::from(vec![3, 4]), vec![1, 3], 0);
        assert!(check_view_dst(&src, &transposed, 12).is_ok(), "a permuted view repeats nothing");
        // Nothing to copy: no check of the (empty) destination's extent.
        let empty = Layout::contiguous(Shape::from(vec![0, 4]));
        assert!(check_view_dst(&empty, &Layout::new(Shape::from(vec![0, 4]), vec![4, 1], 99), 0).is_ok());
    }
}
