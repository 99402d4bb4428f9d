//! Batched matmul through the `gemm` crate, which takes arbitrary row/column strides, so transposed
//! operands are multiplied in place. Batch dims may be broadcast (stride 0). bf16 goes through f32
//! because `gemm` has no bf16 kernel.

use super::{strided, CpuStorage};
use crate::backend::MatmulDims;
use crate::{Error, Layout, Result};
use gemm::{gemm, Parallelism};
use half::{bf16, f16};
use rayon::prelude::*;

/// Storage offsets of each matrix in the batch.
fn batch_offsets(l: &Layout) -> Result<Vec<usize>> {
    let r = l.dims().len();
    let b = Layout::new(l.dims()[..r - 2].to_vec().into(), l.strides()[..r - 2].to_vec(), l.offset());
    strided::offsets(&b)
}

/// gemm's packing reads any stride, but a stride-0 matrix dim aliases elements; copy those first.
fn matrix_strides(l: &Layout) -> Option<(isize, isize)> {
    let r = l.dims().len();
    let (rs, cs) = (l.strides()[r - 2], l.strides()[r - 1]);
    let ok = (rs != 0 || l.dims()[r - 2] == 1) && (cs != 0 || l.dims()[r - 1] == 1);
    ok.then_some((rs.max(1) as isize, cs.max(1) as isize))
}

struct SendPtr<T>(*mut T);
unsafe impl<T> Send for SendPtr<T> {}
unsafe impl<T> Sync for SendPtr<T> {}

fn matmul_t<T: gemm_t::Elem>(a: &[T], al: &Layout, b: &[T], bl: &Layout, d: MatmulDims) -> Result<Vec<T>> {
    let (a_own, al) = match matrix_strides(al) {
        Some(_) => (None, al.clone()),
        None => (Some(strided::gather_contiguous(a, al)?), Layout::contiguous(al.shape().clone())),
    };
    let (b_own, bl) = match matrix_strides(bl) {
        Some(_) => (None, bl.clone()),
        None => (Some(strided::gather_contiguous(b, bl)?), Layout::contiguous(bl.shape().clone())),
    };
    let a = a_own.as_deref().unwrap_or(a);
    let b = b_own.as_deref().unwrap_or(b);
    let (ars, acs) = matrix_strides(&al).unwrap_or((1, 1));
    let (brs, bcs) = matrix_strides(&bl).unwrap_or((1, 1));
    let (aoffs, boffs) = (batch_offsets(&al)?, batch_offsets(&bl)?);
    let MatmulDims { batch, m, n, k } = d;
    // `Tensor::matmul` checked the output shape [batch.., m, n], so these products are exact.
    let mut out = super::alloc::filled(T::ZERO, batch * m * n)?;
    if m * n == 0 {
        return Ok(out);
    }
    let small = m * n * k < 96 * 96 * 96;
    let run = |i: usize, dst: *mut T, par: Parallelism| {
        // SAFETY: offsets and strides come from valid layouts of `a` and `b`, so every element the
        // product reads is in bounds; `dst` is the i-th disjoint [m, n] block of `out`.
        unsafe {
            gemm(
                m,
                n,
                k,
                dst,
                1,
                n as isize,
                false,
                a.as_ptr().add(aoffs[i]),
                acs,
                ars,
                b.as_ptr().add(boffs[i]),
                bcs,
                brs,
                T::ZERO,
                T::ONE,
                false,
                false,
                false,
                par,
            )
        }
    };
    if batch > 1 && small {
        let base = SendPtr(out.as_mut_ptr());
        let base = &base;
        (0..batch).into_par_iter().for_each(|i| run(i, unsafe { base.0.add(i * m * n) }, Parallelism::None));
    } else {
        let par = if small { Parallelism::None } else { Parallelism::Rayon(rayon::current_num_threads()) };
        for i in 0..batch {
            run(i, unsafe { out.as_mut_ptr().add(i * m * n) }, par);
        }
    }
    Ok(out)
}

mod gemm_t {
    pub trait Elem: Copy + Send + Sync + bytemuck::Zeroable + 'static {
        const ZERO: Self;
        const ONE: Self;
    }
    impl Elem for f32 {
        const ZERO: Self = 0.0;
        const ONE: Self = 1.0;
    }
    impl Elem for f64 {
        const ZERO: Self = 0.0;
        const ONE: Self = 1.0;
    }
    impl Elem for half::f16 {
        const ZERO: Self = half::f16::ZERO;
        const ONE: Self = half::f16::ONE;
    }
}

pub fn matmul(a: &CpuStorage, al: &Layout, b: &CpuStorage, bl: &Layout, d: MatmulDims) -> Result<CpuStorage> {
    use crate::backend::BackendStorage;
    Ok(match (a, b) {
        (CpuStorage::F32(x), CpuStorage::F32(y)) => CpuStorage::F32(matmul_t(x, al, y, bl, d)?),
        (CpuStorage::F64(x), CpuStorage::F64(y)) => CpuStorage::F64(matmul_t(x, al, y, bl, d)?),
        (CpuStorage::F16(x), CpuStorage::F16(y)) => CpuStorage::F16(matmul_t::<f16>(x, al, y, bl, d)?),
        (CpuStorage::BF16(x), CpuStorage::BF16(y)) => {
            let x32 = strided::map(x, al, |v| v.to_f32())?;
            let y32 = strided::map(y, bl, |v| v.to_f32())?;
            let (xl, yl) = (Layout::contiguous(al.shape().clone()), Layout::contiguous(bl.shape().clone()));
            let out = matmul_t(&x32, &xl, &y32, &yl, d)?;
            CpuStorage::BF16(super::alloc::collect(out.into_iter().map(bf16::from_f32))?)
        }
        (x, y) if x.dtype() != y.dtype() => {
            return Err(Error::DTypeMismatch { op: "matmul", lhs: x.dtype(), rhs: y.dtype() })
        }
        (x, _) => return Err(Error::UnsupportedDType { op: "matmul", dtype: x.dtype() }),
    })
}
