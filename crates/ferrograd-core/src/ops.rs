//! Elementwise maps with NumPy broadcasting, comparisons, reductions, casts and matmul.

use crate::backend::{BackendStorage, MatmulDims};
use crate::backprop::track;
use crate::op::{ArgReduceOp, BinaryOp, CmpOp, Op, ReduceOp, UnaryOp};
use crate::{shape_err, DType, Dims, Error, Result, Shape, Tensor};

macro_rules! unary_fns {
    ($($name:ident => $op:expr),* $(,)?) => {
        $(pub fn $name(&self) -> Result<Tensor> { self.unary_op($op) })*
    };
}

macro_rules! binary_fns {
    ($($name:ident => $op:expr),* $(,)?) => {
        $(pub fn $name(&self, rhs: &Tensor) -> Result<Tensor> { self.binary_op(rhs, $op) })*
    };
}

macro_rules! cmp_fns {
    ($($name:ident => $op:expr),* $(,)?) => {
        $(
            /// Elementwise comparison with broadcasting; the result is u8 (0 or 1).
            pub fn $name(&self, rhs: &Tensor) -> Result<Tensor> { self.cmp_op(rhs, $op) }
        )*
    };
}

impl Tensor {
    pub(crate) fn unary_op(&self, op: UnaryOp) -> Result<Tensor> {
        let s = self.storage().unary(self.layout(), op)?;
        Ok(Tensor::from_storage(s, self.shape().clone(), track(&[self]).then(|| Op::Unary(self.clone(), op))))
    }

    unary_fns! {
        neg => UnaryOp::Neg, abs => UnaryOp::Abs, sqr => UnaryOp::Sqr, sign => UnaryOp::Sign,
        relu => UnaryOp::Relu, exp => UnaryOp::Exp, log => UnaryOp::Log, sqrt => UnaryOp::Sqrt,
        rsqrt => UnaryOp::Rsqrt, recip => UnaryOp::Recip, tanh => UnaryOp::Tanh,
        sigmoid => UnaryOp::Sigmoid, silu => UnaryOp::Silu, sin => UnaryOp::Sin, cos => UnaryOp::Cos,
        gelu_tanh => UnaryOp::GeluTanh,
    }

    /// GELU, exact (erf) form: PyTorch's default.
    pub fn gelu(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::GeluErf)
    }

    /// `self * mul + add`
    pub fn affine(&self, mul: f64, add: f64) -> Result<Tensor> {
        self.unary_op(UnaryOp::Affine { mul, add })
    }
    pub fn add_scalar(&self, v: f64) -> Result<Tensor> {
        self.affine(1.0, v)
    }
    pub fn mul_scalar(&self, v: f64) -> Result<Tensor> {
        self.affine(v, 0.0)
    }
    pub fn powf(&self, e: f64) -> Result<Tensor> {
        self.unary_op(UnaryOp::Powf(e))
    }
    pub fn clamp(&self, min: f64, max: f64) -> Result<Tensor> {
        if min > max || min.is_nan() || max.is_nan() {
            return Err(Error::InvalidArgument(format!("clamp: min {min} > max {max}")));
        }
        self.unary_op(UnaryOp::Clamp { min, max })
    }

    fn check_same(&self, rhs: &Tensor, op: &'static str) -> Result<()> {
        if self.dtype() != rhs.dtype() {
            return Err(Error::DTypeMismatch { op, lhs: self.dtype(), rhs: rhs.dtype() });
        }
        if self.device() != rhs.device() {
            return Err(Error::DeviceMismatch { op, lhs: self.device(), rhs: rhs.device() });
        }
        Ok(())
    }

    /// Both operands broadcast to their common shape.
    pub fn broadcast_pair(&self, rhs: &Tensor, op: &'static str) -> Result<(Tensor, Tensor)> {
        let shape = self.shape().broadcast_with(rhs.shape(), op)?;
        Ok((self.broadcast_as(shape.clone())?, rhs.broadcast_as(shape)?))
    }

    pub(crate) fn binary_op(&self, rhs: &Tensor, op: BinaryOp) -> Result<Tensor> {
        self.check_same(rhs, op.name())?;
        let (a, b) = self.broadcast_pair(rhs, op.name())?;
        let s = a.storage().binary(a.layout(), &b.storage(), b.layout(), op)?;
        let rec = track(&[&a, &b]).then(|| Op::Binary(a.clone(), b.clone(), op));
        Ok(Tensor::from_storage(s, a.shape().clone(), rec))
    }

    binary_fns! {
        add => BinaryOp::Add, sub => BinaryOp::Sub, mul => BinaryOp::Mul, div => BinaryOp::Div,
        maximum => BinaryOp::Maximum, minimum => BinaryOp::Minimum,
    }

    /// Floored remainder with broadcasting (`torch.remainder`); its gradient is 1 for `self` and
    /// `-floor(self / rhs)` for `rhs`.
    pub fn remainder(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary_op(rhs, BinaryOp::Rem)
    }

    pub(crate) fn cmp_op(&self, rhs: &Tensor, op: CmpOp) -> Result<Tensor> {
        self.check_same(rhs, "cmp")?;
        let (a, b) = self.broadcast_pair(rhs, "cmp")?;
        let s = a.storage().cmp(a.layout(), &b.storage(), b.layout(), op)?;
        Ok(Tensor::from_storage(s, a.shape().clone(), None))
    }

    cmp_fns! {
        eq => CmpOp::Eq, ne => CmpOp::Ne, lt => CmpOp::Lt, le => CmpOp::Le, gt => CmpOp::Gt, ge => CmpOp::Ge,
    }

    /// A scalar of this tensor's dtype and device, for comparisons and fills.
    pub fn scalar_like(&self, v: f64) -> Result<Tensor> {
        Tensor::full(v, (), self.dtype(), self.device())
    }

    /// Pick `on_true` where `self` (the condition, any dtype) is non-zero, else `on_false`;
    /// all three broadcast together.
    pub fn where_cond(&self, on_true: &Tensor, on_false: &Tensor) -> Result<Tensor> {
        on_true.check_same(on_false, "where_cond")?;
        if self.device() != on_true.device() {
            return Err(Error::DeviceMismatch { op: "where_cond", lhs: self.device(), rhs: on_true.device() });
        }
        let shape = self
            .shape()
            .broadcast_with(on_true.shape(), "where_cond")?
            .broadcast_with(on_false.shape(), "where_cond")?;
        let (c, t, f) = (
            self.broadcast_as(shape.clone())?,
            on_true.broadcast_as(shape.clone())?,
            on_false.broadcast_as(shape.clone())?,
        );
        let s = c.storage().where_cond(c.layout(), &t.storage(), t.layout(), &f.storage(), f.layout())?;
        let rec = track(&[&t, &f]).then(|| Op::WhereCond(c.detach(), t.clone(), f.clone()));
        Ok(Tensor::from_storage(s, shape, rec))
    }

    /// `value` where `mask` is non-zero, `self` elsewhere.
    pub fn masked_fill(&self, mask: &Tensor, value: f64) -> Result<Tensor> {
        mask.where_cond(&self.scalar_like(value)?, self)
    }

    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        let s = self.storage().to_dtype(self.layout(), dtype)?;
        let differentiable = dtype.is_float() && self.dtype().is_float();
        let rec = (differentiable && track(&[self])).then(|| Op::ToDType(self.clone()));
        Ok(Tensor::from_storage(s, self.shape().clone(), rec))
    }

    // ---- reductions ---------------------------------------------------------------------------

    fn reduce_op<D: Dims>(&self, dims: D, op: ReduceOp, keepdim: bool, name: &'static str) -> Result<Tensor> {
        let dims = dims.to_indexes(self.rank(), name)?;
        if matches!(op, ReduceOp::Max | ReduceOp::Min) && dims.iter().any(|&d| self.dims()[d] == 0) {
            return Err(shape_err!(name, "cannot reduce an empty dim of shape {:?}", self.dims()));
        }
        let s = self.storage().reduce(self.layout(), op, &dims)?;
        let mut kept = self.dims().to_vec();
        dims.iter().for_each(|&d| kept[d] = 1);
        let out =
            Tensor::from_storage(s, kept.clone(), track(&[self]).then(|| Op::Reduce(self.clone(), op, dims.clone())));
        if keepdim {
            return Ok(out);
        }
        let squeezed: Vec<usize> =
            kept.iter().enumerate().filter(|(i, _)| !dims.contains(i)).map(|(_, &d)| d).collect();
        out.reshape(squeezed)
    }

    pub fn sum<D: Dims>(&self, dims: D, keepdim: bool) -> Result<Tensor> {
        self.reduce_op(dims, ReduceOp::Sum, keepdim, "sum")
    }
    pub fn max<D: Dims>(&self, dims: D, keepdim: bool) -> Result<Tensor> {
        self.reduce_op(dims, ReduceOp::Max, keepdim, "max")
    }
    pub fn min<D: Dims>(&self, dims: D, keepdim: bool) -> Result<Tensor> {
        self.reduce_op(dims, ReduceOp::Min, keepdim, "min")
    }
    pub fn sum_all(&self) -> Result<Tensor> {
        self.sum(crate::AllDims, false)
    }

    fn dims_and_count<D: Dims>(&self, dims: D, name: &'static str) -> Result<(Vec<usize>, usize)> {
        let idx = dims.to_indexes(self.rank(), name)?;
        let n = idx.iter().map(|&d| self.dims()[d]).product();
        Ok((idx, n))
    }

    pub fn mean<D: Dims>(&self, dims: D, keepdim: bool) -> Result<Tensor> {
        let (idx, n) = self.dims_and_count(dims, "mean")?;
        self.sum(idx, keepdim)?.mul_scalar(1.0 / n as f64)
    }
    pub fn mean_all(&self) -> Result<Tensor> {
        self.mean(crate::AllDims, false)
    }

    /// Variance with Bessel's correction when `unbiased` (PyTorch's default).
    pub fn var<D: Dims>(&self, dims: D, keepdim: bool, unbiased: bool) -> Result<Tensor> {
        let (idx, n) = self.dims_and_count(dims, "var")?;
        let mean = self.mean(idx.clone(), true)?;
        let sq = self.sub(&mean)?.sqr()?;
        let denom = if unbiased { n.saturating_sub(1) } else { n };
        sq.sum(idx, keepdim)?.mul_scalar(1.0 / denom as f64)
    }

    /// `log(sum(exp(x)))`, stable: the max is subtracted first.
    pub fn logsumexp<D: Dims>(&self, dims: D, keepdim: bool) -> Result<Tensor> {
        let (idx, _) = self.dims_and_count(dims, "logsumexp")?;
        let m = self.max(idx.clone(), true)?.detach();
        // A row of -inf has max -inf; shifting by 0 there keeps the result -inf instead of NaN.
        let finite = m.abs()?.lt(&m.scalar_like(f64::INFINITY)?)?;
        let m = finite.where_cond(&m, &m.scalar_like(0.0)?)?;
        let out = self.sub(&m)?.exp()?.sum(idx.clone(), true)?.log()?.add(&m)?;
        if keepdim {
            return Ok(out);
        }
        let squeezed: Vec<usize> =
            self.dims().iter().enumerate().filter(|(i, _)| !idx.contains(i)).map(|(_, &d)| d).collect();
        out.reshape(squeezed)
    }

    fn arg_reduce_op<D: crate::Dim>(&self, dim: D, op: ArgReduceOp, keepdim: bool) -> Result<Tensor> {
        let d = dim.to_index(self.rank(), "argmax")?;
        if self.dims()[d] == 0 {
            return Err(shape_err!("argmax", "cannot reduce an empty dim of shape {:?}", self.dims()));
        }
        let s = self.storage().arg_reduce(self.layout(), op, d)?;
        let mut kept = self.dims().to_vec();
        kept[d] = 1;
        let out = Tensor::from_storage(s, kept, None);
        if keepdim {
            Ok(out)
        } else {
            out.squeeze(d)
        }
    }

    /// Index (u32) of the largest value along `dim`.
    pub fn argmax<D: crate::Dim>(&self, dim: D, keepdim: bool) -> Result<Tensor> {
        self.arg_reduce_op(dim, ArgReduceOp::ArgMax, keepdim)
    }
    /// Index (u32) of the smallest value along `dim`.
    pub fn argmin<D: crate::Dim>(&self, dim: D, keepdim: bool) -> Result<Tensor> {
        self.arg_reduce_op(dim, ArgReduceOp::ArgMin, keepdim)
    }

    // ---- matmul -------------------------------------------------------------------------------

    /// Matrix product with PyTorch's rules: 1-D operands are promoted and the added dim removed,
    /// batch dims broadcast.
    pub fn matmul(&self, rhs: &Tensor) -> Result<Tensor> {
        self.check_same(rhs, "matmul")?;
        if self.rank() == 0 || rhs.rank() == 0 {
            return Err(Error::ShapeMismatch { op: "matmul", lhs: self.dims().to_vec(), rhs: rhs.dims().to_vec() });
        }
        let (a1, b1) = (self.rank() == 1, rhs.rank() == 1);
        let a = if a1 { self.unsqueeze(0)? } else { self.clone() };
        let b = if b1 { rhs.unsqueeze(1)? } else { rhs.clone() };
        let (ar, br) = (a.rank(), b.rank());
        let (m, k, k2, n) = (a.dims()[ar - 2], a.dims()[ar - 1], b.dims()[br - 2], b.dims()[br - 1]);
        if k != k2 {
            return Err(Error::ShapeMismatch { op: "matmul", lhs: self.dims().to_vec(), rhs: rhs.dims().to_vec() });
        }
        // Report the operands' full shapes, not just the batch dims that failed to broadcast.
        let batch = Shape::from(&a.dims()[..ar - 2])
            .broadcast_with(&Shape::from(&b.dims()[..br - 2]), "matmul")
            .map_err(|_| Error::ShapeMismatch { op: "matmul", lhs: self.dims().to_vec(), rhs: rhs.dims().to_vec() })?;
        let mut adims = batch.to_vec();
        adims.extend([m, k]);
        let mut bdims = batch.to_vec();
        bdims.extend([k, n]);
        let (a, b) = (a.broadcast_as(adims)?, b.broadcast_as(bdims)?);
        // The product [batch.., m, n] can be far larger than either operand: check it first.
        let mut odims = batch.to_vec();
        odims.extend([m, n]);
        Shape::from(&odims).checked_elem_count("matmul")?;
        let dims = MatmulDims { batch: batch.elem_count(), m, n, k };
        let s = a.storage().matmul(a.layout(), &b.storage(), b.layout(), dims)?;
        let rec = track(&[&a, &b]).then(|| Op::Matmul(a.clone(), b.clone()));
        let mut out = Tensor::from_storage(s, odims, rec);
        if a1 {
            out = out.squeeze(-2)?;
        }
        if b1 {
            out = out.squeeze(-1)?;
        }
        Ok(out)
    }
}
