//! Ops with a neural-network flavour: dropout, and the structural ops cat/stack/chunk
//! and indexing (index_select, gather, embedding). The fused ones (softmax, layer norm, mse loss, cross
//! entropy) live in their folders under `src/fused/`.

use crate::backend::BackendStorage;
use crate::backprop::track;
use crate::cuda::error_flag::{reported_as, IndexOp};
use crate::op::Op;
use crate::rng::Rng;
use crate::{shape_err, DType, Dim, Error, Layout, Result, Tensor};

/// An index or index-dtype error of an inner op, renamed for the op the user called (a bad class
/// target should say `cross_entropy`, not `gather`).
fn renamed(e: Error, op: &'static str) -> Error {
    match e {
        Error::IndexOutOfRange { index, size, .. } => Error::IndexOutOfRange { op, index, size },
        Error::UnsupportedDType { dtype, .. } => Error::UnsupportedDType { op, dtype },
        e => e,
    }
}

impl Tensor {
    /// Inverted dropout (`F.dropout(x, p, training)`): when `train`, zero each element with
    /// probability `p` (in `[0, 1)`, else [`Error::InvalidArgument`]) and scale the rest by
    /// `1/(1-p)`; otherwise `self`. The mask comes from `rng`'s Philox stream (the same mask on
    /// every device). Float dtypes, differentiable.
    pub fn dropout_with(&self, rng: &mut Rng, p: f64, train: bool) -> Result<Tensor> {
        if !(0.0..1.0).contains(&p) {
            return Err(Error::InvalidArgument(format!("dropout probability {p} not in [0, 1)")));
        }
        if !train || p == 0.0 {
            return Ok(self.clone());
        }
        let u = Tensor::rand_with(rng, 0.0, 1.0, self.shape().clone(), DType::F32, self.device())?;
        let mask = u.ge(&u.scalar_like(p)?)?.to_dtype(self.dtype())?;
        self.mul(&mask)?.mul_scalar(1.0 / (1.0 - p))
    }

    /// [`Tensor::dropout_with`] drawing from the default generator ([`crate::manual_seed`]).
    pub fn dropout(&self, p: f64, train: bool) -> Result<Tensor> {
        crate::rng::with_global_rng(|r| self.dropout_with(r, p, train))
    }

    // ---- structure ----------------------------------------------------------------------------

    /// Concatenate along `dim` (`torch.cat`); all other dims, the dtype and the device must agree
    /// ([`Error::ShapeMismatch`], [`Error::DTypeMismatch`], [`Error::DeviceMismatch`]); an empty
    /// list is an [`Error::Shape`]. Differentiable (each input gets its slice of the
    /// gradient).
    pub fn cat<D: Dim>(tensors: &[Tensor], dim: D) -> Result<Tensor> {
        let first = tensors.first().ok_or_else(|| shape_err!("cat", "needs at least one tensor"))?;
        let d = dim.to_index(first.rank(), "cat")?;
        for t in tensors {
            first.check_cat(t, d)?;
        }
        if tensors.len() == 1 {
            return Ok(first.clone());
        }
        // Each input straight into its slice of the output (one pass over the bytes along any
        // dim; the output is allocated without a fill, every element being written).
        let mut dims = first.dims().to_vec();
        dims[d] = tensors.iter().try_fold(0usize, |acc, t| acc.checked_add(t.dims()[d])).unwrap_or(usize::MAX);
        let shape = crate::Shape::from(&dims);
        let n = shape.checked_elem_count("cat")?;
        let mut dst = crate::storage::Storage::for_overwrite(n, first.dtype(), first.device())?;
        let out = Layout::contiguous(shape);
        let mut offset = 0;
        for t in tensors {
            let k = t.dims()[d];
            t.storage().copy_into_view(t.layout(), &mut dst, &out.narrow(d, offset, k)?)?;
            offset += k;
        }
        let rec = track(&tensors.iter().collect::<Vec<_>>()).then(|| Op::Cat(tensors.to_vec(), d));
        Ok(Tensor::from_storage(dst, dims, rec))
    }

    fn check_cat(&self, t: &Tensor, d: usize) -> Result<()> {
        let same_rest =
            t.rank() == self.rank() && t.dims().iter().zip(self.dims()).enumerate().all(|(i, (a, b))| i == d || a == b);
        if !same_rest {
            return Err(Error::ShapeMismatch { op: "cat", lhs: self.dims().to_vec(), rhs: t.dims().to_vec() });
        }
        if t.dtype() != self.dtype() {
            return Err(Error::DTypeMismatch { op: "cat", lhs: self.dtype(), rhs: t.dtype() });
        }
        if t.device() != self.device() {
            return Err(Error::DeviceMismatch { op: "cat", lhs: self.device(), rhs: t.device() });
        }
        Ok(())
    }

    /// Stack equal-shaped tensors along a new dim `dim` (`torch.stack`); as [`Tensor::cat`].
    pub fn stack(tensors: &[Tensor], dim: isize) -> Result<Tensor> {
        let v = tensors.iter().map(|t| t.unsqueeze(dim)).collect::<Result<Vec<_>>>()?;
        let first = v.first().ok_or_else(|| shape_err!("stack", "needs at least one tensor"))?;
        let d = if dim < 0 { dim + first.rank() as isize } else { dim };
        Self::cat(&v, d as usize)
    }

    /// Split into `n` pieces along `dim` (the last may be smaller), as views (`torch.chunk`).
    pub fn chunk<D: Dim>(&self, n: usize, dim: D) -> Result<Vec<Tensor>> {
        let d = dim.to_index(self.rank(), "chunk")?;
        if n == 0 {
            return Err(Error::InvalidArgument("chunk: n must be positive".into()));
        }
        let size = self.dims()[d];
        let step = size.div_ceil(n).max(1);
        (0..size).step_by(step).map(|start| self.narrow(d, start, step.min(size - start))).collect()
    }

    // ---- indexing -----------------------------------------------------------------------------

    fn check_ids(ids: &Tensor, op: &'static str, device: crate::Device) -> Result<()> {
        if ids.dtype().is_float() {
            return Err(Error::UnsupportedDType { op, dtype: ids.dtype() });
        }
        if ids.device() != device {
            return Err(Error::DeviceMismatch { op, lhs: device, rhs: ids.device() });
        }
        Ok(())
    }

    /// Slices along `dim` picked by a 1-D integer index tensor (`torch.index_select`): the result
    /// has `ids.len()` in place of that dim. An index out of range is [`Error::IndexOutOfRange`]
    /// (on CUDA reported at the next host read). Differentiable in `self`.
    pub fn index_select<D: Dim>(&self, ids: &Tensor, dim: D) -> Result<Tensor> {
        let d = dim.to_index(self.rank(), "index_select")?;
        Self::check_ids(ids, "index_select", self.device())?;
        if ids.rank() != 1 {
            return Err(shape_err!("index_select", "indices must be 1-D, got shape {:?}", ids.dims()));
        }
        let mut dims = self.dims().to_vec();
        dims[d] = ids.elem_count();
        crate::Shape::from(&dims).checked_elem_count("index_select")?;
        let s = self.storage().index_select(self.layout(), &ids.storage(), ids.layout(), d)?;
        Ok(Tensor::from_storage(s, dims, track(&[self]).then(|| Op::IndexSelect(self.clone(), ids.detach(), d))))
    }

    /// Writes the slices of `src` into this tensor at the positions `ids` select along `dim`, in
    /// place (`torch.index_copy_`): `self[.., ids[j], ..] = src[.., j, ..]`. `self` must be
    /// contiguous (a view of a larger buffer is fine); `src` has `self`'s shape with `ids.len()` at
    /// `dim`. A bad id is [`Error::IndexOutOfRange`] (on CUDA at the next host read, with nothing
    /// written for it); ids that repeat leave one of their slices. Not recorded by autograd (as
    /// [`Tensor::set`]). The ids stay on the device, so a CUDA graph can capture the write and
    /// replay it at positions that change between replays (a decode step's KV cache).
    pub fn index_copy_<D: Dim>(&self, dim: D, ids: &Tensor, src: &Tensor) -> Result<()> {
        let d = dim.to_index(self.rank(), "index_copy_")?;
        Self::check_ids(ids, "index_copy_", self.device())?;
        if ids.rank() != 1 {
            return Err(shape_err!("index_copy_", "indices must be 1-D, got shape {:?}", ids.dims()));
        }
        self.check_same_dtype(src, "index_copy_")?;
        if src.device() != self.device() {
            return Err(Error::DeviceMismatch { op: "index_copy_", lhs: self.device(), rhs: src.device() });
        }
        if !self.is_contiguous() {
            return Err(shape_err!("index_copy_", "destination must be contiguous"));
        }
        // Both would be read while the destination is locked for writing.
        if self.same_storage(src) || self.same_storage(ids) {
            return Err(shape_err!("index_copy_", "the source or the ids share the destination's storage"));
        }
        let s = src.storage();
        let i = ids.storage();
        s.index_copy_into(src.layout(), &i, ids.layout(), &mut self.storage_mut(), self.layout(), d)
    }

    /// Rows of this `[V, D]` table for integer indices of any shape: output `ids.shape + [D]`
    /// (`F.embedding(ids, table)`). Differentiable in the table.
    pub fn embedding(&self, ids: &Tensor) -> Result<Tensor> {
        if self.rank() != 2 {
            return Err(shape_err!("embedding", "table must be [V, D], got {:?}", self.dims()));
        }
        let mut dims = ids.dims().to_vec();
        dims.push(self.dims()[1]);
        let flat = ids.flatten_all()?;
        // A bad id says `embedding`: at once on the CPU (renamed), at the next read on CUDA.
        reported_as(IndexOp::Embedding, || self.index_select(&flat, 0))
            .map_err(|e| renamed(e, "embedding"))?
            .reshape(dims)
    }

    /// PyTorch's gather (`torch.gather(self, dim, ids)`): `out[i][j] = self[i][ids[i][j]]` for dim
    /// 1; output has the index shape. Differentiable in `self`.
    pub fn gather<D: Dim>(&self, dim: D, ids: &Tensor) -> Result<Tensor> {
        let d = dim.to_index(self.rank(), "gather")?;
        Self::check_ids(ids, "gather", self.device())?;
        let s = self.storage().gather(self.layout(), &ids.storage(), ids.layout(), d)?;
        Ok(Tensor::from_storage(
            s,
            ids.shape().clone(),
            track(&[self]).then(|| Op::Gather(self.clone(), ids.detach(), d)),
        ))
    }

    /// `self` with `src` added at the slices `ids` select along `dim` (`torch.index_add`; not
    /// differentiable).
    pub fn index_add<D: Dim>(&self, ids: &Tensor, src: &Tensor, dim: D) -> Result<Tensor> {
        let d = dim.to_index(self.rank(), "index_add")?;
        Self::check_ids(ids, "index_add", self.device())?;
        self.check_same_dtype(src, "index_add")?;
        let s =
            self.storage().index_add(self.layout(), &ids.storage(), ids.layout(), &src.storage(), src.layout(), d)?;
        Ok(Tensor::from_storage(s, self.shape().clone(), None))
    }

    /// `self` with `src[i][j]` added at `[i][ids[i][j]]` for dim 1 (`torch.scatter_add`; not
    /// differentiable).
    pub fn scatter_add<D: Dim>(&self, dim: D, ids: &Tensor, src: &Tensor) -> Result<Tensor> {
        let d = dim.to_index(self.rank(), "scatter_add")?;
        Self::check_ids(ids, "scatter_add", self.device())?;
        self.check_same_dtype(src, "scatter_add")?;
        let s =
            self.storage().scatter_add(self.layout(), &ids.storage(), ids.layout(), &src.storage(), src.layout(), d)?;
        Ok(Tensor::from_storage(s, self.shape().clone(), None))
    }

    fn check_same_dtype(&self, o: &Tensor, op: &'static str) -> Result<()> {
        if self.dtype() != o.dtype() {
            return Err(Error::DTypeMismatch { op, lhs: self.dtype(), rhs: o.dtype() });
        }
        Ok(())
    }
}
