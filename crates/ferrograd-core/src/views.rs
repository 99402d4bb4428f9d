//! Views: reshape, transpose, permute, narrow, squeeze/unsqueeze, broadcast. They share storage
//! and only build a new layout; a reshape of a non-contiguous tensor copies once.

use crate::backend::BackendStorage;
use crate::backprop::track;
use crate::op::Op;
use crate::{shape_err, Dim, Error, Result, Shape, Tensor};

impl Tensor {
    /// The same elements in `shape` (`t.reshape(shape)`): a view when the layout allows it, one
    /// copy otherwise. Errors with [`Error::ShapeMismatch`] when the element counts differ. Any dtype,
    /// any device, differentiable.
    pub fn reshape<S: Into<Shape>>(&self, shape: S) -> Result<Tensor> {
        let shape = shape.into();
        if shape.checked_elem_count("reshape")? != self.elem_count() {
            return Err(Error::ShapeMismatch { op: "reshape", lhs: self.dims().to_vec(), rhs: shape.to_vec() });
        }
        if shape == *self.shape() {
            return Ok(self.clone());
        }
        match self.layout().reshape_view(&shape) {
            Some(l) => Ok(self.view(l, track(&[self]).then(|| Op::Reshape(self.clone())))),
            None => self.contiguous()?.reshape(shape),
        }
    }

    /// Flatten to one dim.
    pub fn flatten_all(&self) -> Result<Tensor> {
        self.reshape(self.elem_count())
    }

    /// Merge dims `start..=end` into one.
    pub fn flatten<D1: Dim, D2: Dim>(&self, start: D1, end: D2) -> Result<Tensor> {
        if self.rank() == 0 {
            return self.reshape(1);
        }
        let (s, e) = (start.to_index(self.rank(), "flatten")?, end.to_index(self.rank(), "flatten")?);
        if s > e {
            return Err(shape_err!("flatten", "start dim {s} after end dim {e}"));
        }
        let d = self.dims();
        let mut dims = d[..s].to_vec();
        dims.push(d[s..=e].iter().product());
        dims.extend_from_slice(&d[e + 1..]);
        self.reshape(dims)
    }

    /// Reorder the dims (`t.permute(perm)`): dim `i` of the result is dim `perm[i]` of `self`. A view;
    /// errors when `perm` is not a permutation of `0..rank`.
    pub fn permute(&self, perm: &[usize]) -> Result<Tensor> {
        let l = self.layout().permute(perm)?;
        if perm.iter().enumerate().all(|(i, &p)| i == p) {
            return Ok(self.clone());
        }
        Ok(self.view(l, track(&[self]).then(|| Op::Permute(self.clone(), perm.to_vec()))))
    }

    /// Swap dims `d0` and `d1` (`t.transpose(d0, d1)`), a view; negative dims count from the end.
    pub fn transpose<D1: Dim, D2: Dim>(&self, d0: D1, d1: D2) -> Result<Tensor> {
        let (a, b) = (d0.to_index(self.rank(), "transpose")?, d1.to_index(self.rank(), "transpose")?);
        let mut perm: Vec<usize> = (0..self.rank()).collect();
        perm.swap(a, b);
        self.permute(&perm)
    }

    /// Swap the last two dims.
    pub fn t(&self) -> Result<Tensor> {
        if self.rank() < 2 {
            return Err(shape_err!("t", "needs rank >= 2, got shape {:?}", self.dims()));
        }
        self.transpose(-2, -1)
    }

    /// Elements `start..start + len` of dimension `dim` (`t.narrow(dim, start, len)`), a view;
    /// errors with [`Error::Shape`] when the range passes the dim's size.
    pub fn narrow<D: Dim>(&self, dim: D, start: usize, len: usize) -> Result<Tensor> {
        let d = dim.to_index(self.rank(), "narrow")?;
        if start == 0 && len == self.dims()[d] {
            return Ok(self.clone());
        }
        let l = self.layout().narrow(d, start, len)?;
        Ok(self.view(l, track(&[self]).then(|| Op::Narrow(self.clone(), d, start))))
    }

    /// Remove `dim` if its size is 1 (otherwise a no-op, as in PyTorch).
    pub fn squeeze<D: Dim>(&self, dim: D) -> Result<Tensor> {
        let d = dim.to_index(self.rank(), "squeeze")?;
        if self.dims()[d] != 1 {
            return Ok(self.clone());
        }
        let mut dims = self.dims().to_vec();
        dims.remove(d);
        self.reshape(dims)
    }

    /// Insert a size-1 dim at `dim` (`0..=rank`; negative counts from the end, -1 appends).
    pub fn unsqueeze(&self, dim: isize) -> Result<Tensor> {
        let r = self.rank() as isize;
        let d = if dim < 0 { dim + r + 1 } else { dim };
        if !(0..=r).contains(&d) {
            return Err(Error::DimOutOfRange { op: "unsqueeze", dim, rank: self.rank() });
        }
        let mut dims = self.dims().to_vec();
        dims.insert(d as usize, 1);
        self.reshape(dims)
    }

    /// A view of `shape` that repeats size-1 (or missing leading) dims without copying
    /// (`t.expand(shape)`); errors with [`Error::Broadcast`]. Its gradient sums over the repeated dims.
    pub fn broadcast_as<S: Into<Shape>>(&self, shape: S) -> Result<Tensor> {
        let shape = shape.into();
        if shape == *self.shape() {
            return Ok(self.clone());
        }
        let l = self.layout().broadcast_as(&shape)?;
        Ok(self.view(l, track(&[self]).then(|| Op::Broadcast(self.clone()))))
    }

    /// PyTorch's name for `broadcast_as`.
    pub fn expand<S: Into<Shape>>(&self, shape: S) -> Result<Tensor> {
        self.broadcast_as(shape)
    }

    /// The same values in a fresh row-major buffer (or `self` when already contiguous).
    pub fn contiguous(&self) -> Result<Tensor> {
        if self.is_contiguous() {
            return Ok(self.clone());
        }
        let s = self.storage().copy_strided(self.layout())?;
        Ok(Tensor::from_storage(s, self.shape().clone(), track(&[self]).then(|| Op::Copy(self.clone()))))
    }
}
