//! `Storage` is the enum over backends that a tensor holds. Each method forwards to the backend of
//! its operands; operands on different devices are a typed error, never an implicit copy.

use crate::backend::{BackendStorage, MatmulDims};
use crate::cpu::CpuStorage;
use crate::cuda::{CudaDevice, CudaStorage};
use crate::op::{ArgReduceOp, BinaryOp, CmpOp, ReduceOp, UnaryOp};
use crate::{DType, Device, Error, Layout, Result};

#[derive(Debug)]
pub enum Storage {
    Cpu(CpuStorage),
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

    pub fn as_cpu(&self) -> Option<&CpuStorage> {
        match self {
            Storage::Cpu(c) => Some(c),
            Storage::Cuda(_) => None,
        }
    }

    pub fn as_cuda(&self) -> Option<&CudaStorage> {
        match self {
            Storage::Cuda(c) => Some(c),
            Storage::Cpu(_) => None,
        }
    }
}

/// An optional parameter, split by backend: `(cpu, cuda)`, at most one of them set.
type SplitParam<'a> = (Option<(&'a CpuStorage, &'a Layout)>, Option<(&'a CudaStorage, &'a Layout)>);

fn param<'a>(op: &'static str, base: &Storage, p: Option<(&'a Storage, &'a Layout)>) -> Result<SplitParam<'a>> {
    match (base, p) {
        (_, None) => Ok((None, None)),
        (Storage::Cpu(_), Some((Storage::Cpu(s), l))) => Ok((Some((s, l)), None)),
        (Storage::Cuda(_), Some((Storage::Cuda(s), l))) => Ok((None, Some((s, l)))),
        (_, Some((s, _))) => Err(mismatch(op, &[base, s])),
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
    fn softmax_last(&self, l: &Layout, log: bool) -> Result<Self> {
        one!(self, s => s.softmax_last(l, log))
    }
    fn layer_norm(
        &self,
        l: &Layout,
        weight: Option<(&Self, &Layout)>,
        bias: Option<(&Self, &Layout)>,
        eps: f64,
    ) -> Result<(Self, Self, Self)> {
        let (wc, wg) = param("layer_norm", self, weight)?;
        let (bc, bg) = param("layer_norm", self, bias)?;
        match self {
            Storage::Cpu(s) => {
                let (y, m, r) = s.layer_norm(l, wc, bc, eps)?;
                Ok((Storage::Cpu(y), Storage::Cpu(m), Storage::Cpu(r)))
            }
            Storage::Cuda(s) => {
                let (y, m, r) = s.layer_norm(l, wg, bg, eps)?;
                Ok((Storage::Cuda(y), Storage::Cuda(m), Storage::Cuda(r)))
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
        let (wc, wg) = param("layer_norm_backward", self, weight)?;
        match (self, mean, rstd, dy) {
            (Storage::Cpu(x), Storage::Cpu(m), Storage::Cpu(r), Storage::Cpu(g)) => {
                let (a, b, c) = x.layer_norm_backward(l, wc, m, r, g, dyl)?;
                Ok((Storage::Cpu(a), Storage::Cpu(b), Storage::Cpu(c)))
            }
            (Storage::Cuda(x), Storage::Cuda(m), Storage::Cuda(r), Storage::Cuda(g)) => {
                let (a, b, c) = x.layer_norm_backward(l, wg, m, r, g, dyl)?;
                Ok((Storage::Cuda(a), Storage::Cuda(b), Storage::Cuda(c)))
            }
            _ => Err(mismatch("layer_norm_backward", &[self, mean, rstd, dy])),
        }
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

/// Fused cross entropy (`src/cpu/cross_entropy.rs`, `src/cuda/cross_entropy.rs`): inherent methods,
/// not `BackendStorage` ones. Targets are encoded once by `cross_entropy_targets` (u32 class ids,
/// `u32::MAX` for an ignored row) and passed to the forward and the backward in that form.
impl Storage {
    /// Integer targets checked against `classes` and encoded (CUDA reads them back to check them).
    pub(crate) fn cross_entropy_targets(
        &self,
        l: &Layout,
        classes: usize,
        ignore_index: Option<i64>,
    ) -> Result<Storage> {
        match self {
            Storage::Cpu(s) => {
                if s.dtype().is_float() {
                    return Err(Error::UnsupportedDType { op: "cross_entropy targets", dtype: s.dtype() });
                }
                let ids = crate::cpu::cross_entropy::encode_targets(&s.to_f64_vec(l)?, classes, ignore_index)?;
                Ok(Storage::Cpu(CpuStorage::U32(ids)))
            }
            Storage::Cuda(s) => Ok(Storage::Cuda(s.cross_entropy_targets(l, classes, ignore_index)?)),
        }
    }

    /// Forward over `[N, C]` logits: `(loss_rows, lse, kept)`, each `[N]` in the accumulation dtype.
    pub(crate) fn cross_entropy_fwd(
        &self,
        l: &Layout,
        t: &Storage,
        tl: &Layout,
    ) -> Result<(Storage, Storage, Storage)> {
        match (self, t) {
            (Storage::Cpu(x), Storage::Cpu(t)) => {
                let (a, b, c) = crate::cpu::cross_entropy::cross_entropy_fwd(x, l, t, tl)?;
                Ok((Storage::Cpu(a), Storage::Cpu(b), Storage::Cpu(c)))
            }
            (Storage::Cuda(x), Storage::Cuda(t)) => {
                let (a, b, c) = x.cross_entropy_fwd(l, t, tl)?;
                Ok((Storage::Cuda(a), Storage::Cuda(b), Storage::Cuda(c)))
            }
            _ => Err(mismatch("cross_entropy", &[self, t])),
        }
    }

    /// Backward: the logits' gradient, contiguous `[N, C]` in their dtype; `scale` is one element
    /// (upstream gradient / kept count) in the accumulation dtype.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn cross_entropy_bwd(
        &self,
        l: &Layout,
        t: &Storage,
        tl: &Layout,
        lse: &Storage,
        lsel: &Layout,
        scale: &Storage,
        scalel: &Layout,
    ) -> Result<Storage> {
        match (self, t, lse, scale) {
            (Storage::Cpu(x), Storage::Cpu(t), Storage::Cpu(m), Storage::Cpu(s)) => {
                Ok(Storage::Cpu(crate::cpu::cross_entropy::cross_entropy_bwd(x, l, t, tl, m, lsel, s, scalel)?))
            }
            (Storage::Cuda(x), Storage::Cuda(t), Storage::Cuda(m), Storage::Cuda(s)) => {
                Ok(Storage::Cuda(x.cross_entropy_bwd(l, t, tl, m, lsel, s, scalel)?))
            }
            _ => Err(mismatch("cross_entropy_backward", &[self, t, lse, scale])),
        }
    }
}
