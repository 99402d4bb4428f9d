//! The CUDA implementation of every backend op: each is one or two kernel launches on the compute
//! stream (see docs/kernel-abi.md), nothing synchronises except index validation.

use super::device::driver_err;
use super::modules::{self, Module};
use super::storage::{cfg_1d, cfg_rows, launch, width_suffix, CudaStorage, KLayout};
use crate::backend::{BackendStorage, MatmulDims};
use crate::cpu::index::check_gather;
use crate::op::{ArgReduceOp, BinaryOp, CmpOp, ReduceOp, UnaryOp};
use crate::{shape_err, DType, Device, Error, Layout, Result};
use cudarc::driver::result;

/// The dtype reductions and norms accumulate in (docs/kernel-abi.md).
pub(crate) fn acc_dtype(d: DType) -> DType {
    match d {
        DType::F32 | DType::F16 | DType::BF16 => DType::F32,
        _ => DType::F64,
    }
}

/// Row caches for softmax/layer norm live in at most 48 KiB of shared memory.
const MAX_ROW_SMEM: usize = 48 * 1024;

fn unary_code(op: UnaryOp) -> (i32, f64, f64) {
    match op {
        UnaryOp::Neg => (0, 0., 0.),
        UnaryOp::Abs => (1, 0., 0.),
        UnaryOp::Sqr => (2, 0., 0.),
        UnaryOp::Sign => (3, 0., 0.),
        UnaryOp::Relu => (4, 0., 0.),
        UnaryOp::Exp => (5, 0., 0.),
        UnaryOp::Log => (6, 0., 0.),
        UnaryOp::Sqrt => (7, 0., 0.),
        UnaryOp::Rsqrt => (8, 0., 0.),
        UnaryOp::Recip => (9, 0., 0.),
        UnaryOp::Tanh => (10, 0., 0.),
        UnaryOp::Sigmoid => (11, 0., 0.),
        UnaryOp::GeluTanh => (12, 0., 0.),
        UnaryOp::GeluErf => (13, 0., 0.),
        UnaryOp::Silu => (14, 0., 0.),
        UnaryOp::Sin => (15, 0., 0.),
        UnaryOp::Cos => (16, 0., 0.),
        UnaryOp::Affine { mul, add } => (17, mul, add),
        UnaryOp::Powf(e) => (18, e, 0.),
        UnaryOp::Clamp { min, max } => (19, min, max),
        UnaryOp::GeluTanhGrad => (20, 0., 0.),
        UnaryOp::GeluErfGrad => (21, 0., 0.),
        UnaryOp::SiluGrad => (22, 0., 0.),
    }
}

fn binary_code(op: BinaryOp) -> i32 {
    op as i32
}

fn same_dtype(op: &'static str, a: &CudaStorage, b: &CudaStorage) -> Result<()> {
    if a.dtype() != b.dtype() {
        return Err(Error::DTypeMismatch { op, lhs: a.dtype(), rhs: b.dtype() });
    }
    if a.dev().ordinal != b.dev().ordinal {
        return Err(Error::DeviceMismatch { op, lhs: a.device(), rhs: b.device() });
    }
    Ok(())
}

fn float_only(op: &'static str, s: &CudaStorage) -> Result<()> {
    if s.dtype().is_float() {
        Ok(())
    } else {
        Err(Error::UnsupportedDType { op, dtype: s.dtype() })
    }
}

impl CudaStorage {
    /// Copy the viewed elements to the device address `dst`, contiguous.
    fn copy_to_ptr(&self, l: &Layout, dst: u64) -> Result<()> {
        let n = l.elem_count();
        if n == 0 {
            return Ok(());
        }
        let dev = self.dev();
        if l.is_contiguous() {
            dev.ctx.bind_to_thread().map_err(|e| driver_err("cuCtxSetCurrent", e))?;
            let bytes = n * self.dtype().size_in_bytes();
            // SAFETY: both ranges lie inside live buffers of at least `bytes` bytes.
            unsafe { result::memcpy_dtod_async(dst, self.buf.ptr_at(l.offset()), bytes, dev.stream().cu_stream()) }
                .map_err(|e| driver_err("cuMemcpyDtoDAsync", e))?;
            return Ok(());
        }
        let name = format!("copy_strided_{}", width_suffix(self.dtype()));
        launch!(dev, modules::COPY, name, cfg_1d(n); KLayout::new(l)?, self.buf.ptr(), dst, n as u64);
        Ok(())
    }

    /// (pointer to the first viewed element, owned copy if one was needed) for a row-major view.
    fn contiguous_ptr(&self, l: &Layout) -> Result<(u64, Option<CudaStorage>)> {
        if l.is_contiguous() {
            Ok((self.buf.ptr_at(l.offset()), None))
        } else {
            let c = self.copy_strided(l)?;
            Ok((c.buf.ptr(), Some(c)))
        }
    }

    fn cast_to(&self, dtype: DType) -> Result<CudaStorage> {
        self.to_dtype(&Layout::contiguous(self.len()), dtype)
    }

    /// Fold each row of a contiguous `[rows, cols]` matrix at `x` into `out` (ACC dtype).
    #[allow(clippy::too_many_arguments)]
    fn reduce_rows(
        &self,
        x: u64,
        dtype: DType,
        out: &CudaStorage,
        rows: usize,
        cols: usize,
        op: i32,
        arg: bool,
    ) -> Result<()> {
        let dev = self.dev();
        let (module, kind): (&Module, &str) =
            if arg { (&modules::REDUCE, "argreduce") } else { (&modules::REDUCE, "reduce") };
        const CHUNK: usize = 8192;
        if !arg && rows < 32 && cols >= 8 * CHUNK {
            // Few long rows: split each row across many blocks, then fold the partials.
            let acc = out.dtype();
            let esz = dtype.size_in_bytes() as u64;
            let q = cols / CHUNK;
            let rem = cols % CHUNK;
            let parts = q + (rem > 0) as usize;
            let partial = CudaStorage::uninit(dev, parts, acc)?;
            for r in 0..rows {
                let row = x + (r * cols) as u64 * esz;
                launch!(dev, *module, format!("{kind}_{dtype}"), cfg_rows(q, CHUNK, 0);
                    row, partial.buf.ptr(), q as u64, CHUNK as u64, op);
                if rem > 0 {
                    launch!(dev, *module, format!("{kind}_{dtype}"), cfg_rows(1, rem, 0);
                        row + (q * CHUNK) as u64 * esz, partial.buf.ptr_at(q), 1u64, rem as u64, op);
                }
                launch!(dev, *module, format!("{kind}_{acc}"), cfg_rows(1, parts, 0);
                    partial.buf.ptr(), out.buf.ptr_at(r), 1u64, parts as u64, op);
            }
            return Ok(());
        }
        if rows > 0 {
            launch!(dev, *module, format!("{kind}_{dtype}"), cfg_rows(rows, cols, 0);
                x, out.buf.ptr(), rows as u64, cols as u64, op);
        }
        Ok(())
    }

    /// Move `dims` last and return (rows, cols, pointer, owned copy) of the row-major result.
    fn rows_over(&self, l: &Layout, dims: &[usize]) -> Result<(usize, usize, u64, Option<CudaStorage>)> {
        let rank = l.dims().len();
        let mut perm: Vec<usize> = (0..rank).filter(|d| !dims.contains(d)).collect();
        let rows = perm.iter().map(|&d| l.dims()[d]).product();
        perm.extend_from_slice(dims);
        let cols = dims.iter().map(|&d| l.dims()[d]).product();
        let pl = l.permute(&perm)?;
        let (ptr, owned) = self.contiguous_ptr(&pl)?;
        Ok((rows, cols, ptr, owned))
    }

    fn zeros_broadcast(&self, l: &Layout) -> Result<(CudaStorage, Layout)> {
        let z = CudaStorage::full(self.dev(), 0.0, 1, self.dtype())?;
        let zl = Layout::new(l.shape().clone(), vec![0; l.dims().len()], 0);
        Ok((z, zl))
    }
}

impl BackendStorage for CudaStorage {
    fn dtype(&self) -> DType {
        self.buf.dtype
    }

    fn device(&self) -> Device {
        Device::Cuda(self.dev().ordinal)
    }

    fn copy_strided(&self, l: &Layout) -> Result<Self> {
        let out = CudaStorage::uninit(self.dev(), l.elem_count(), self.dtype())?;
        self.copy_to_ptr(l, out.buf.ptr())?;
        Ok(out)
    }

    fn copy_strided_into(&self, l: &Layout, dst: &mut Self, dst_offset: usize) -> Result<()> {
        same_dtype("copy_strided_into", self, dst)?;
        let n = l.elem_count();
        if dst_offset + n > dst.len() {
            return Err(shape_err!("copy_strided_into", "{n} elements at {dst_offset} overflow {}", dst.len()));
        }
        self.copy_to_ptr(l, dst.buf.ptr_at(dst_offset))
    }

    fn to_dtype(&self, l: &Layout, dtype: DType) -> Result<Self> {
        if dtype == self.dtype() {
            return self.copy_strided(l);
        }
        let n = l.elem_count();
        let out = CudaStorage::uninit(self.dev(), n, dtype)?;
        if n > 0 {
            launch!(self.dev(), modules::CAST, format!("cast_{}_{}", self.dtype(), dtype), cfg_1d(n);
                KLayout::new(l)?, self.buf.ptr(), out.buf.ptr(), n as u64);
        }
        Ok(out)
    }

    fn unary(&self, l: &Layout, op: UnaryOp) -> Result<Self> {
        if !self.dtype().is_float() && !op.int_ok() {
            return Err(Error::UnsupportedDType { op: op.name(), dtype: self.dtype() });
        }
        let n = l.elem_count();
        let out = CudaStorage::uninit(self.dev(), n, self.dtype())?;
        if n > 0 {
            let (code, p0, p1) = unary_code(op);
            launch!(self.dev(), modules::UNARY, format!("unary_{}", self.dtype()), cfg_1d(n);
                KLayout::new(l)?, self.buf.ptr(), out.buf.ptr(), n as u64, code, p0, p1);
        }
        Ok(out)
    }

    fn binary(&self, l: &Layout, rhs: &Self, rl: &Layout, op: BinaryOp) -> Result<Self> {
        same_dtype(op.name(), self, rhs)?;
        let n = l.elem_count();
        let out = CudaStorage::uninit(self.dev(), n, self.dtype())?;
        if n > 0 {
            launch!(self.dev(), modules::BINARY, format!("binary_{}", self.dtype()), cfg_1d(n);
                KLayout::new(l)?, self.buf.ptr(), KLayout::new(rl)?, rhs.buf.ptr(), out.buf.ptr(), n as u64, binary_code(op));
        }
        Ok(out)
    }

    fn cmp(&self, l: &Layout, rhs: &Self, rl: &Layout, op: CmpOp) -> Result<Self> {
        same_dtype("cmp", self, rhs)?;
        let n = l.elem_count();
        let out = CudaStorage::uninit(self.dev(), n, DType::U8)?;
        if n > 0 {
            launch!(self.dev(), modules::BINARY, format!("cmp_{}", self.dtype()), cfg_1d(n);
                KLayout::new(l)?, self.buf.ptr(), KLayout::new(rl)?, rhs.buf.ptr(), out.buf.ptr(), n as u64, op as i32);
        }
        Ok(out)
    }

    fn where_cond(&self, l: &Layout, t: &Self, tl: &Layout, f: &Self, fl: &Layout) -> Result<Self> {
        same_dtype("where_cond", t, f)?;
        let n = l.elem_count();
        let (c, cl) = if self.dtype() == DType::U8 {
            (None, l.clone())
        } else {
            let (z, zl) = self.zeros_broadcast(l)?;
            (Some(self.cmp(l, &z, &zl, CmpOp::Ne)?), Layout::contiguous(l.shape().clone()))
        };
        let cptr = c.as_ref().map_or(self.buf.ptr(), |c| c.buf.ptr());
        let out = CudaStorage::uninit(self.dev(), n, t.dtype())?;
        if n > 0 {
            launch!(self.dev(), modules::BINARY, format!("where_{}", width_suffix(t.dtype())), cfg_1d(n);
                KLayout::new(&cl)?, cptr, KLayout::new(tl)?, t.buf.ptr(), KLayout::new(fl)?, f.buf.ptr(),
                out.buf.ptr(), n as u64);
        }
        Ok(out)
    }

    fn reduce(&self, l: &Layout, op: ReduceOp, dims: &[usize]) -> Result<Self> {
        let (rows, cols, ptr, _keep) = self.rows_over(l, dims)?;
        let acc = acc_dtype(self.dtype());
        let out = CudaStorage::uninit(self.dev(), rows, acc)?;
        self.reduce_rows(ptr, self.dtype(), &out, rows, cols, op as i32, false)?;
        if acc == self.dtype() {
            Ok(out)
        } else {
            out.cast_to(self.dtype())
        }
    }

    fn arg_reduce(&self, l: &Layout, op: ArgReduceOp, dim: usize) -> Result<Self> {
        let (rows, cols, ptr, _keep) = self.rows_over(l, &[dim])?;
        let out = CudaStorage::uninit(self.dev(), rows, DType::U32)?;
        self.reduce_rows(ptr, self.dtype(), &out, rows, cols, op as i32, true)?;
        Ok(out)
    }

    fn softmax_last(&self, l: &Layout, log: bool) -> Result<Self> {
        float_only("softmax", self)?;
        let cols = l.dims().last().copied().unwrap_or(1);
        let n = l.elem_count();
        let rows = n.checked_div(cols).unwrap_or(0);
        let (x, _keep) = self.contiguous_ptr(l)?;
        let out = CudaStorage::uninit(self.dev(), n, self.dtype())?;
        if rows > 0 {
            let (es, acc) = (self.dtype().size_in_bytes(), acc_dtype(self.dtype()).size_in_bytes());
            let aligned = x % 16 == 0 && out.buf.ptr() % 16 == 0;
            // The row in registers, moved 16 bytes at a time, where it fits; else one block per row.
            let (name, cfg) = match super::storage::cfg_norm_rows(rows, cols, es, acc, aligned) {
                Some(cfg) => (format!("softmax_rows_{}", self.dtype()), cfg),
                None => {
                    let smem = cols * acc;
                    let smem = if smem <= MAX_ROW_SMEM { smem as u32 } else { 0 };
                    (format!("softmax_{}", self.dtype()), cfg_rows(rows, cols, smem))
                }
            };
            launch!(self.dev(), modules::SOFTMAX, name, cfg; x, out.buf.ptr(), rows as u64, cols as u64, log as i32);
        }
        Ok(out)
    }

    fn layer_norm(
        &self,
        l: &Layout,
        weight: Option<(&Self, &Layout)>,
        bias: Option<(&Self, &Layout)>,
        eps: f64,
    ) -> Result<(Self, Self, Self)> {
        float_only("layer_norm", self)?;
        let cols = l.dims().last().copied().unwrap_or(1);
        let n = l.elem_count();
        let rows = n.checked_div(cols).unwrap_or(0);
        let (x, _k) = self.contiguous_ptr(l)?;
        let param = |p: Option<(&Self, &Layout)>| -> Result<(u64, Option<CudaStorage>)> {
            match p {
                None => Ok((0, None)),
                Some((s, pl)) => {
                    same_dtype("layer_norm", self, s)?;
                    s.contiguous_ptr(pl)
                }
            }
        };
        let ((w, _kw), (b, _kb)) = (param(weight)?, param(bias)?);
        let acc = acc_dtype(self.dtype());
        let y = CudaStorage::uninit(self.dev(), n, self.dtype())?;
        let mean = CudaStorage::uninit(self.dev(), rows, acc)?;
        let rstd = CudaStorage::uninit(self.dev(), rows, acc)?;
        if rows > 0 {
            let aligned = [x, y.buf.ptr(), w, b].iter().all(|p| p % 16 == 0); // w, b: 0 when absent
            let (es, accs) = (self.dtype().size_in_bytes(), acc.size_in_bytes());
            // The row in registers, moved 16 bytes at a time, where it fits; else one block per row.
            let (name, cfg) = match super::storage::cfg_norm_rows(rows, cols, es, accs, aligned) {
                Some(cfg) => (format!("layernorm_fwd_rows_{}", self.dtype()), cfg),
                None => {
                    let smem = cols * accs;
                    let smem = if smem <= MAX_ROW_SMEM { smem as u32 } else { 0 };
                    (format!("layernorm_fwd_{}", self.dtype()), cfg_rows(rows, cols, smem))
                }
            };
            launch!(self.dev(), modules::LAYERNORM, name, cfg;
                x, w, b, y.buf.ptr(), mean.buf.ptr(), rstd.buf.ptr(), rows as u64, cols as u64, eps,
                weight.is_some() as i32, bias.is_some() as i32);
        }
        Ok((y, mean, rstd))
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
        float_only("layer_norm_backward", self)?;
        same_dtype("layer_norm_backward", self, dy)?;
        if dyl.dims() != l.dims() {
            return Err(Error::ShapeMismatch {
                op: "layer_norm_backward",
                lhs: l.dims().to_vec(),
                rhs: dyl.dims().to_vec(),
            });
        }
        let cols = l.dims().last().copied().unwrap_or(1);
        let n = l.elem_count();
        let rows = n.checked_div(cols).unwrap_or(0);
        let acc = acc_dtype(self.dtype());
        if mean.len() != rows || rstd.len() != rows || mean.dtype() != acc || rstd.dtype() != acc {
            return Err(shape_err!("layer_norm_backward", "saved statistics do not match {rows} rows of {acc}"));
        }
        let (x, _k) = self.contiguous_ptr(l)?;
        let (g, _kg) = dy.contiguous_ptr(dyl)?;
        let (w, _kw) = match weight {
            Some((s, wl)) => s.contiguous_ptr(wl)?,
            None => (0, None),
        };
        let dx = CudaStorage::uninit(self.dev(), n, self.dtype())?;
        let dw = CudaStorage::full(self.dev(), 0.0, cols, acc)?;
        let db = CudaStorage::full(self.dev(), 0.0, cols, acc)?;
        if rows > 0 {
            let smem = cols * acc.size_in_bytes();
            let smem = if smem <= MAX_ROW_SMEM { smem as u32 } else { 0 };
            launch!(self.dev(), modules::LAYERNORM, format!("layernorm_bwd_{}", self.dtype()), cfg_rows(rows, cols, smem);
                x, w, mean.buf.ptr(), rstd.buf.ptr(), g, dx.buf.ptr(), dw.buf.ptr(), db.buf.ptr(),
                rows as u64, cols as u64, weight.is_some() as i32);
        }
        let pd = weight.map_or(self.dtype(), |(w, _)| w.dtype());
        let (dw, db) = if pd == acc { (dw, db) } else { (dw.cast_to(pd)?, db.cast_to(pd)?) };
        Ok((dx, dw, db))
    }

    fn matmul(&self, l: &Layout, rhs: &Self, rl: &Layout, dims: MatmulDims) -> Result<Self> {
        same_dtype("matmul", self, rhs)?;
        super::matmul::matmul(self, l, rhs, rl, dims)
    }

    fn index_select(&self, l: &Layout, ids: &Self, il: &Layout, dim: usize) -> Result<Self> {
        let d = l.dims();
        let (outer, size, inner) = (d[..dim].iter().product::<usize>(), d[dim], d[dim + 1..].iter().product::<usize>());
        let idx = ids.checked_ids(il, size, "index_select")?;
        let (x, _k) = self.contiguous_ptr(l)?;
        let n = outer * idx.len() * inner;
        let out = CudaStorage::uninit(self.dev(), n, self.dtype())?;
        if n > 0 {
            launch!(self.dev(), modules::INDEX, format!("index_select_{}", width_suffix(self.dtype())), cfg_1d(n);
                x, idx.buf.ptr(), out.buf.ptr(), outer as u64, size as u64, inner as u64, idx.len() as u64);
        }
        Ok(out)
    }

    fn gather(&self, l: &Layout, ids: &Self, il: &Layout, dim: usize) -> Result<Self> {
        check_gather("gather", l.dims(), il.dims(), dim)?;
        let idx = ids.checked_ids(il, l.dims()[dim], "gather")?;
        let n = il.elem_count();
        let out = CudaStorage::uninit(self.dev(), n, self.dtype())?;
        if n > 0 {
            launch!(self.dev(), modules::INDEX, format!("gather_{}", width_suffix(self.dtype())), cfg_1d(n);
                KLayout::exact(l)?, self.buf.ptr(), KLayout::exact(&Layout::contiguous(il.shape().clone()))?,
                idx.buf.ptr(), out.buf.ptr(), n as u64, dim as u32);
        }
        Ok(out)
    }

    fn index_add(&self, l: &Layout, ids: &Self, il: &Layout, src: &Self, sl: &Layout, dim: usize) -> Result<Self> {
        same_dtype("index_add", self, src)?;
        atomic_dtype("index_add", self.dtype())?;
        let d = l.dims();
        let (outer, size, inner) = (d[..dim].iter().product::<usize>(), d[dim], d[dim + 1..].iter().product::<usize>());
        let idx = ids.checked_ids(il, size, "index_add")?;
        let mut want = d.to_vec();
        want[dim] = idx.len();
        if sl.dims() != want.as_slice() {
            return Err(Error::ShapeMismatch { op: "index_add", lhs: want, rhs: sl.dims().to_vec() });
        }
        let out = self.copy_strided(l)?;
        let (s, _k) = src.contiguous_ptr(sl)?;
        let n = sl.elem_count();
        if n > 0 {
            launch!(self.dev(), modules::INDEX, format!("index_add_{}", self.dtype()), cfg_1d(n);
                out.buf.ptr(), idx.buf.ptr(), s, outer as u64, size as u64, inner as u64, idx.len() as u64);
        }
        Ok(out)
    }

    fn scatter_add(&self, l: &Layout, ids: &Self, il: &Layout, src: &Self, sl: &Layout, dim: usize) -> Result<Self> {
        same_dtype("scatter_add", self, src)?;
        atomic_dtype("scatter_add", self.dtype())?;
        check_gather("scatter_add", l.dims(), il.dims(), dim)?;
        if sl.dims() != il.dims() {
            return Err(Error::ShapeMismatch { op: "scatter_add", lhs: il.dims().to_vec(), rhs: sl.dims().to_vec() });
        }
        let idx = ids.checked_ids(il, l.dims()[dim], "scatter_add")?;
        let out = self.copy_strided(l)?;
        let (s, _k) = src.contiguous_ptr(sl)?;
        let n = sl.elem_count();
        if n > 0 {
            launch!(self.dev(), modules::INDEX, format!("scatter_add_{}", self.dtype()), cfg_1d(n);
                out.buf.ptr(), KLayout::exact(&Layout::contiguous(l.shape().clone()))?,
                KLayout::exact(&Layout::contiguous(il.shape().clone()))?, idx.buf.ptr(), s, n as u64, dim as u32);
        }
        Ok(out)
    }
}

fn atomic_dtype(op: &'static str, d: DType) -> Result<()> {
    match d {
        DType::U8 | DType::I8 => Err(Error::UnsupportedDType { op, dtype: d }),
        _ => Ok(()),
    }
}
