//! Elementwise loops over strided views, parallel with rayon once a tensor is large enough to pay
//! for the threads. Contiguous inputs take a slice fast path that the compiler can vectorise.

use crate::Layout;
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

pub fn map<T, U, F>(src: &[T], l: &Layout, f: F) -> Vec<U>
where
    T: Copy + Sync,
    U: bytemuck::Zeroable + Copy + Send + Sync,
    F: Fn(T) -> U + Sync + Send,
{
    let n = l.elem_count();
    if let Some((s, e)) = l.contiguous_range() {
        let src = &src[s..e];
        if n >= PAR_MIN {
            return src.par_iter().map(|&x| f(x)).collect();
        }
        return src.iter().map(|&x| f(x)).collect();
    }
    let mut out = vec![U::zeroed(); n];
    par_fill(&mut out, |start, chunk| {
        for (o, off) in chunk.iter_mut().zip(l.offsets_from(start)) {
            *o = f(src[off]);
        }
    });
    out
}

pub fn zip<A, B, U, F>(a: &[A], al: &Layout, b: &[B], bl: &Layout, f: F) -> Vec<U>
where
    A: Copy + Sync,
    B: Copy + Sync,
    U: bytemuck::Zeroable + Copy + Send + Sync,
    F: Fn(A, B) -> U + Sync + Send,
{
    let n = al.elem_count();
    let mut out = vec![U::zeroed(); n];
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
    out
}

/// The storage offsets of a view as a vector, for kernels that index in arbitrary order.
pub fn offsets(l: &Layout) -> Vec<usize> {
    match l.contiguous_range() {
        Some((s, e)) => (s..e).collect(),
        None => l.offsets().collect(),
    }
}

/// A contiguous copy of a view.
pub fn gather_contiguous<T: Copy + Sync + Send + bytemuck::Zeroable>(src: &[T], l: &Layout) -> Vec<T> {
    match l.contiguous_range() {
        Some((s, e)) => src[s..e].to_vec(),
        None => map(src, l, |x| x),
    }
}
