//! Shapes, dimension indices (negative counts from the end) and NumPy broadcasting.

use crate::{Error, Result};

/// The most elements a tensor may hold: `MAX_ELEMS * 8` bytes (f64, the widest dtype) fit in an
/// `isize`, so every element, byte and offset count derived from a checked shape is exact and no
/// later arithmetic on it can wrap. Every constructor and every view that can grow a tensor
/// (reshape, broadcast, cat, matmul, index_select) checks its shape against it.
pub const MAX_ELEMS: usize = isize::MAX as usize / 8;

/// The sizes of a tensor's dims, outermost first. Converts from `()`, `usize`, tuples of up to
/// several `usize`, `Vec<usize>` and `&[usize]`, so constructors take `(2, 3)` or `vec![2, 3]`.
#[derive(Clone, PartialEq, Eq, Hash, Default)]
pub struct Shape(Vec<usize>);

impl std::fmt::Debug for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

impl Shape {
    /// The sizes as a slice.
    pub fn dims(&self) -> &[usize] {
        &self.0
    }
    /// The number of dims.
    pub fn rank(&self) -> usize {
        self.0.len()
    }
    /// The product of the dims. It saturates at `usize::MAX` instead of wrapping, so an unchecked
    /// huge shape can never pass for a small one; tensors only ever hold shapes that passed
    /// [`checked_elem_count`](Self::checked_elem_count), for which this is exact.
    pub fn elem_count(&self) -> usize {
        if self.0.contains(&0) {
            return 0;
        }
        self.0.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)).unwrap_or(usize::MAX)
    }

    /// The element count, or a typed error naming `op` and the shape when it exceeds
    /// [`MAX_ELEMS`] (or `usize` altogether).
    pub fn checked_elem_count(&self, op: &'static str) -> Result<usize> {
        let n = if self.0.contains(&0) { Some(0) } else { self.0.iter().try_fold(1usize, |a, &d| a.checked_mul(d)) };
        match n {
            Some(n) if n <= MAX_ELEMS => Ok(n),
            Some(n) => Err(Error::SizeOverflow {
                op,
                shape: self.0.clone(),
                why: format!("{n} elements, more than a tensor may hold ({MAX_ELEMS})"),
            }),
            None => {
                Err(Error::SizeOverflow { op, shape: self.0.clone(), why: "the element count overflows usize".into() })
            }
        }
    }
    /// The sizes as a vector.
    pub fn to_vec(&self) -> Vec<usize> {
        self.0.clone()
    }
    /// Row-major strides of a contiguous tensor of this shape.
    pub fn contiguous_strides(&self) -> Vec<usize> {
        let mut strides = vec![0; self.rank()];
        let mut acc = 1usize;
        for (s, &d) in strides.iter_mut().zip(&self.0).rev() {
            *s = acc;
            // Saturating: only the outermost product can exceed a checked shape's count.
            acc = acc.saturating_mul(d);
        }
        strides
    }

    /// The shape both operands broadcast to, NumPy rules: align right, sizes equal or 1.
    pub fn broadcast_with(&self, rhs: &Shape, op: &'static str) -> Result<Shape> {
        let (a, b) = (self.dims(), rhs.dims());
        let rank = a.len().max(b.len());
        let mut out = vec![0; rank];
        for i in 0..rank {
            let da = if i + a.len() >= rank { a[i + a.len() - rank] } else { 1 };
            let db = if i + b.len() >= rank { b[i + b.len() - rank] } else { 1 };
            out[i] = match (da, db) {
                (x, y) if x == y => x,
                (1, y) => y,
                (x, 1) => x,
                _ => return Err(Error::ShapeMismatch { op, lhs: a.to_vec(), rhs: b.to_vec() }),
            };
        }
        Ok(Shape(out))
    }
}

impl From<Vec<usize>> for Shape {
    fn from(v: Vec<usize>) -> Self {
        Shape(v)
    }
}
impl From<&[usize]> for Shape {
    fn from(v: &[usize]) -> Self {
        Shape(v.to_vec())
    }
}
impl<const N: usize> From<[usize; N]> for Shape {
    fn from(v: [usize; N]) -> Self {
        Shape(v.to_vec())
    }
}
impl<const N: usize> From<&[usize; N]> for Shape {
    fn from(v: &[usize; N]) -> Self {
        Shape(v.to_vec())
    }
}
impl From<&Shape> for Shape {
    fn from(v: &Shape) -> Self {
        v.clone()
    }
}
impl From<&Vec<usize>> for Shape {
    fn from(v: &Vec<usize>) -> Self {
        Shape(v.clone())
    }
}
impl From<()> for Shape {
    fn from(_: ()) -> Self {
        Shape(vec![])
    }
}
impl From<usize> for Shape {
    fn from(d: usize) -> Self {
        Shape(vec![d])
    }
}

/// A dimension index: `usize` counts from the front, a negative `i32`/`isize` from the back.
pub trait Dim: Copy {
    /// The index in `0..rank`, or [`Error::DimOutOfRange`] naming `op`.
    fn to_index(self, rank: usize, op: &'static str) -> Result<usize>;
}

impl Dim for usize {
    fn to_index(self, rank: usize, op: &'static str) -> Result<usize> {
        if self < rank {
            Ok(self)
        } else {
            Err(Error::DimOutOfRange { op, dim: self as isize, rank })
        }
    }
}

impl Dim for isize {
    fn to_index(self, rank: usize, op: &'static str) -> Result<usize> {
        let r = rank as isize;
        let d = if self < 0 { self + r } else { self };
        if (0..r).contains(&d) {
            Ok(d as usize)
        } else {
            Err(Error::DimOutOfRange { op, dim: self, rank })
        }
    }
}

impl Dim for i32 {
    fn to_index(self, rank: usize, op: &'static str) -> Result<usize> {
        (self as isize).to_index(rank, op)
    }
}

/// A set of dims for reductions.
pub trait Dims {
    /// The indexes in `0..rank`, or [`Error::DimOutOfRange`] naming `op`.
    fn to_indexes(&self, rank: usize, op: &'static str) -> Result<Vec<usize>>;
}

impl<D: Dim> Dims for D {
    fn to_indexes(&self, rank: usize, op: &'static str) -> Result<Vec<usize>> {
        Ok(vec![self.to_index(rank, op)?])
    }
}

impl<D: Dim> Dims for [D] {
    fn to_indexes(&self, rank: usize, op: &'static str) -> Result<Vec<usize>> {
        let mut out = Vec::with_capacity(self.len());
        for d in self {
            let i = d.to_index(rank, op)?;
            if out.contains(&i) {
                return Err(crate::shape_err!(op, "dim {i} given twice"));
            }
            out.push(i);
        }
        out.sort_unstable();
        Ok(out)
    }
}

impl<D: Dim, const N: usize> Dims for [D; N] {
    fn to_indexes(&self, rank: usize, op: &'static str) -> Result<Vec<usize>> {
        self.as_slice().to_indexes(rank, op)
    }
}

impl<D: Dim> Dims for Vec<D> {
    fn to_indexes(&self, rank: usize, op: &'static str) -> Result<Vec<usize>> {
        self.as_slice().to_indexes(rank, op)
    }
}

/// All dims of a tensor, for full reductions.
#[derive(Clone, Copy, Debug)]
pub struct AllDims;

impl Dims for AllDims {
    fn to_indexes(&self, rank: usize, _op: &'static str) -> Result<Vec<usize>> {
        Ok((0..rank).collect())
    }
}

macro_rules! shape_from_tuple {
    ($($n:ident),+) => {
        impl From<($(shape_from_tuple!(@usize $n),)+)> for Shape {
            #[allow(non_snake_case)]
            fn from(($($n,)+): ($(shape_from_tuple!(@usize $n),)+)) -> Self {
                Shape(vec![$($n),+])
            }
        }
    };
    (@usize $n:ident) => { usize };
}
shape_from_tuple!(A);
shape_from_tuple!(A, B);
shape_from_tuple!(A, B, C);
shape_from_tuple!(A, B, C, D);
shape_from_tuple!(A, B, C, D, E);
shape_from_tuple!(A, B, C, D, E, F);
