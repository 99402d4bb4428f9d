//! The CUDA implementation of the backend's primitive ops: one file per kernel family, mirroring
//! `kernels/` (`copy.rs` launches `copy.cu`, ...). Each op is one or two launches on the current
//! stream (docs/kernel-abi.md); none waits for the device.

mod binary;
mod cast;
mod copy;
pub(crate) mod index;
pub(crate) mod optim;
mod reduce;
mod rng;
mod unary;

use super::storage::CudaStorage;
use crate::backend::{BackendStorage, MatmulDims};
use crate::op::{ArgReduceOp, BinaryOp, CmpOp, ReduceOp, UnaryOp};
use crate::{DType, Device, Error, Layout, Result};

/// Both operands of a binary op share dtype and device.
pub(crate) fn same_dtype(op: &'static str, a: &CudaStorage, b: &CudaStorage) -> Result<()> {
    if a.dtype() != b.dtype() {
        return Err(Error::DTypeMismatch { op, lhs: a.dtype(), rhs: b.dtype() });
    }
    if a.dev().ordinal != b.dev().ordinal {
        return Err(Error::DeviceMismatch { op, lhs: a.device(), rhs: b.device() });
    }
    Ok(())
}

/// Whether the elementwise maps read `s` viewed by `l` through their 16-byte vector path
/// (`fg_mode == FG_CONTIG` and `fg_aligned(.., 16)` in the kernels), for the launch's grid.
pub(crate) fn vector_ok(s: &CudaStorage, l: &Layout) -> bool {
    l.is_contiguous() && s.buf.ptr_at(l.offset()).is_multiple_of(16)
}

impl BackendStorage for CudaStorage {
    fn dtype(&self) -> DType {
        self.buf.dtype
    }

    fn device(&self) -> Device {
        Device::Cuda(self.dev().ordinal)
    }

    fn copy_strided(&self, l: &Layout) -> Result<Self> {
        copy::copy_strided(self, l)
    }

    fn copy_strided_into(&self, l: &Layout, dst: &mut Self, dst_offset: usize) -> Result<()> {
        copy::copy_strided_into(self, l, dst, dst_offset)
    }

    fn copy_into_view(&self, l: &Layout, dst: &mut Self, dl: &Layout) -> Result<()> {
        copy::copy_into_view(self, l, dst, dl)
    }

    fn to_dtype(&self, l: &Layout, dtype: DType) -> Result<Self> {
        cast::to_dtype(self, l, dtype)
    }

    fn kept_cast(&self, l: &Layout, dtype: DType) -> Option<Self> {
        crate::cuda::shadow::kept_cast(self, l, dtype)
    }

    fn unary(&self, l: &Layout, op: UnaryOp) -> Result<Self> {
        unary::unary(self, l, op)
    }

    fn binary(&self, l: &Layout, rhs: &Self, rl: &Layout, op: BinaryOp) -> Result<Self> {
        binary::binary(self, l, rhs, rl, op)
    }

    fn cmp(&self, l: &Layout, rhs: &Self, rl: &Layout, op: CmpOp) -> Result<Self> {
        binary::cmp(self, l, rhs, rl, op)
    }

    fn where_cond(&self, l: &Layout, t: &Self, tl: &Layout, f: &Self, fl: &Layout) -> Result<Self> {
        binary::where_cond(self, l, t, tl, f, fl)
    }

    fn reduce(&self, l: &Layout, op: ReduceOp, dims: &[usize]) -> Result<Self> {
        reduce::reduce(self, l, op, dims)
    }

    fn arg_reduce(&self, l: &Layout, op: ArgReduceOp, dim: usize) -> Result<Self> {
        reduce::arg_reduce(self, l, op, dim)
    }

    fn matmul(&self, l: &Layout, rhs: &Self, rl: &Layout, dims: MatmulDims) -> Result<Self> {
        same_dtype("matmul", self, rhs)?;
        super::matmul::matmul(self, l, rhs, rl, dims)
    }

    fn index_select(&self, l: &Layout, ids: &Self, il: &Layout, dim: usize) -> Result<Self> {
        index::index_select(self, l, ids, il, dim)
    }

    fn gather(&self, l: &Layout, ids: &Self, il: &Layout, dim: usize) -> Result<Self> {
        index::gather(self, l, ids, il, dim)
    }

    fn index_add(&self, l: &Layout, ids: &Self, il: &Layout, src: &Self, sl: &Layout, dim: usize) -> Result<Self> {
        index::index_add(self, l, ids, il, src, sl, dim)
    }

    fn index_copy_into(
        &self,
        sl: &Layout,
        ids: &Self,
        il: &Layout,
        dst: &mut Self,
        dl: &Layout,
        dim: usize,
    ) -> Result<()> {
        index::index_copy_into(self, sl, ids, il, dst, dl, dim)
    }

    fn scatter_add(&self, l: &Layout, ids: &Self, il: &Layout, src: &Self, sl: &Layout, dim: usize) -> Result<Self> {
        index::scatter_add(self, l, ids, il, src, sl, dim)
    }
}
