//! `Storage` is the enum over backends that a tensor holds. Each method forwards to the backend of
//! its operands; operands on different devices are a typed error, never an implicit copy.

use crate::backend::{BackendStorage, MatmulDims};
use crate::cpu::CpuStorage;
use crate::cuda::{CudaDevice, CudaStorage};
use crate::op::{ArgReduceOp, BinaryOp, CmpOp, ReduceOp, UnaryOp};
use crate::{DType, Device, Error, Layout, Result};

/// A tensor's buffer on one backend. Users rarely touch it; [`Tensor`](crate::Tensor) wraps it.
#[derive(Debug)]
pub enum Storage {
    /// Host memory.
    Cpu(CpuStorage),
    /// Device memory from the caching allocator.
    Cuda(CudaStorage),
}

/// Apply a backend method to a single storage, rewrapping the result.
macro_rules! one {
    ($s:expr, $x:ident => $body:expr) => {
        match $s {
            Storage::Cpu($x) => Ok(Storage::Cpu($body?)),
            Storage::Cuda($x) => Ok(Storage::Cuda($body?)),
        }
    };
}

/// Unwrap several storages of one backend, or report the device mismatch.
macro_rules! all_cpu_or_cuda {
    ($op:expr, $first:expr, [$($s:expr),*], |$($v:ident),*| $cpu:expr, $cuda:expr) => {{
        #[allow(unused_parens)]
        match ($first, $($s),*) {
            ($(Storage::Cpu($v)),*) => Ok($cpu),
            ($(Storage::Cuda($v)),*) => Ok($cuda),
            _ => Err(mismatch($op, &[$first, $($s),*])),
        }
    }};
}

fn mismatch(op: &'static str, s: &[&Storage]) -> Error {
    let lhs = s[0].device();
    let rhs = s.iter().map(|x| x.device()).find(|d| *d != lhs).unwrap_or(lhs);
    Error::DeviceMismatch { op, lhs, rhs }
}

impl Storage {
    /// `n` zeros of `dtype` on `device`.
    pub fn zeros(n: usize, dtype: DType, device: Device) -> Result<Storage> {
        Self::full(0.0, n, dtype, device)
    }

    /// `n` elements that the caller overwrites, every one: zeros on the CPU, uninitialized on a
    /// GPU (no fill kernel; poisoned in tests, so an element left unwritten shows).
    pub(crate) fn for_overwrite(n: usize, dtype: DType, device: Device) -> Result<Storage> {
        match device {
            Device::Cpu => Self::zeros(n, dtype, device),
            Device::Cuda(o) => Ok(Storage::Cuda(CudaStorage::uninit(&CudaDevice::get(o)?, n, dtype)?)),
        }
    }

    /// `n` copies of `v` converted to `dtype` on `device`.
    pub fn full(v: f64, n: usize, dtype: DType, device: Device) -> Result<Storage> {
        match device {
            Device::Cpu => Ok(Storage::Cpu(CpuStorage::full(v, n, dtype)?)),
            Device::Cuda(o) => Ok(Storage::Cuda(CudaStorage::full(&CudaDevice::get(o)?, v, n, dtype)?)),
        }
    }

    /// Elements held.
    pub fn len(&self) -> usize {
        match self {
            Storage::Cpu(c) => c.len(),
            Storage::Cuda(c) => c.len(),
        }
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Move host data to `device`.
    pub fn from_cpu(c: CpuStorage, device: Device) -> Result<Storage> {
        match device {
            Device::Cpu => Ok(Storage::Cpu(c)),
            Device::Cuda(o) => Ok(Storage::Cuda(CudaStorage::from_cpu(&CudaDevice::get(o)?, &c)?)),
        }
    }

    /// The viewed elements as a contiguous host storage.
    pub fn to_cpu(&self, l: &Layout) -> Result<CpuStorage> {
        match self {
            Storage::Cpu(c) => c.copy_strided(l),
            Storage::Cuda(c) => c.to_cpu_view(l),
        }
    }

    /// The CPU storage, if on the CPU.
    pub fn as_cpu(&self) -> Option<&CpuStorage> {
        match self {
            Storage::Cpu(c) => Some(c),
            Storage::Cuda(_) => None,
        }
    }

    /// The CUDA storage, if on a GPU.
    pub fn as_cuda(&self) -> Option<&CudaStorage> {
        match self {
            Storage::Cuda(c) => Some(c),
            Storage::Cpu(_) => None,
        }
    }
}

impl BackendStorage for Storage {
    fn dtype(&self) -> DType {
        match self {
            Storage::Cpu(s) => s.dtype(),
            Storage::Cuda(s) => s.dtype(),
        }
    }
    fn device(&self) -> Device {
        match self {
            Storage::Cpu(_) => Device::Cpu,
            Storage::Cuda(s) => Device::Cuda(s.dev().ordinal),
        }
    }
    fn copy_strided(&self, l: &Layout) -> Result<Self> {
        one!(self, s => s.copy_strided(l))
    }
    fn copy_strided_into(&self, l: &Layout, dst: &mut Self, dst_offset: usize) -> Result<()> {
        match (self, dst) {
            (Storage::Cpu(s), Storage::Cpu(d)) => s.copy_strided_into(l, d, dst_offset),
            (Storage::Cuda(s), Storage::Cuda(d)) => s.copy_strided_into(l, d, dst_offset),
            (s, d) => Err(Error::DeviceMismatch { op: "copy_strided_into", lhs: s.device(), rhs: d.device() }),
        }
    }
    fn copy_into_view(&self, l: &Layout, dst: &mut Self, dl: &Layout) -> Result<()> {
        match (self, dst) {
            (Storage::Cpu(s), Storage::Cpu(d)) => s.copy_into_view(l, d, dl),
            (Storage::Cuda(s), Storage::Cuda(d)) => s.copy_into_view(l, d, dl),
            (s, d) => Err(Error::DeviceMismatch { op: "copy_into_view", lhs: s.device(), rhs: d.device() }),
        }
    }
    fn to_dtype(&self, l: &Layout, dtype: DType) -> Result<Self> {
        one!(self, s => s.to_dtype(l, dtype))
    }
    fn unary(&self, l: &Layout, op: UnaryOp) -> Result<Self> {
        one!(self, s => s.unary(l, op))
    }
    fn binary(&self, l: &Layout, rhs: &Self, rl: &Layout, op: BinaryOp) -> Result<Self> {
        all_cpu_or_cuda!(
            op.name(),
            self,
            [rhs],
            |a, b| Storage::Cpu(a.binary(l, b, rl, op)?),
            Storage::Cuda(a.binary(l, b, rl, op)?)
        )
    }
    fn cmp(&self, l: &Layout, rhs: &Self, rl: &Layout, op: CmpOp) -> Result<Self> {
        all_cpu_or_cuda!(
            "cmp",
            self,
            [rhs],
            |a, b| Storage::Cpu(a.cmp(l, b, rl, op)?),
            Storage::Cuda(a.cmp(l, b, rl, op)?)
        )
    }
    fn where_cond(&self, l: &Layout, t: &Self, tl: &Layout, f: &Self, fl: &Layout) -> Result<Self> {
        all_cpu_or_cuda!(
            "where_cond",
            self,
            [t, f],
            |c, t, f| Storage::Cpu(c.where_cond(l, t, tl, f, fl)?),
            Storage::Cuda(c.where_cond(l, t, tl, f, fl)?)
        )
    }
    fn reduce(&self, l: &Layout, op: ReduceOp, dims: &[usize]) -> Result<Self> {
        one!(self, s => s.reduce(l, op, dims))
    }
    fn arg_reduce(&self, l: &Layout, op: ArgReduceOp, dim: usize) -> Result<Self> {
        one!(self, s => s.arg_reduce(l, op, dim))
    }
    fn matmul(&self, l: &Layout, rhs: &Self, rl: &Layout, dims: MatmulDims) -> Result<Self> {
        all_cpu_or_cuda!(
            "matmul",
            self,
            [rhs],
            |a, b| Storage::Cpu(a.matmul(l, b, rl, dims)?),
            Storage::Cuda(a.matmul(l, b, rl, dims)?)
        )
    }
    fn index_select(&self, l: &Layout, ids: &Self, il: &Layout, dim: usize) -> Result<Self> {
        all_cpu_or_cuda!(
            "index_select",
            self,
            [ids],
            |a, i| Storage::Cpu(a.index_select(l, i, il, dim)?),
            Storage::Cuda(a.index_select(l, i, il, dim)?)
        )
    }
    fn gather(&self, l: &Layout, ids: &Self, il: &Layout, dim: usize) -> Result<Self> {
        all_cpu_or_cuda!(
            "gather",
            self,
            [ids],
            |a, i| Storage::Cpu(a.gather(l, i, il, dim)?),
            Storage::Cuda(a.gather(l, i, il, dim)?)
        )
    }
    fn index_add(&self, l: &Layout, ids: &Self, il: &Layout, src: &Self, sl: &Layout, dim: usize) -> Result<Self> {
        all_cpu_or_cuda!(
            "index_add",
            self,
            [ids, src],
            |a, i, s| Storage::Cpu(a.index_add(l, i, il, s, sl, dim)?),
            Storage::Cuda(a.index_add(l, i, il, s, sl, dim)?)
        )
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
        match (self, ids, dst) {
            (Storage::Cpu(s), Storage::Cpu(i), Storage::Cpu(d)) => s.index_copy_into(sl, i, il, d, dl, dim),
            (Storage::Cuda(s), Storage::Cuda(i), Storage::Cuda(d)) => s.index_copy_into(sl, i, il, d, dl, dim),
            (s, i, d) => Err(mismatch("index_copy_", &[s, i, d])),
        }
    }
    fn scatter_add(&self, l: &Layout, ids: &Self, il: &Layout, src: &Self, sl: &Layout, dim: usize) -> Result<Self> {
        all_cpu_or_cuda!(
            "scatter_add",
            self,
            [ids, src],
            |a, i, s| Storage::Cpu(a.scatter_add(l, i, il, s, sl, dim)?),
            Storage::Cuda(a.scatter_add(l, i, il, s, sl, dim)?)
        )
    }
}
