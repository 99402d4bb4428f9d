//! The CPU backend: one `Vec` per dtype, rayon for parallel loops, the `gemm` crate for matmul.

pub(crate) mod alloc;
pub(crate) mod index;
mod matmul;
mod reduce;
pub mod strided;

use crate::backend::{BackendStorage, MatmulDims};
use crate::op::{ArgReduceOp, BinaryOp, CmpOp, ReduceOp, UnaryOp};
use crate::{DType, Device, Error, Layout, Result, WithDType};
use half::{bf16, f16};

/// Host storage: one `Vec` per dtype.
#[derive(Clone, Debug)]
pub enum CpuStorage {
    /// f32 elements.
    F32(Vec<f32>),
    /// f64 elements.
    F64(Vec<f64>),
    /// f16 elements.
    F16(Vec<f16>),
    /// bf16 elements.
    BF16(Vec<bf16>),
    /// i32 elements.
    I32(Vec<i32>),
    /// u32 elements.
    U32(Vec<u32>),
    /// u8 elements.
    U8(Vec<u8>),
    /// i8 elements.
    I8(Vec<i8>),
}

/// Run `$body` with `$v` bound to the storage's vector, whatever its element type.
#[macro_export]
#[doc(hidden)]
macro_rules! cpu_dispatch {
    ($s:expr, $v:ident => $body:expr) => {
        match $s {
            $crate::cpu::CpuStorage::F32($v) => $body,
            $crate::cpu::CpuStorage::F64($v) => $body,
            $crate::cpu::CpuStorage::F16($v) => $body,
            $crate::cpu::CpuStorage::BF16($v) => $body,
            $crate::cpu::CpuStorage::I32($v) => $body,
            $crate::cpu::CpuStorage::U32($v) => $body,
            $crate::cpu::CpuStorage::U8($v) => $body,
            $crate::cpu::CpuStorage::I8($v) => $body,
        }
    };
}
pub use cpu_dispatch;

/// Same as `cpu_dispatch`, over two storages of the same dtype; a mismatch is a typed error.
macro_rules! dispatch2 {
    ($op:expr, $a:expr, $b:expr, ($x:ident, $y:ident) => $body:expr) => {
        match ($a, $b) {
            (CpuStorage::F32($x), CpuStorage::F32($y)) => $body,
            (CpuStorage::F64($x), CpuStorage::F64($y)) => $body,
            (CpuStorage::F16($x), CpuStorage::F16($y)) => $body,
            (CpuStorage::BF16($x), CpuStorage::BF16($y)) => $body,
            (CpuStorage::I32($x), CpuStorage::I32($y)) => $body,
            (CpuStorage::U32($x), CpuStorage::U32($y)) => $body,
            (CpuStorage::U8($x), CpuStorage::U8($y)) => $body,
            (CpuStorage::I8($x), CpuStorage::I8($y)) => $body,
            (a, b) => return Err(Error::DTypeMismatch { op: $op, lhs: a.dtype(), rhs: b.dtype() }),
        }
    };
}
pub(crate) use dispatch2;

impl CpuStorage {
    /// Wrap a vector (its dtype is `T`'s).
    pub fn from_vec<T: WithDType>(v: Vec<T>) -> Self {
        T::to_cpu_storage(v)
    }

    /// Elements held.
    pub fn len(&self) -> usize {
        cpu_dispatch!(self, v => v.len())
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The elements as `&[T]`; [`Error::DTypeMismatch`] when `T` is not the dtype held.
    pub fn as_slice<T: WithDType>(&self) -> Result<&[T]> {
        T::cpu_slice(self).ok_or(Error::DTypeMismatch { op: "as_slice", lhs: self.dtype(), rhs: T::DTYPE })
    }

    /// A vector of `n` copies of `v` converted to `dtype` (fallible: a size the host cannot hold
    /// is `Error::HostOutOfMemory`).
    pub fn full(v: f64, n: usize, dtype: DType) -> Result<Self> {
        fn f<T: WithDType>(v: f64, n: usize) -> Result<CpuStorage> {
            Ok(T::to_cpu_storage(alloc::filled(T::from_f64(v), n)?))
        }
        match dtype {
            DType::F32 => f::<f32>(v, n),
            DType::F64 => f::<f64>(v, n),
            DType::F16 => f::<f16>(v, n),
            DType::BF16 => f::<bf16>(v, n),
            DType::I32 => f::<i32>(v, n),
            DType::U32 => f::<u32>(v, n),
            DType::U8 => f::<u8>(v, n),
            DType::I8 => f::<i8>(v, n),
        }
    }

    /// Build a storage of `dtype` from f64 values (used by creation ops and the RNG).
    pub fn from_f64_iter(it: impl ExactSizeIterator<Item = f64>, dtype: DType) -> Result<Self> {
        fn c<T: WithDType>(it: impl ExactSizeIterator<Item = f64>) -> Result<CpuStorage> {
            Ok(T::to_cpu_storage(alloc::collect(it.map(T::from_f64))?))
        }
        match dtype {
            DType::F32 => c::<f32>(it),
            DType::F64 => c::<f64>(it),
            DType::F16 => c::<f16>(it),
            DType::BF16 => c::<bf16>(it),
            DType::I32 => c::<i32>(it),
            DType::U32 => c::<u32>(it),
            DType::U8 => c::<u8>(it),
            DType::I8 => c::<i8>(it),
        }
    }

    /// The viewed elements as f64 (exact for every dtype), for tests and index handling.
    pub fn to_f64_vec(&self, l: &Layout) -> Result<Vec<f64>> {
        cpu_dispatch!(self, v => strided::map(v, l, |x| x.to_f64()))
    }

    /// Raw little-endian bytes of the whole storage (for checkpoints and transfers).
    pub fn as_bytes(&self) -> &[u8] {
        cpu_dispatch!(self, v => bytemuck::cast_slice(v))
    }

    /// The elements' bytes, writable.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        cpu_dispatch!(self, v => bytemuck::cast_slice_mut(v))
    }

    fn float_unary(&self, l: &Layout, op: UnaryOp) -> Result<Self> {
        Ok(match self {
            CpuStorage::F32(v) => CpuStorage::F32(strided::map(v, l, |x| op.eval_f32(x))?),
            CpuStorage::F64(v) => CpuStorage::F64(strided::map(v, l, |x| op.eval_f64(x))?),
            CpuStorage::F16(v) => CpuStorage::F16(strided::map(v, l, |x| f16::from_f32(op.eval_f32(x.to_f32())))?),
            CpuStorage::BF16(v) => CpuStorage::BF16(strided::map(v, l, |x| bf16::from_f32(op.eval_f32(x.to_f32())))?),
            s => {
                if !op.int_ok() {
                    return Err(Error::UnsupportedDType { op: op.name(), dtype: s.dtype() });
                }
                fn int_map<T: WithDType>(v: &[T], l: &Layout, op: UnaryOp) -> Result<CpuStorage> {
                    Ok(T::to_cpu_storage(strided::map(v, l, |x| T::from_f64(op.eval_f64(x.to_f64())))?))
                }
                cpu_dispatch!(s, v => int_map(v, l, op)?)
            }
        })
    }
}

/// The reference binary maps; integer results saturate.
#[inline]
fn bin_f64(op: BinaryOp, a: f64, b: f64) -> f64 {
    match op {
        BinaryOp::Add => a + b,
        BinaryOp::Sub => a - b,
        BinaryOp::Mul => a * b,
        BinaryOp::Div => a / b,
        BinaryOp::Maximum => {
            if a.is_nan() || a >= b {
                a
            } else {
                b
            }
        }
        BinaryOp::Minimum => {
            if a.is_nan() || a <= b {
                a
            } else {
                b
            }
        }
        BinaryOp::Rem => {
            let r = a % b;
            if r != 0.0 && ((r < 0.0) != (b < 0.0)) {
                r + b
            } else {
                r
            }
        }
        BinaryOp::MaskPositive => {
            if b > 0.0 || b.is_nan() {
                a
            } else {
                0.0
            }
        }
    }
}

#[inline]
fn bin_f32(op: BinaryOp, a: f32, b: f32) -> f32 {
    match op {
        BinaryOp::Add => a + b,
        BinaryOp::Sub => a - b,
        BinaryOp::Mul => a * b,
        BinaryOp::Div => a / b,
        BinaryOp::Rem => {
            let r = a % b;
            if r != 0.0 && ((r < 0.0) != (b < 0.0)) {
                r + b
            } else {
                r
            }
        }
        _ => bin_f64(op, a as f64, b as f64) as f32,
    }
}

#[inline]
fn cmp_f64(op: CmpOp, a: f64, b: f64) -> u8 {
    (match op {
        CmpOp::Eq => a == b,
        CmpOp::Ne => a != b,
        CmpOp::Lt => a < b,
        CmpOp::Le => a <= b,
        CmpOp::Gt => a > b,
        CmpOp::Ge => a >= b,
    }) as u8
}

impl BackendStorage for CpuStorage {
    fn dtype(&self) -> DType {
        match self {
            CpuStorage::F32(_) => DType::F32,
            CpuStorage::F64(_) => DType::F64,
            CpuStorage::F16(_) => DType::F16,
            CpuStorage::BF16(_) => DType::BF16,
            CpuStorage::I32(_) => DType::I32,
            CpuStorage::U32(_) => DType::U32,
            CpuStorage::U8(_) => DType::U8,
            CpuStorage::I8(_) => DType::I8,
        }
    }

    fn device(&self) -> Device {
        Device::Cpu
    }

    fn copy_strided(&self, l: &Layout) -> Result<Self> {
        Ok(cpu_dispatch!(self, v => WithDType::to_cpu_storage(strided::gather_contiguous(v, l)?)))
    }

    fn copy_strided_into(&self, l: &Layout, dst: &mut Self, dst_offset: usize) -> Result<()> {
        let n = l.elem_count();
        dispatch2!("copy_strided_into", self, dst, (src, dst) => {
            let len = dst.len();
            let out = dst.get_mut(dst_offset..dst_offset + n).ok_or_else(|| {
                Error::Shape { op: "copy_strided_into", msg: format!("{n} elements at {dst_offset} overflow {len}") }
            })?;
            match l.contiguous_range() {
                Some((s, e)) => out.copy_from_slice(&src[s..e]),
                None => strided::par_fill(out, |start, chunk| {
                    for (o, off) in chunk.iter_mut().zip(l.offsets_from(start)) {
                        *o = src[off];
                    }
                }),
            }
        });
        Ok(())
    }

    fn copy_into_view(&self, l: &Layout, dst: &mut Self, dl: &Layout) -> Result<()> {
        crate::backend::check_view_dst(l, dl, dst.len())?;
        if dl.is_contiguous() {
            return self.copy_strided_into(l, dst, dl.offset());
        }
        let rows = strided::rows_of(dl);
        dispatch2!("copy_into_view", self, dst, (src, dst) => match rows {
            // Rows of `w` elements `stride` apart (cat along any dim is this): in parallel, each
            // row the head of its own `stride`-long chunk of dst.
            Some((w, stride)) if l.elem_count() >= strided::PAR_MIN => {
                use rayon::prelude::*;
                let tail = &mut dst[dl.offset()..];
                tail.par_chunks_mut(stride).take(l.elem_count() / w).enumerate().for_each(|(r, row)| {
                    for (o, off) in row[..w].iter_mut().zip(l.offsets_from(r * w)) {
                        *o = src[off];
                    }
                });
            }
            _ => {
                for (d, s) in dl.offsets().zip(l.offsets()) {
                    dst[d] = src[s];
                }
            }
        });
        Ok(())
    }

    fn to_dtype(&self, l: &Layout, dtype: DType) -> Result<Self> {
        fn conv<S: WithDType, T: WithDType>(v: &[S], l: &Layout) -> Result<CpuStorage> {
            Ok(T::to_cpu_storage(strided::map(v, l, |x| T::from_f64(x.to_f64()))?))
        }
        Ok(cpu_dispatch!(self, v => match dtype {
            DType::F32 => match self {
                // The common autocast paths avoid the f64 round trip.
                CpuStorage::F16(h) => CpuStorage::F32(strided::map(h, l, |x| x.to_f32())?),
                CpuStorage::BF16(h) => CpuStorage::F32(strided::map(h, l, |x| x.to_f32())?),
                _ => conv::<_, f32>(v, l)?,
            },
            DType::F64 => conv::<_, f64>(v, l)?,
            DType::F16 => match self {
                CpuStorage::F32(h) => CpuStorage::F16(strided::map(h, l, f16::from_f32)?),
                _ => conv::<_, f16>(v, l)?,
            },
            DType::BF16 => match self {
                CpuStorage::F32(h) => CpuStorage::BF16(strided::map(h, l, bf16::from_f32)?),
                _ => conv::<_, bf16>(v, l)?,
            },
            DType::I32 => conv::<_, i32>(v, l)?,
            DType::U32 => conv::<_, u32>(v, l)?,
            DType::U8 => conv::<_, u8>(v, l)?,
            DType::I8 => conv::<_, i8>(v, l)?,
        }))
    }

    fn unary(&self, l: &Layout, op: UnaryOp) -> Result<Self> {
        self.float_unary(l, op)
    }

    fn binary(&self, l: &Layout, rhs: &Self, rl: &Layout, op: BinaryOp) -> Result<Self> {
        Ok(match (self, rhs) {
            (CpuStorage::F32(a), CpuStorage::F32(b)) => {
                CpuStorage::F32(strided::zip(a, l, b, rl, |x, y| bin_f32(op, x, y))?)
            }
            (CpuStorage::F64(a), CpuStorage::F64(b)) => {
                CpuStorage::F64(strided::zip(a, l, b, rl, |x, y| bin_f64(op, x, y))?)
            }
            (CpuStorage::F16(a), CpuStorage::F16(b)) => {
                CpuStorage::F16(strided::zip(a, l, b, rl, |x, y| f16::from_f32(bin_f32(op, x.to_f32(), y.to_f32())))?)
            }
            (CpuStorage::BF16(a), CpuStorage::BF16(b)) => {
                CpuStorage::BF16(strided::zip(a, l, b, rl, |x, y| bf16::from_f32(bin_f32(op, x.to_f32(), y.to_f32())))?)
            }
            (a, b) => {
                fn int_zip<T: WithDType>(
                    x: &[T],
                    l: &Layout,
                    y: &[T],
                    rl: &Layout,
                    op: BinaryOp,
                ) -> Result<CpuStorage> {
                    Ok(T::to_cpu_storage(strided::zip(x, l, y, rl, |p, q| {
                        let r = bin_f64(op, p.to_f64(), q.to_f64());
                        // Integer division truncates toward zero, as in C and CUDA.
                        T::from_f64(if op == BinaryOp::Div { r.trunc() } else { r })
                    })?))
                }
                dispatch2!(op.name(), a, b, (x, y) => int_zip(x, l, y, rl, op)?)
            }
        })
    }

    fn cmp(&self, l: &Layout, rhs: &Self, rl: &Layout, op: CmpOp) -> Result<Self> {
        Ok(dispatch2!("cmp", self, rhs, (x, y) => {
            CpuStorage::U8(strided::zip(x, l, y, rl, |p, q| cmp_f64(op, p.to_f64(), q.to_f64()))?)
        }))
    }

    fn where_cond(&self, l: &Layout, t: &Self, tl: &Layout, f: &Self, fl: &Layout) -> Result<Self> {
        let cond: Vec<u8> = cpu_dispatch!(self, c => strided::map(c, l, |x| (x.to_f64() != 0.0) as u8)?);
        let cl = Layout::contiguous(l.shape().clone());
        Ok(dispatch2!("where_cond", t, f, (a, b) => {
            let picked = strided::zip(&cond, &cl, a, tl, |c, x| (c, x))?;
            let pl = Layout::contiguous(tl.shape().clone());
            WithDType::to_cpu_storage(strided::zip(&picked, &pl, b, fl, |(c, x), y| if c != 0 { x } else { y })?)
        }))
    }

    fn reduce(&self, l: &Layout, op: ReduceOp, dims: &[usize]) -> Result<Self> {
        reduce::reduce(self, l, op, dims)
    }

    fn arg_reduce(&self, l: &Layout, op: ArgReduceOp, dim: usize) -> Result<Self> {
        reduce::arg_reduce(self, l, op, dim)
    }

    fn matmul(&self, l: &Layout, rhs: &Self, rl: &Layout, dims: MatmulDims) -> Result<Self> {
        matmul::matmul(self, l, rhs, rl, dims)
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
