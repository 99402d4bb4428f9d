//! `CudaStorage`: a device buffer plus the launch plumbing shared by the op implementations
//! (layout marshalling, launch shapes, host transfers, fills and random numbers).

use super::buffer::CudaBuffer;
use super::device::CudaDevice;
use super::modules;
use crate::cpu::CpuStorage;
use crate::{shape_err, DType, Error, Layout, Result, WithDType};
use cudarc::driver::{DeviceRepr, LaunchConfig};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

pub struct CudaStorage {
    pub(crate) buf: CudaBuffer,
}

impl std::fmt::Debug for CudaStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaStorage({} x {}, cuda:{})", self.buf.len, self.buf.dtype, self.buf.dev.ordinal)
    }
}

/// The kernels' `Layout` (see docs/kernel-abi.md).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct KLayout {
    pub rank: u32,
    pub contiguous: u32,
    pub offset: u64,
    pub dims: [u64; 8],
    pub strides: [u64; 8],
}

// SAFETY: plain-old-data with the C layout the kernels declare.
unsafe impl DeviceRepr for KLayout {}

impl KLayout {
    /// Marshal a layout, merging dims that are contiguous with each other and dropping size-1
    /// dims, so most views fit the kernels' 8 dims and contiguous ones take the fast path.
    #[inline]
    pub fn new(l: &Layout) -> Result<KLayout> {
        let mut k = KLayout { offset: l.offset() as u64, ..Default::default() };
        if l.is_contiguous() {
            k.rank = 1;
            k.contiguous = 1;
            k.dims[0] = l.elem_count() as u64;
            k.strides[0] = 1;
            return Ok(k);
        }
        // Build from the innermost dim outwards.
        let mut dims: Vec<(u64, u64)> = vec![];
        for (&d, &s) in l.dims().iter().zip(l.strides()).rev() {
            if d == 1 {
                continue;
            }
            match dims.last_mut() {
                Some((id, is)) if s as u64 == *is * *id => *id *= d as u64,
                _ => dims.push((d as u64, s as u64)),
            }
        }
        if dims.len() > 8 {
            return Err(shape_err!(
                "cuda",
                "a view with {} non-mergeable dims (at most 8): {:?}",
                dims.len(),
                l.dims()
            ));
        }
        k.rank = dims.len() as u32;
        for (i, (d, s)) in dims.iter().rev().enumerate() {
            k.dims[i] = *d;
            k.strides[i] = *s;
        }
        for i in dims.len()..8 {
            k.dims[i] = 1;
        }
        Ok(k)
    }

    /// The layout with its dims kept as they are (for kernels that work with coordinates).
    pub fn exact(l: &Layout) -> Result<KLayout> {
        if l.dims().len() > 8 {
            return Err(shape_err!("cuda", "rank {} is above the kernels' 8 dims", l.dims().len()));
        }
        let mut k = KLayout { offset: l.offset() as u64, contiguous: l.is_contiguous() as u32, ..Default::default() };
        k.rank = l.dims().len() as u32;
        for i in 0..8 {
            k.dims[i] = l.dims().get(i).map_or(1, |&d| d as u64);
            k.strides[i] = l.strides().get(i).map_or(0, |&s| s as u64);
        }
        Ok(k)
    }

    pub fn contiguous(n: usize) -> KLayout {
        KLayout::new(&Layout::contiguous(n)).unwrap_or_default()
    }
}

/// Multiprocessors of the opened GPU (launch shapes fill the chip, no more: launching blocks that
/// a grid-stride loop would cover costs more than it saves, measured 2.2 vs 3.7 TB/s on an H200).
static SMS: AtomicUsize = AtomicUsize::new(132);

pub(crate) fn set_sm_count(n: usize) {
    SMS.store(n.max(1), Ordering::Relaxed)
}

pub(crate) fn sm_count() -> usize {
    SMS.load(Ordering::Relaxed)
}

/// Grid-stride launch over `n` elements: 256 threads a block, at most a full chip of resident blocks.
pub fn cfg_1d(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, sm_count() * 8) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
}

/// One block per row (grid-stride over rows), threads chosen by the row length.
pub fn cfg_rows(rows: usize, cols: usize, shared_mem_bytes: u32) -> LaunchConfig {
    let threads = match cols {
        0..=64 => 32,
        65..=256 => 64,
        257..=1024 => 128,
        1025..=4096 => 256,
        4097..=16384 => 512,
        _ => 1024,
    };
    let resident = sm_count() * (2048 / threads as usize);
    LaunchConfig { grid_dim: (rows.clamp(1, resident) as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes }
}

/// Launch shape for the row-in-registers kernels `softmax_rows_*` / `layernorm_fwd_rows_*`
/// (kernels/softmax.cu, kernels/layernorm.cu), or `None` where they do not apply and the caller
/// launches the general kernel with `cfg_rows`. `aligned`: every pointer the kernel reads or writes
/// row-wise is 16-byte aligned. They apply when `cols` is a multiple of 16 / `elem_bytes` and at
/// most 1024 * E (E = the kernels' `fg_row_cap`: 32 elements a thread with a float accumulator, 8
/// with a double): rows of up to 32 * E elements go to a power-of-two group of lanes within a warp
/// (several rows a warp when short), 4 warps a block; longer rows to a block of one thread per
/// 32 elements (at least cols / E, a power of two, 64..=1024). One block per row (per 4 warps' rows),
/// no cap: measured on an H200 (f32, % of copy), capping the grid at one resident wave cost 10
/// points at 8192 x 8192 (softmax 87 against 97) and 2..7 at 65536 x 1024.
pub fn cfg_norm_rows(
    rows: usize,
    cols: usize,
    elem_bytes: usize,
    acc_bytes: usize,
    aligned: bool,
) -> Option<LaunchConfig> {
    let e = if acc_bytes == 8 { 8 } else { 32 }; // fg_row_cap
    let v = 16 / elem_bytes.max(1); // elements per 16-byte access
    if !aligned || cols == 0 || !cols.is_multiple_of(v) || cols > 1024 * e {
        return None;
    }
    let (threads, blocks) = if cols <= 32 * e {
        let lanes = (cols / v).div_ceil(e / v).next_power_of_two(); // lanes a row takes: 1..=32
        (128, rows.div_ceil(32 / lanes * 4))
    } else {
        let threads = cols.div_ceil(32).next_power_of_two().clamp(64, 1024);
        (threads.max(cols.div_ceil(e).next_power_of_two()), rows)
    };
    Some(LaunchConfig {
        grid_dim: (blocks.clamp(1, i32::MAX as usize) as u32, 1, 1),
        block_dim: (threads as u32, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// Launch `$name` from `$module` on the device's compute stream with the given arguments.
/// Each argument is bound to a local first, so it outlives the launch call.
macro_rules! launch {
    ($dev:expr, $module:expr, $name:expr, $cfg:expr; $($arg:expr),* $(,)?) => {{
        let name: &str = &$name;
        let f = $dev.func(&$module, name)?;
        let mut args = $crate::cuda::device::KernelArgs::new();
        $crate::cuda::storage::launch!(@push args; $($arg),*);
        // SAFETY: argument types and counts follow docs/kernel-abi.md for this kernel; every
        // pointer refers to a live buffer of the right length.
        unsafe { $dev.launch_args(&f, name, $cfg, &mut args) }?;
    }};
    (@push $b:ident; ) => {};
    (@push $b:ident; $head:expr $(, $tail:expr)*) => {
        let h = $head;
        $b.push(&h);
        $crate::cuda::storage::launch!(@push $b; $($tail),*);
    };
}
pub(crate) use launch;

pub(crate) fn width_suffix(dtype: DType) -> &'static str {
    match dtype.size_in_bytes() {
        1 => "b8",
        2 => "b16",
        4 => "b32",
        _ => "b64",
    }
}

impl CudaStorage {
    pub fn dev(&self) -> &Arc<CudaDevice> {
        &self.buf.dev
    }

    pub fn len(&self) -> usize {
        self.buf.len
    }

    pub fn is_empty(&self) -> bool {
        self.buf.len == 0
    }

    pub fn dtype(&self) -> DType {
        self.buf.dtype
    }

    pub(crate) fn uninit(dev: &Arc<CudaDevice>, len: usize, dtype: DType) -> Result<CudaStorage> {
        Ok(CudaStorage { buf: CudaBuffer::uninit(dev, len, dtype)? })
    }

    pub(crate) fn uninit_for_copy(dev: &Arc<CudaDevice>, len: usize, dtype: DType) -> Result<CudaStorage> {
        Ok(CudaStorage { buf: CudaBuffer::uninit_for_copy(dev, len, dtype)? })
    }

    /// Upload a host storage (pageable memory; the driver stages it, and the call returns once the
    /// host buffer may be reused).
    pub fn from_cpu(dev: &Arc<CudaDevice>, cpu: &CpuStorage) -> Result<CudaStorage> {
        let s = Self::uninit(dev, cpu.len(), crate::backend::BackendStorage::dtype(cpu))?;
        super::transfer::htod(dev, cpu.as_bytes(), &s.buf)?;
        Ok(s)
    }

    /// Upload several host storages in one copy; the results share one device allocation.
    pub fn from_cpu_many(dev: &Arc<CudaDevice>, parts: &[&CpuStorage]) -> Result<Vec<CudaStorage>> {
        let bytes: Vec<&[u8]> = parts.iter().map(|p| p.as_bytes()).collect();
        let (guard, offsets) = super::transfer::htod_many(dev, &bytes)?;
        Ok(parts
            .iter()
            .zip(offsets)
            .map(|(p, off)| {
                let dtype = crate::backend::BackendStorage::dtype(*p);
                CudaStorage { buf: CudaBuffer::sub(dev, guard.clone(), off, p.len(), dtype) }
            })
            .collect())
    }

    /// Download the whole buffer (blocks until the data is on the host).
    pub fn to_cpu(&self) -> Result<CpuStorage> {
        let mut out = CpuStorage::full(0.0, self.len(), self.dtype());
        super::transfer::dtoh(self.dev(), &self.buf, out.as_bytes_mut())?;
        Ok(out)
    }

    /// `n` copies of `v` (converted to `dtype` exactly as the CPU backend does).
    pub fn full(dev: &Arc<CudaDevice>, v: f64, n: usize, dtype: DType) -> Result<CudaStorage> {
        let s = Self::uninit(dev, n, dtype)?;
        if n == 0 {
            return Ok(s);
        }
        let one = CpuStorage::full(v, 1, dtype);
        let mut bits = [0u8; 8];
        bits[..dtype.size_in_bytes()].copy_from_slice(one.as_bytes());
        let bits = u64::from_le_bytes(bits);
        launch!(dev, modules::COPY, format!("fill_{}", width_suffix(dtype)), cfg_1d(n); s.buf.ptr(), bits, n as u64);
        Ok(s)
    }

    /// Philox random numbers, the same as the CPU backend draws for (seed, offset).
    #[allow(clippy::too_many_arguments)]
    pub fn random(
        dev: &Arc<CudaDevice>,
        normal: bool,
        n: usize,
        dtype: DType,
        seed: u64,
        offset: u64,
        a: f64,
        b: f64,
    ) -> Result<CudaStorage> {
        if !dtype.is_float() {
            let cpu = if normal {
                CpuStorage::from_f64_iter((0..n as u64).map(|i| a + b * crate::rng::normal_at(seed, offset, i)), dtype)
            } else {
                CpuStorage::from_f64_iter(
                    (0..n as u64).map(|i| a + (b - a) * crate::rng::uniform_at(seed, offset, i)),
                    dtype,
                )
            };
            return Self::from_cpu(dev, &cpu);
        }
        let s = Self::uninit(dev, n, dtype)?;
        if n > 0 {
            let kind = if normal { "normal" } else { "uniform" };
            launch!(dev, modules::RNG, format!("rand_{kind}_{dtype}"), cfg_1d(n); s.buf.ptr(), n as u64, seed, offset, a, b);
        }
        Ok(s)
    }

    /// A host copy of the elements a layout views.
    pub fn to_cpu_view(&self, l: &Layout) -> Result<CpuStorage> {
        if l.is_contiguous() && l.offset() == 0 && l.elem_count() == self.len() {
            return self.to_cpu();
        }
        crate::backend::BackendStorage::copy_strided(self, l)?.to_cpu()
    }

    /// Indices checked on the host against `size` and uploaded as u32 (the kernels' index type).
    pub(crate) fn checked_ids(&self, l: &Layout, size: usize, op: &'static str) -> Result<CudaStorage> {
        if self.dtype().is_float() {
            return Err(Error::UnsupportedDType { op, dtype: self.dtype() });
        }
        let host = self.to_cpu_view(l)?.to_f64_vec(&Layout::contiguous(l.elem_count()));
        let ids = host
            .into_iter()
            .map(|x| {
                if x < 0.0 || x as usize >= size {
                    Err(Error::IndexOutOfRange { op, index: x as i64, size })
                } else {
                    Ok(x as u32)
                }
            })
            .collect::<Result<Vec<u32>>>()?;
        Self::from_cpu(self.dev(), &u32::to_cpu_storage(ids))
    }
}
