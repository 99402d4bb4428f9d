//! Elementwise loops over strided views, parallel with rayon once a tensor is large enough to pay
//! for the threads. Contiguous inputs take a slice fast path that the compiler can vectorise.
//! Output buffers are reserved fallibly (`alloc.rs`): a size the host cannot hold is an error.

use super::alloc;
use crate::{Layout, Result};
use rayon::prelude::*;

/// Below this many elements a loop stays on one thread: rayon's fork/join costs a few microseconds.
pub const PAR_MIN: usize = 1 << 15;

/// Fill `out` in parallel chunks; `f(start, chunk)` writes logical elements `start..start+len`.
pub fn par_fill<U: Send>(out: &mut [U], f: impl Fn(usize, &mut [U]) + Sync) {
    let n = out.len();
    if n < PAR_MIN {
        f(0, out);
        return;
    }
    let chunk = (n / (rayon::current_num_threads() * 4)).max(4096);
    out.par_chunks_mut(chunk).enumerate().for_each(|(i, c)| f(i * chunk, c));
}

/// `f` applied to every element `l` views in `src`, in row-major order, in parallel for large
/// tensors: the loop a fused op's CPU reference is built from.
pub fn map<T, U, F>(src: &[T], l: &Layout, f: F) -> Result<Vec<U>>
where
    T: Copy + Sync,
    U: bytemuck::Zeroable + Copy + Send + Sync,
    F: Fn(T) -> U + Sync + Send,
{
    let n = l.elem_count();
    if let Some((s, e)) = l.contiguous_range() {
        let src = &src[s..e];
        let mut out = alloc::with_capacity(n)?;
        if n >= PAR_MIN {
            // The room is reserved, so rayon writes in place without reallocating.
            out.par_extend(src.par_iter().map(|&x| f(x)));
        } else {
            out.extend(src.iter().map(|&x| f(x)));
        }
        return Ok(out);
    }
    let mut out = alloc::zeroed(n)?;
    par_fill(&mut out, |start, chunk| {
        for (o, off) in chunk.iter_mut().zip(l.offsets_from(start)) {
            *o = f(src[off]);
        }
    });
    Ok(out)
}

/// `f` applied to the pairs of elements `al` views in `a` and `bl` in `b` (same shape), row-major.
pub fn zip<A, B, U, F>(a: &[A], al: &Layout, b: &[B], bl: &Layout, f: F) -> Result<Vec<U>>
where
    A: Copy + Sync,
    B: Copy + Sync,
    U: bytemuck::Zeroable + Copy + Send + Sync,
    F: Fn(A, B) -> U + Sync + Send,
{
    let n = al.elem_count();
    let mut out = alloc::zeroed(n)?;
    match (al.contiguous_range(), bl.contiguous_range()) {
        (Some((sa, ea)), Some((sb, eb))) => {
            let (a, b) = (&a[sa..ea], &b[sb..eb]);
            par_fill(&mut out, |start, chunk| {
                let len = chunk.len();
                for ((o, &x), &y) in chunk.iter_mut().zip(&a[start..start + len]).zip(&b[start..start + len]) {
                    *o = f(x, y);
                }
            });
        }
        // A scalar broadcast against a contiguous tensor is the most common mixed case.
        (Some((sa, ea)), None) if bl.strides().iter().all(|&s| s == 0) => {
            let (a, y) = (&a[sa..ea], b[bl.offset()]);
            par_fill(&mut out, |start, chunk| {
                for (o, &x) in chunk.iter_mut().zip(&a[start..]) {
                    *o = f(x, y);
                }
            });
        }
        _ => par_fill(&mut out, |start, chunk| {
            for ((o, oa), ob) in chunk.iter_mut().zip(al.offsets_from(start)).zip(bl.offsets_from(start)) {
                *o = f(a[oa], b[ob]);
            }
        }),
    }
    Ok(out)
}

/// The storage offsets of a view as a vector, for kernels that index in arbitrary order.
pub fn offsets(l: &Layout) -> Result<Vec<usize>> {
    match l.contiguous_range() {
        Some((s, e)) => alloc::collect(s..e),
        None => alloc::collect(l.offsets()),
    }
}

/// A contiguous copy of a view.
pub fn gather_contiguous<T: Copy + Sync + Send + bytemuck::Zeroable>(src: &[T], l: &Layout) -> Result<Vec<T>> {
    match l.contiguous_range() {
        Some((s, e)) => {
            let mut v = alloc::with_capacity(e - s)?;
            v.extend_from_slice(&src[s..e]);
            Ok(v)
        }
        None => map(src, l, |x| x),
    }
}

/// A non-contiguous view as rows: `(w, stride)` when its elements are rows of `w` contiguous
/// elements, `stride` apart once its dims are merged (`Layout::merged_dims`), as a slice of a
/// larger contiguous tensor along any dim is; `None` for any other shape of view.
pub fn rows_of(l: &Layout) -> Option<(usize, usize)> {
    match l.merged_dims()[..] {
        [(w, 1), (_, stride)] if stride >= w => Some((w, stride)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::rows_of;
    use crate::{Layout, Shape};

    #[test]
    fn slices_along_any_dim_are_rows() {
        let out = Layout::contiguous(Shape::from(vec![4, 6, 5]));
        // Along the middle dim: 4 rows of 2 x 5 elements, 30 apart.
        assert_eq!(rows_of(&out.narrow(1, 3, 2).unwrap()), Some((10, 30)));
        assert_eq!(rows_of(&out.narrow(2, 1, 3).unwrap()), Some((3, 5)));
        // Along the first: one run (the contiguous case), not rows.
        assert_eq!(rows_of(&out.narrow(0, 1, 2).unwrap()), None);
        assert_eq!(rows_of(&out.permute(&[0, 2, 1]).unwrap()), None, "no unit stride innermost");
    }
}
