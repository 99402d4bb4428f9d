//! How a tensor's elements sit in its storage: shape, strides (in elements) and a start offset.
//! Views (transpose, permute, narrow, broadcast, squeeze/unsqueeze) only rewrite the layout.
//! A broadcast dim has stride 0.

use crate::{shape_err, Error, Result, Shape};

/// Shape, strides (in elements) and start offset of a tensor's view of its storage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    shape: Shape,
    strides: Vec<usize>,
    offset: usize,
}

impl Layout {
    /// A row-major layout of `shape` at offset 0.
    pub fn contiguous<S: Into<Shape>>(shape: S) -> Self {
        Self::contiguous_with_offset(shape, 0)
    }
    /// A row-major layout of `shape` starting at element `offset`.
    pub fn contiguous_with_offset<S: Into<Shape>>(shape: S, offset: usize) -> Self {
        let shape = shape.into();
        let strides = shape.contiguous_strides();
        Layout { shape, strides, offset }
    }
    /// A layout as given. Nothing is checked here (internal uses build sub-views of valid
    /// layouts); tensors only ever hold layouts their storage covers (`required_len`).
    pub fn new(shape: Shape, strides: Vec<usize>, offset: usize) -> Self {
        Layout { shape, strides, offset }
    }
    /// The shape.
    pub fn shape(&self) -> &Shape {
        &self.shape
    }
    /// The sizes of the dims.
    pub fn dims(&self) -> &[usize] {
        self.shape.dims()
    }
    /// Element strides per dim (0 for a broadcast dim).
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }
    /// Index of the first element in the storage.
    pub fn offset(&self) -> usize {
        self.offset
    }
    /// Number of elements viewed.
    pub fn elem_count(&self) -> usize {
        self.shape.elem_count()
    }

    /// Row-major contiguous (size-1 dims may carry any stride).
    pub fn is_contiguous(&self) -> bool {
        let mut acc = 1usize;
        for (&d, &s) in self.dims().iter().zip(&self.strides).rev() {
            if d != 1 && s != acc {
                return false;
            }
            acc = acc.saturating_mul(d);
        }
        true
    }

    /// How many elements of storage this view reaches: one past its largest offset (`offset +
    /// sum((d - 1) * stride) + 1`), 0 for an empty view; `None` when that overflows. A tensor's
    /// storage always holds at least this many elements (debug-asserted on every constructor and
    /// view in `tensor.rs`).
    pub fn required_len(&self) -> Option<usize> {
        if self.dims().contains(&0) {
            return Some(0);
        }
        let mut last = self.offset;
        for (&d, &s) in self.dims().iter().zip(&self.strides) {
            last = last.checked_add((d - 1).checked_mul(s)?)?;
        }
        last.checked_add(1)
    }

    /// `Some((start, end))` when the elements are one contiguous run of storage.
    /// An empty view is the empty run `(0, 0)`: its offset may lie past the end of its storage
    /// (`narrow(d, size, 0)`), and slicing there would panic.
    pub fn contiguous_range(&self) -> Option<(usize, usize)> {
        match self.elem_count() {
            0 => Some((0, 0)),
            n => self.is_contiguous().then(|| (self.offset, self.offset + n)),
        }
    }

    /// The view's (dim, stride) pairs from the innermost out, size-1 dims dropped and each dim
    /// merged into the next inner one where it steps exactly over it (stride = inner stride x
    /// inner dim): the fewest dims that walk the same elements in the same order (what the CUDA
    /// kernels take, `KLayout::new`, and how the CPU finds rows, `strided::rows_of`).
    pub fn merged_dims(&self) -> Vec<(usize, usize)> {
        let mut merged: Vec<(usize, usize)> = vec![];
        for (&d, &s) in self.dims().iter().zip(self.strides()).rev() {
            if d == 1 {
                continue;
            }
            match merged.last_mut() {
                Some((id, is)) if s == *is * *id => *id *= d,
                _ => merged.push((d, s)),
            }
        }
        merged
    }

    /// The layout with dims `d0` and `d1` swapped.
    pub fn transpose(&self, d0: usize, d1: usize) -> Result<Layout> {
        let mut perm: Vec<usize> = (0..self.shape.rank()).collect();
        if d0 >= perm.len() || d1 >= perm.len() {
            let dim = d0.max(d1) as isize;
            return Err(Error::DimOutOfRange { op: "transpose", dim, rank: perm.len() });
        }
        perm.swap(d0, d1);
        self.permute(&perm)
    }

    /// The layout with dims reordered (`perm[i]` becomes dim `i`); errors unless `perm` is a
    /// permutation of `0..rank`.
    pub fn permute(&self, perm: &[usize]) -> Result<Layout> {
        let rank = self.shape.rank();
        let mut seen = vec![false; rank];
        if perm.len() != rank {
            return Err(shape_err!("permute", "{perm:?} is not a permutation of {rank} dims"));
        }
        for &p in perm {
            if p >= rank || seen[p] {
                return Err(shape_err!("permute", "{perm:?} is not a permutation of {rank} dims"));
            }
            seen[p] = true;
        }
        let dims = perm.iter().map(|&p| self.dims()[p]).collect::<Vec<_>>();
        let strides = perm.iter().map(|&p| self.strides[p]).collect();
        Ok(Layout { shape: dims.into(), strides, offset: self.offset })
    }

    /// The layout of elements `start..start + len` of `dim`; errors when out of range.
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> Result<Layout> {
        let size = *self.dims().get(dim).ok_or(Error::DimOutOfRange {
            op: "narrow",
            dim: dim as isize,
            rank: self.dims().len(),
        })?;
        let end = start.checked_add(len);
        if end.is_none_or(|end| end > size) {
            // `start + len` may overflow usize: format the end only when it exists, never panic.
            let range = end.map_or_else(|| format!("{start} + {len} (overflows)"), |end| format!("{start}..{end}"));
            return Err(shape_err!("narrow", "range {range} out of bounds for dim {dim} of size {size}"));
        }
        let mut dims = self.shape.to_vec();
        dims[dim] = len;
        // In range for any view its storage covers; checked for layouts built by hand.
        let offset = start
            .checked_mul(self.strides[dim])
            .and_then(|o| o.checked_add(self.offset))
            .ok_or_else(|| shape_err!("narrow", "offset of element {start} of dim {dim} overflows"))?;
        Ok(Layout { shape: dims.into(), strides: self.strides.clone(), offset })
    }

    /// Broadcast to `shape` (NumPy rules): new leading dims and size-1 dims get stride 0. The
    /// target's element count is checked: a broadcast is how a small tensor gets a huge shape.
    pub fn broadcast_as(&self, shape: &Shape) -> Result<Layout> {
        shape.checked_elem_count("broadcast")?;
        let (src, dst) = (self.dims(), shape.dims());
        let err = || Error::Broadcast { from: src.to_vec(), to: dst.to_vec() };
        if dst.len() < src.len() {
            return Err(err());
        }
        let lead = dst.len() - src.len();
        let mut strides = vec![0; dst.len()];
        for (i, &d) in dst.iter().enumerate() {
            if i < lead {
                continue;
            }
            let s = src[i - lead];
            strides[i] = if s == d {
                self.strides[i - lead]
            } else if s == 1 {
                0
            } else {
                return Err(err());
            };
        }
        Ok(Layout { shape: shape.clone(), strides, offset: self.offset })
    }

    /// A view of `shape` when no copy is needed: contiguous input, or only size-1 dims added/removed.
    pub fn reshape_view(&self, shape: &Shape) -> Option<Layout> {
        if self.is_contiguous() {
            return Some(Layout::contiguous_with_offset(shape.clone(), self.offset));
        }
        let (keep_src, keep_dst): (Vec<_>, Vec<_>) = (
            self.dims().iter().zip(&self.strides).filter(|(&d, _)| d != 1).map(|(&d, &s)| (d, s)).collect(),
            shape.dims().iter().filter(|&&d| d != 1).copied().collect(),
        );
        if keep_src.iter().map(|(d, _)| *d).ne(keep_dst.iter().copied()) {
            return None;
        }
        let mut it = keep_src.iter();
        let strides = shape.dims().iter().map(|&d| if d == 1 { 0 } else { it.next().map_or(0, |(_, s)| *s) }).collect();
        Some(Layout { shape: shape.clone(), strides, offset: self.offset })
    }

    /// Storage offsets of every element, in row-major order of the logical shape.
    pub fn offsets(&self) -> StridedOffsets<'_> {
        StridedOffsets::new(self, 0)
    }

    /// Offsets starting from logical element `start`.
    pub fn offsets_from(&self, start: usize) -> StridedOffsets<'_> {
        StridedOffsets::new(self, start)
    }
}

/// Iterator over storage offsets in logical row-major order; O(1) amortized per element.
pub struct StridedOffsets<'a> {
    dims: &'a [usize],
    strides: &'a [usize],
    index: Vec<usize>,
    next: Option<usize>,
    remaining: usize,
}

impl<'a> StridedOffsets<'a> {
    fn new(l: &'a Layout, start: usize) -> Self {
        let total = l.elem_count();
        let mut index = vec![0; l.dims().len()];
        let mut rem = start;
        let mut off = l.offset;
        for i in (0..index.len()).rev() {
            let d = l.dims()[i];
            if d > 0 {
                index[i] = rem % d;
                rem /= d;
                off += index[i] * l.strides[i];
            }
        }
        let remaining = total.saturating_sub(start);
        StridedOffsets { dims: l.dims(), strides: &l.strides, index, next: (remaining > 0).then_some(off), remaining }
    }
}

impl Iterator for StridedOffsets<'_> {
    type Item = usize;
    #[inline]
    fn next(&mut self) -> Option<usize> {
        let cur = self.next?;
        self.remaining -= 1;
        if self.remaining == 0 {
            self.next = None;
            return Some(cur);
        }
        let mut off = cur;
        for i in (0..self.dims.len()).rev() {
            self.index[i] += 1;
            off += self.strides[i];
            if self.index[i] < self.dims[i] {
                self.next = Some(off);
                return Some(cur);
            }
            off -= self.index[i] * self.strides[i];
            self.index[i] = 0;
        }
        self.next = None;
        Some(cur)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.remaining, Some(self.remaining))
    }
}

impl ExactSizeIterator for StridedOffsets<'_> {}
