//! `KLayout`: the strided layout as the kernels take it by value (`struct Layout` in
//! `kernels/include/common.cuh`, docs/kernel-abi.md).

use crate::{shape_err, Layout, Result};
use cudarc::driver::DeviceRepr;

/// Dims a kernel layout holds (`FG_MAX_DIMS`, passed to every module as a define).
pub const MAX_DIMS: usize = 8;

/// The kernels' `Layout` (see docs/kernel-abi.md).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct KLayout {
    /// Number of dims.
    pub rank: u32,
    /// 1 when the view is row-major without gaps (kernels take a fast path).
    pub contiguous: u32,
    /// First element's index.
    pub offset: u64,
    /// Sizes, padded with 1.
    pub dims: [u64; MAX_DIMS],
    /// Strides in elements, padded with 0.
    pub strides: [u64; MAX_DIMS],
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
        let dims = l.merged_dims(); // innermost first
        if dims.len() > MAX_DIMS {
            return Err(shape_err!(
                "cuda",
                "a view with {} non-mergeable dims (at most {MAX_DIMS}): {:?}",
                dims.len(),
                l.dims()
            ));
        }
        k.rank = dims.len() as u32;
        for (i, (d, s)) in dims.iter().rev().enumerate() {
            k.dims[i] = *d as u64;
            k.strides[i] = *s as u64;
        }
        for i in dims.len()..MAX_DIMS {
            k.dims[i] = 1;
        }
        Ok(k)
    }

    /// The layout with its dims kept as they are (for kernels that work with coordinates).
    pub fn exact(l: &Layout) -> Result<KLayout> {
        if l.dims().len() > MAX_DIMS {
            return Err(shape_err!("cuda", "rank {} is above the kernels' {MAX_DIMS} dims", l.dims().len()));
        }
        let mut k = KLayout { offset: l.offset() as u64, contiguous: l.is_contiguous() as u32, ..Default::default() };
        k.rank = l.dims().len() as u32;
        for i in 0..MAX_DIMS {
            k.dims[i] = l.dims().get(i).map_or(1, |&d| d as u64);
            k.strides[i] = l.strides().get(i).map_or(0, |&s| s as u64);
        }
        Ok(k)
    }

    /// A contiguous 1-d layout of `n` elements.
    pub fn contiguous(n: usize) -> KLayout {
        KLayout::new(&Layout::contiguous(n)).unwrap_or_default()
    }
}
