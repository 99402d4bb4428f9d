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
