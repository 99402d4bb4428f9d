//! `Storage` is the enum over backends that a tensor holds. Each method forwards to the backend of
//! its operands; operands on different devices are a typed error, never an implicit copy.

use crate::backend::{BackendStorage, MatmulDims};
use crate::cpu::CpuStorage;
use crate::op::{ArgReduceOp, BinaryOp, CmpOp, ReduceOp, UnaryOp};
use crate::{DType, Device, Error, Layout, Result};

#[derive(Clone, Debug)]
pub enum Storage {
    Cpu(CpuStorage),
}

fn same_device<'a>(op: &'static str, a: &'a Storage, b: &'a Storage) -> Result<(&'a CpuStorage, &'a CpuStorage)> {
    match (a, b) {
        (Storage::Cpu(a), Storage::Cpu(b)) => Ok((a, b)),
        #[allow(unreachable_patterns)]
        _ => Err(Error::DeviceMismatch { op, lhs: a.device(), rhs: b.device() }),
    }
}

fn opt<'a>(
    op: &'static str,
    base: &'a Storage,
    p: Option<(&'a Storage, &'a Layout)>,
) -> Result<Option<(&'a CpuStorage, &'a Layout)>> {
    match p {
        None => Ok(None),
        Some((s, l)) => Ok(Some((same_device(op, base, s)?.1, l))),
    }
}

impl Storage {
    /// `n` zeros of `dtype` on `device`.
    pub fn zeros(n: usize, dtype: DType, device: Device) -> Result<Storage> {
        match device {
            Device::Cpu => Ok(Storage::Cpu(CpuStorage::full(0.0, n, dtype))),
            Device::Cuda(_) => Err(crate::device::cuda_unsupported()),
        }
    }

    pub fn as_cpu(&self) -> Option<&CpuStorage> {
        match self {
            Storage::Cpu(c) => Some(c),
        }
    }
}

impl BackendStorage for Storage {
    fn dtype(&self) -> DType {
        match self {
            Storage::Cpu(s) => s.dtype(),
        }
    }
    fn device(&self) -> Device {
        match self {
            Storage::Cpu(_) => Device::Cpu,
        }
    }
    fn copy_strided(&self, l: &Layout) -> Result<Self> {
        match self {
            Storage::Cpu(s) => Ok(Storage::Cpu(s.copy_strided(l)?)),
        }
    }
    fn copy_strided_into(&self, l: &Layout, dst: &mut Self, dst_offset: usize) -> Result<()> {
        match (self, dst) {
            (Storage::Cpu(s), Storage::Cpu(d)) => s.copy_strided_into(l, d, dst_offset),
        }
    }
    fn to_dtype(&self, l: &Layout, dtype: DType) -> Result<Self> {
        match self {
            Storage::Cpu(s) => Ok(Storage::Cpu(s.to_dtype(l, dtype)?)),
        }
    }
    fn unary(&self, l: &Layout, op: UnaryOp) -> Result<Self> {
        match self {
            Storage::Cpu(s) => Ok(Storage::Cpu(s.unary(l, op)?)),
        }
    }
    fn binary(&self, l: &Layout, rhs: &Self, rl: &Layout, op: BinaryOp) -> Result<Self> {
        let (a, b) = same_device(op.name(), self, rhs)?;
        Ok(Storage::Cpu(a.binary(l, b, rl, op)?))
    }
    fn cmp(&self, l: &Layout, rhs: &Self, rl: &Layout, op: CmpOp) -> Result<Self> {
        let (a, b) = same_device("cmp", self, rhs)?;
        Ok(Storage::Cpu(a.cmp(l, b, rl, op)?))
    }
    fn where_cond(&self, l: &Layout, t: &Self, tl: &Layout, f: &Self, fl: &Layout) -> Result<Self> {
        let (c, t) = same_device("where_cond", self, t)?;
        let (_, f) = same_device("where_cond", self, f)?;
        Ok(Storage::Cpu(c.where_cond(l, t, tl, f, fl)?))
    }
    fn reduce(&self, l: &Layout, op: ReduceOp, dims: &[usize]) -> Result<Self> {
        match self {
            Storage::Cpu(s) => Ok(Storage::Cpu(s.reduce(l, op, dims)?)),
        }
    }
    fn arg_reduce(&self, l: &Layout, op: ArgReduceOp, dim: usize) -> Result<Self> {
        match self {
            Storage::Cpu(s) => Ok(Storage::Cpu(s.arg_reduce(l, op, dim)?)),
        }
    }
    fn softmax_last(&self, l: &Layout, log: bool) -> Result<Self> {
        match self {
            Storage::Cpu(s) => Ok(Storage::Cpu(s.softmax_last(l, log)?)),
        }
    }
    fn layer_norm(
        &self,
        l: &Layout,
        weight: Option<(&Self, &Layout)>,
        bias: Option<(&Self, &Layout)>,
        eps: f64,
    ) -> Result<(Self, Self, Self)> {
        let (w, b) = (opt("layer_norm", self, weight)?, opt("layer_norm", self, bias)?);
        match self {
            Storage::Cpu(s) => {
                let (y, m, r) = s.layer_norm(l, w, b, eps)?;
                Ok((Storage::Cpu(y), Storage::Cpu(m), Storage::Cpu(r)))
            }
        }
    }
    fn layer_norm_backward(
        &self,
        l: &Layout,
        weight: Option<(&Self, &Layout)>,
        mean: &Self,
        rstd: &Self,
        dy: &Self,
        dyl: &Layout,
    ) -> Result<(Self, Self, Self)> {
        let w = opt("layer_norm_backward", self, weight)?;
        let (x, mean) = same_device("layer_norm_backward", self, mean)?;
        let (_, rstd) = same_device("layer_norm_backward", self, rstd)?;
        let (_, dy) = same_device("layer_norm_backward", self, dy)?;
        let (dx, dw, db) = x.layer_norm_backward(l, w, mean, rstd, dy, dyl)?;
        Ok((Storage::Cpu(dx), Storage::Cpu(dw), Storage::Cpu(db)))
    }
    fn matmul(&self, l: &Layout, rhs: &Self, rl: &Layout, dims: MatmulDims) -> Result<Self> {
        let (a, b) = same_device("matmul", self, rhs)?;
        Ok(Storage::Cpu(a.matmul(l, b, rl, dims)?))
    }
    fn index_select(&self, l: &Layout, ids: &Self, il: &Layout, dim: usize) -> Result<Self> {
        let (a, i) = same_device("index_select", self, ids)?;
        Ok(Storage::Cpu(a.index_select(l, i, il, dim)?))
    }
    fn gather(&self, l: &Layout, ids: &Self, il: &Layout, dim: usize) -> Result<Self> {
        let (a, i) = same_device("gather", self, ids)?;
        Ok(Storage::Cpu(a.gather(l, i, il, dim)?))
    }
    fn index_add(&self, l: &Layout, ids: &Self, il: &Layout, src: &Self, sl: &Layout, dim: usize) -> Result<Self> {
        let (a, i) = same_device("index_add", self, ids)?;
        let (_, s) = same_device("index_add", self, src)?;
        Ok(Storage::Cpu(a.index_add(l, i, il, s, sl, dim)?))
    }
    fn scatter_add(&self, l: &Layout, ids: &Self, il: &Layout, src: &Self, sl: &Layout, dim: usize) -> Result<Self> {
        let (a, i) = same_device("scatter_add", self, ids)?;
        let (_, s) = same_device("scatter_add", self, src)?;
        Ok(Storage::Cpu(a.scatter_add(l, i, il, s, sl, dim)?))
    }
}
