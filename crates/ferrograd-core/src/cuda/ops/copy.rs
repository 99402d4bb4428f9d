//! Launches of `kernels/copy.cu`: strided copies (a driver memcpy when the view is contiguous,
//! tiles of a transpose when it is a permuted one) and fills.

use super::same_dtype;
use crate::cpu::CpuStorage;
use crate::cuda::device::{driver_err, CudaDevice};
use crate::cuda::klayout::KLayout;
use crate::cuda::launch::{cfg_1d, launch, width_suffix};
use crate::cuda::modules;
use crate::cuda::storage::CudaStorage;
use crate::{shape_err, DType, Layout, Result};
use cudarc::driver::{result, DeviceRepr, LaunchConfig};
use std::sync::Arc;

/// Copy the viewed elements to the device address `dst`, contiguous.
fn copy_to_ptr(s: &CudaStorage, l: &Layout, dst: u64) -> Result<()> {
    let n = l.elem_count();
    if n == 0 {
        return Ok(());
    }
    let dev = s.dev();
    if l.is_contiguous() {
        dev.ctx.bind_to_thread().map_err(|e| driver_err("cuCtxSetCurrent", e))?;
        let bytes = n * s.dtype().size_in_bytes();
        // SAFETY: both ranges lie inside live buffers of at least `bytes` bytes.
        unsafe { result::memcpy_dtod_async(dst, s.buf.ptr_at(l.offset()), bytes, dev.stream().cu_stream()) }
            .map_err(|e| driver_err("cuMemcpyDtoDAsync", e))?;
        return Ok(());
    }
    let kl = KLayout::new(l)?;
    if let Some(p) = TransposePlan::new(&kl) {
        let cfg = p.launch_config();
        launch!(dev, modules::COPY, format!("copy_transpose_{}", width_suffix(s.dtype())), cfg; p, s.buf.ptr(), dst);
        return Ok(());
    }
    let name = format!("copy_strided_{}", width_suffix(s.dtype()));
    launch!(dev, modules::COPY, name, cfg_1d(dev, n); kl, s.buf.ptr(), dst, n as u64);
    Ok(())
}

pub(super) fn copy_into_view(s: &CudaStorage, l: &Layout, dst: &mut CudaStorage, dl: &Layout) -> Result<()> {
    same_dtype("copy_into_view", s, dst)?;
    crate::backend::check_view_dst(l, dl, dst.len())?;
    let n = l.elem_count();
    if n == 0 {
        return Ok(());
    }
    if dl.is_contiguous() {
        return copy_to_ptr(s, l, dst.buf.ptr_at(dl.offset()));
    }
    let dev = s.dev();
    let name = format!("copy_view_{}", width_suffix(s.dtype()));
    launch!(dev, modules::COPY, name, cfg_1d(dev, n); KLayout::new(l)?, s.buf.ptr(), KLayout::new(dl)?, dst.buf.ptr(), n as u64);
    Ok(())
}

/// Outer dims a [`TransposePlan`] holds (`FgTranspose` in kernels/copy.cu).
const TRANSPOSE_OUTER: usize = 6;

/// A strided copy as tiles of a transpose (`FgTranspose`, `copy_transpose_*` in kernels/copy.cu):
/// for a view whose unit-stride dim is not its last (a permuted tensor made contiguous), where
/// `copy_strided_*`'s reads would take one 32-byte sector per element.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct TransposePlan {
    rank_o: u32,
    pad: u32,
    offset: u64,
    rows: u64,
    cols: u64,
    src_col_stride: u64,
    dst_row_stride: u64,
    batches: u64,
    dims: [u64; TRANSPOSE_OUTER],
    src: [u64; TRANSPOSE_OUTER],
    dst: [u64; TRANSPOSE_OUTER],
}

// SAFETY: plain-old-data with the C layout the kernel declares.
unsafe impl DeviceRepr for TransposePlan {}

impl TransposePlan {
    /// The plan for a merged layout (size-1 dims dropped, nested dims merged: [`KLayout::new`]),
    /// or `None` where the general kernel serves as well: the last dim already has unit stride,
    /// no other dim does (broadcasts, every stride above 1), or a tile would be mostly idle
    /// (fewer than 16 rows or columns).
    fn new(k: &KLayout) -> Option<TransposePlan> {
        let rank = k.rank as usize;
        if k.contiguous == 1 || rank < 2 || k.strides[rank - 1] == 1 {
            return None;
        }
        let r = (0..rank - 1).find(|&i| k.strides[i] == 1)?;
        let (rows, cols) = (k.dims[r], k.dims[rank - 1]);
        if rows < 16 || cols < 16 || rows.div_ceil(32) > 65_535 || cols.div_ceil(32) > u32::MAX as u64 {
            return None;
        }
        // The destination is contiguous: a dim's stride is the product of the dims after it.
        let mut dst_stride = [0u64; 8];
        let mut acc = 1u64;
        for i in (0..rank).rev() {
            dst_stride[i] = acc;
            acc *= k.dims[i];
        }
        let mut p = TransposePlan {
            offset: k.offset,
            rows,
            cols,
            src_col_stride: k.strides[rank - 1],
            dst_row_stride: dst_stride[r],
            batches: 1,
            ..Default::default()
        };
        for i in (0..rank - 1).filter(|&i| i != r) {
            let o = p.rank_o as usize;
            p.dims[o] = k.dims[i];
            p.src[o] = k.strides[i];
            p.dst[o] = dst_stride[i];
            p.batches *= k.dims[i];
            p.rank_o += 1;
        }
        Some(p)
    }

    fn launch_config(&self) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (self.cols.div_ceil(32) as u32, self.rows.div_ceil(32) as u32, self.batches.min(65_535) as u32),
            block_dim: (32, 8, 1),
            shared_mem_bytes: 0,
        }
    }
}

pub(super) fn copy_strided(s: &CudaStorage, l: &Layout) -> Result<CudaStorage> {
    let out = CudaStorage::uninit(s.dev(), l.elem_count(), s.dtype())?;
    copy_to_ptr(s, l, out.buf.ptr())?;
    Ok(out)
}

pub(super) fn copy_strided_into(s: &CudaStorage, l: &Layout, dst: &mut CudaStorage, dst_offset: usize) -> Result<()> {
    same_dtype("copy_strided_into", s, dst)?;
    let n = l.elem_count();
    if dst_offset + n > dst.len() {
        return Err(shape_err!("copy_strided_into", "{n} elements at {dst_offset} overflow {}", dst.len()));
    }
    copy_to_ptr(s, l, dst.buf.ptr_at(dst_offset))
}

impl CudaStorage {
    /// `n` copies of `v` (converted to `dtype` exactly as the CPU backend does).
    pub fn full(dev: &Arc<CudaDevice>, v: f64, n: usize, dtype: DType) -> Result<CudaStorage> {
        let s = Self::uninit(dev, n, dtype)?;
        if n == 0 {
            return Ok(s);
        }
        let one = CpuStorage::full(v, 1, dtype)?;
        let mut bits = [0u8; 8];
        bits[..dtype.size_in_bytes()].copy_from_slice(one.as_bytes());
        let bits = u64::from_le_bytes(bits);
        launch!(dev, modules::COPY, format!("fill_{}", width_suffix(dtype)), cfg_1d(dev, n); s.buf.ptr(), bits, n as u64);
        Ok(s)
    }

    /// A scalar zero viewed with `l`'s shape (stride 0 everywhere).
    pub(super) fn zeros_broadcast(&self, l: &Layout) -> Result<(CudaStorage, Layout)> {
        let z = CudaStorage::full(self.dev(), 0.0, 1, self.dtype())?;
        let zl = Layout::new(l.shape().clone(), vec![0; l.dims().len()], 0);
        Ok((z, zl))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Shape;
    use proptest::prelude::*;

    fn plan(dims: &[usize], strides: &[usize], offset: usize) -> Option<TransposePlan> {
        let l = Layout::new(Shape::from(dims.to_vec()), strides.to_vec(), offset);
        TransposePlan::new(&KLayout::new(&l).ok()?)
    }

    /// Every (batch, row, col) the kernel visits, as (destination index, source index), in the
    /// kernel's own arithmetic.
    fn visits(p: &TransposePlan) -> Vec<(u64, u64)> {
        let mut out = vec![];
        for b in 0..p.batches {
            let (mut so, mut dso, mut rem) = (p.offset, 0, b);
            for d in (0..p.rank_o as usize).rev() {
                let i = rem % p.dims[d];
                rem /= p.dims[d];
                so += i * p.src[d];
                dso += i * p.dst[d];
            }
            for r in 0..p.rows {
                for c in 0..p.cols {
                    out.push((dso + r * p.dst_row_stride + c, so + r + c * p.src_col_stride));
                }
            }
        }
        out
    }

    #[test]
    fn mamba_views_take_the_tiled_path() {
        // [B, L, 2 di] narrowed and permuted to [B, di, L] (the scan's z).
        let p = plan(&[16, 512, 256], &[262_144, 1, 1024], 512).expect("a transpose");
        assert_eq!((p.rows, p.cols, p.src_col_stride, p.dst_row_stride), (512, 256, 1024, 256));
        assert_eq!((p.rank_o, p.dims[0], p.src[0], p.dst[0], p.batches, p.offset), (1, 16, 262_144, 131_072, 16, 512));
        // A size-1 dim between (the scan's B and C, [B, 1, n, L]) is dropped.
        let p = plan(&[16, 1, 16, 256], &[12_288, 0, 1, 48], 16).expect("a transpose");
        assert_eq!((p.rows, p.cols, p.rank_o), (16, 256, 1));
    }

    #[test]
    fn other_views_keep_the_general_kernel() {
        assert_eq!(plan(&[64, 64], &[64, 1], 0), None, "contiguous");
        assert_eq!(plan(&[64, 64], &[128, 1], 0), None, "rows with gaps: the last dim has unit stride");
        assert_eq!(plan(&[64, 64], &[0, 1], 0), None, "broadcast rows");
        assert_eq!(plan(&[64, 64], &[2, 128], 0), None, "no unit stride");
        assert_eq!(plan(&[8, 64], &[1, 8], 0), None, "8 rows: a tile mostly idle");
        assert_eq!(plan(&[64, 8], &[1, 64], 0), None, "8 columns");
        assert!(plan(&[64, 16], &[1, 64], 0).is_some(), "16 x 64 transposed");
    }

    proptest! {
        /// Permuted and narrowed views of a row-major buffer: where a plan is made, the kernel's
        /// arithmetic writes every destination element once, from the element the view holds
        /// there.
        #[test]
        fn plans_visit_what_the_view_holds(
            dims in proptest::collection::vec(1usize..40, 2..5),
            perm_seed in any::<u64>(),
            cut in 0usize..3,
        ) {
            let base = Layout::contiguous(Shape::from(dims.clone()));
            let mut perm: Vec<usize> = (0..dims.len()).collect();
            let mut s = perm_seed;
            for i in (1..perm.len()).rev() {
                perm.swap(i, (s % (i as u64 + 1)) as usize);
                s /= 7;
            }
            let mut l = base.permute(&perm).unwrap();
            let d0 = l.dims()[0];
            if cut > 0 && d0 > cut {
                l = l.narrow(0, cut, d0 - cut).unwrap();
            }
            let Some(p) = TransposePlan::new(&KLayout::new(&l).unwrap()) else { return Ok(()) };
            let expected: Vec<u64> = l.offsets().map(|o| o as u64).collect();
            let mut got = vec![u64::MAX; expected.len()];
            for (d, src) in visits(&p) {
                prop_assert_eq!(got[d as usize], u64::MAX, "destination {} written twice", d);
                got[d as usize] = src;
            }
            prop_assert_eq!(got, expected);
        }
    }
}
