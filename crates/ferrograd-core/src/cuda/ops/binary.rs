//! Launches of `kernels/binary.cu`: elementwise binary ops, comparisons and `where`.

use super::same_dtype;
use crate::cuda::klayout::KLayout;
use crate::cuda::launch::{cfg_1d, cfg_map, launch, width_suffix};
use crate::cuda::modules;
use crate::cuda::storage::CudaStorage;
use crate::op::{BinaryOp, CmpOp};
use crate::{DType, Layout, Result};

/// The part of binary.cu holding `binary_<dtype>` (`cmp_*` and `where_*` are in `BINARY_REST`).
fn module(dtype: DType) -> &'static modules::Module {
    match dtype {
        DType::F32 | DType::F64 => &modules::BINARY,
        DType::F16 | DType::BF16 => &modules::BINARY_HALF,
        _ => &modules::BINARY_REST,
    }
}

pub(super) fn binary(a: &CudaStorage, l: &Layout, b: &CudaStorage, rl: &Layout, op: BinaryOp) -> Result<CudaStorage> {
    same_dtype(op.name(), a, b)?;
    let n = l.elem_count();
    let dev = a.dev();
    let out = CudaStorage::uninit(dev, n, a.dtype())?;
    if n > 0 {
        let vector = super::vector_ok(a, l) && super::vector_ok(b, rl);
        launch!(dev, *module(a.dtype()), format!("binary_{}", a.dtype()), cfg_map(dev, n, a.dtype(), vector, 2);
            KLayout::new(l)?, a.buf.ptr(), KLayout::new(rl)?, b.buf.ptr(), out.buf.ptr(), n as u64, op as i32);
    }
    Ok(out)
}

pub(super) fn cmp(a: &CudaStorage, l: &Layout, b: &CudaStorage, rl: &Layout, op: CmpOp) -> Result<CudaStorage> {
    same_dtype("cmp", a, b)?;
    let n = l.elem_count();
    let dev = a.dev();
    let out = CudaStorage::uninit(dev, n, DType::U8)?;
    if n > 0 {
        launch!(dev, modules::BINARY_REST, format!("cmp_{}", a.dtype()), cfg_1d(dev, n);
            KLayout::new(l)?, a.buf.ptr(), KLayout::new(rl)?, b.buf.ptr(), out.buf.ptr(), n as u64, op as i32);
    }
    Ok(out)
}

/// `c` is the condition (any dtype; non-zero is true): u8 is read as is, others compared to 0 first.
pub(super) fn where_cond(
    c: &CudaStorage,
    l: &Layout,
    t: &CudaStorage,
    tl: &Layout,
    f: &CudaStorage,
    fl: &Layout,
) -> Result<CudaStorage> {
    same_dtype("where_cond", t, f)?;
    let n = l.elem_count();
    let dev = c.dev();
    let (mask, ml) = if c.dtype() == DType::U8 {
        (None, l.clone())
    } else {
        let (z, zl) = c.zeros_broadcast(l)?;
        (Some(cmp(c, l, &z, &zl, CmpOp::Ne)?), Layout::contiguous(l.shape().clone()))
    };
    let cptr = mask.as_ref().map_or(c.buf.ptr(), |m| m.buf.ptr());
    let out = CudaStorage::uninit(dev, n, t.dtype())?;
    if n > 0 {
        launch!(dev, modules::BINARY_REST, format!("where_{}", width_suffix(t.dtype())), cfg_1d(dev, n);
            KLayout::new(&ml)?, cptr, KLayout::new(tl)?, t.buf.ptr(), KLayout::new(fl)?, f.buf.ptr(),
            out.buf.ptr(), n as u64);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel the launches above can name is in the part they pick.
    #[test]
    fn each_launch_finds_its_kernel_in_the_module_it_picks() {
        let mut routes = vec![];
        for dtype in DType::ALL {
            routes.push((format!("binary_{dtype}"), module(dtype)));
            routes.push((format!("cmp_{dtype}"), &modules::BINARY_REST));
            routes.push((format!("where_{}", width_suffix(dtype)), &modules::BINARY_REST));
        }
        modules::check_routes(&[&modules::BINARY, &modules::BINARY_HALF, &modules::BINARY_REST], &routes);
    }
}
