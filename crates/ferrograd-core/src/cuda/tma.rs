//! Tensor maps for the Hopper Tensor Memory Accelerator (TMA): the 128-byte descriptor a kernel
//! hands to `cp.async.bulk.tensor` so that one instruction copies a whole box of a strided tensor
//! into shared memory, swizzled as `wgmma` reads it. Built on the host by the driver's
//! `cuTensorMapEncodeTiled` (pure host work: no device call, nothing to synchronize, so a launch
//! that takes one can be captured in a CUDA graph) and passed to the kernel by value as a
//! `__grid_constant__` parameter.
//!
//! Why a kernel wants it: a warp issuing 16-byte `cp.async` copies spends most of its instructions
//! on addresses; the attention forward's producer warp doing that was its own bottleneck
//! (BENCHMARKS.md, 2026-11-24 tenth session), where a TMA producer issues four instructions a tile.

use crate::cuda::device::driver_err;
use crate::{DType, Error, Result};
use cudarc::driver::{sys, DeviceRepr};

/// A `CUtensorMap`: 128 opaque bytes, 64-byte aligned (what the kernel parameter's alignment and
/// the driver expect).
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug)]
pub struct TensorMap([u64; 16]);

// SAFETY: plain bytes with the C layout and alignment of `CUtensorMap`; the kernel reads it as its
// `FgTmap` parameter of the same size and alignment.
unsafe impl DeviceRepr for TensorMap {}

/// A rank-4 tensor of 16-bit elements, `dims` innermost first (elements), `strides` the byte
/// strides of dims 1..3, read in boxes of `box_dims` elements with the 128-byte swizzle (the
/// innermost box dim times the element size must be at most 128 bytes). Elements outside `dims`
/// read as zero.
pub fn tiled_4d_swizzle128(
    ptr: u64,
    dtype: DType,
    dims: [u64; 4],
    strides: [u64; 3],
    box_dims: [u32; 4],
) -> Result<TensorMap> {
    let ty = match dtype {
        DType::BF16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        DType::F16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        other => return Err(Error::Cuda(format!("tensor map: {other} is not a 16-bit type"))),
    };
    check(ptr, dims, strides, box_dims)?;
    let mut map = TensorMap([0; 16]);
    let elem_strides = [1u32; 4];
    // SAFETY: every array has the length the rank (4) asks for; `map` is 128 bytes, 64-byte
    // aligned, as CUtensorMap is; the driver only encodes (it does not dereference `ptr`).
    let r = unsafe {
        sys::cuTensorMapEncodeTiled(
            (&mut map as *mut TensorMap).cast::<sys::CUtensorMap>(),
            ty,
            4,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            box_dims.as_ptr(),
            elem_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(driver_err("cuTensorMapEncodeTiled", r));
    }
    Ok(map)
}

/// The driver's rules for a tiled map, checked here so that a violation names the value instead
/// of coming back as CUDA_ERROR_INVALID_VALUE.
fn check(ptr: u64, dims: [u64; 4], strides: [u64; 3], box_dims: [u32; 4]) -> Result<()> {
    let bad = |what: String| Err(Error::Cuda(format!("tensor map: {what}")));
    if !ptr.is_multiple_of(16) {
        return bad(format!("address {ptr:#x} is not 16-byte aligned"));
    }
    if let Some(d) = dims.iter().find(|&&d| d == 0 || d > 1 << 32) {
        return bad(format!("dimension {d} is outside 1..=2^32 (dims {dims:?})"));
    }
    if let Some(s) = strides.iter().find(|&&s| !s.is_multiple_of(16) || s >= 1 << 40) {
        return bad(format!("stride {s} bytes is not a multiple of 16 below 2^40 (strides {strides:?})"));
    }
    if box_dims.iter().any(|&b| b == 0 || b > 256) || box_dims[0] * 2 > 128 {
        return bad(format!("box {box_dims:?}: each 1..=256, the innermost at most 128 bytes"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_driver_rules_are_named_before_the_driver_is_asked() {
        let ok = check(0x1000, [128, 77, 16, 4], [6144, 256, 473088], [64, 64, 1, 1]);
        assert!(ok.is_ok());
        let e = check(0x1008, [128, 77, 16, 4], [6144, 256, 473088], [64, 64, 1, 1]).unwrap_err();
        assert!(e.to_string().contains("16-byte aligned"), "{e}");
        let e = check(0x1000, [128, 0, 16, 4], [6144, 256, 473088], [64, 64, 1, 1]).unwrap_err();
        assert!(e.to_string().contains("dimension 0"), "{e}");
        let e = check(0x1000, [128, 77, 16, 4], [6150, 256, 473088], [64, 64, 1, 1]).unwrap_err();
        assert!(e.to_string().contains("stride 6150"), "{e}");
        let e = check(0x1000, [128, 77, 16, 4], [6144, 256, 473088], [128, 64, 1, 1]).unwrap_err();
        assert!(e.to_string().contains("box"), "{e}");
    }

    #[test]
    fn a_tensor_map_has_the_layout_of_cu_tensor_map() {
        assert_eq!(std::mem::size_of::<TensorMap>(), std::mem::size_of::<sys::CUtensorMap>());
        assert_eq!(std::mem::align_of::<TensorMap>(), 64);
    }

    #[test]
    fn only_16_bit_types_get_a_map() {
        let e = tiled_4d_swizzle128(0x1000, DType::F32, [64, 8, 1, 1], [128, 1024, 1024], [64, 8, 1, 1]);
        assert!(e.unwrap_err().to_string().contains("not a 16-bit type"));
    }
}
