//! Elementwise maps with NumPy broadcasting, comparisons, reductions, casts and matmul.

use crate::backend::{BackendStorage, MatmulDims};
use crate::backprop::track;
use crate::op::{ArgReduceOp, BinaryOp, CmpOp, Op, ReduceOp, UnaryOp};
use crate::{shape_err, DType, Dims, Error, Result, Shape, Tensor};

macro_rules! unary_fns {
    ($($doc:literal $name:ident => $op:expr),* $(,)?) => {
        $(
            #[doc = $doc]
            ///
            /// Elementwise; same shape, dtype and device as `self`; CPU and CUDA; differentiable.
            pub fn $name(&self) -> Result<Tensor> { self.unary_op($op) }
        )*
    };
}

macro_rules! binary_fns {
    ($($doc:literal $name:ident => $op:expr),* $(,)?) => {
        $(
            #[doc = $doc]
            ///
            /// Elementwise with NumPy broadcasting: the result has the operands' common shape.
            /// Both operands must have the same dtype and device (any dtype; CPU and CUDA);
            /// otherwise [`Error::DTypeMismatch`], [`Error::DeviceMismatch`], or
            /// [`Error::ShapeMismatch`] for shapes that do not broadcast. Differentiable in both
            /// operands.
            pub fn $name(&self, rhs: &Tensor) -> Result<Tensor> { self.binary_op(rhs, $op) }
        )*
    };
}

macro_rules! cmp_fns {
    ($($doc:literal $name:ident => $op:expr),* $(,)?) => {
        $(
            #[doc = $doc]
            ///
            /// Elementwise comparison with broadcasting; the result is u8 (0 or 1) and carries no
            /// gradient. Same dtype and device required, as for [`Tensor::add`].
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
        "`-x` (`torch.neg`); integer dtypes too." neg => UnaryOp::Neg,
        "`|x|` (`torch.abs`); integer dtypes too." abs => UnaryOp::Abs,
        "`x * x` (`torch.square`); integer dtypes too." sqr => UnaryOp::Sqr,
        "-1, 0 or 1 (`torch.sign`); integer dtypes too; its gradient is 0." sign => UnaryOp::Sign,
        "`max(x, 0)` (`torch.relu`); integer dtypes too." relu => UnaryOp::Relu,
        "`e^x` (`torch.exp`); float dtypes only ([`Error::UnsupportedDType`] otherwise)." exp => UnaryOp::Exp,
        "Natural log (`torch.log`); float dtypes only." log => UnaryOp::Log,
        "Square root (`torch.sqrt`); float dtypes only." sqrt => UnaryOp::Sqrt,
        "`1 / sqrt(x)` (`torch.rsqrt`); float dtypes only." rsqrt => UnaryOp::Rsqrt,
        "`1 / x` (`torch.reciprocal`); float dtypes only." recip => UnaryOp::Recip,
        "Hyperbolic tangent (`torch.tanh`); float dtypes only." tanh => UnaryOp::Tanh,
        "`1 / (1 + e^-x)` (`torch.sigmoid`); float dtypes only." sigmoid => UnaryOp::Sigmoid,
        "`x * sigmoid(x)` (`torch.nn.functional.silu`); float dtypes only." silu => UnaryOp::Silu,
        "Sine (`torch.sin`); float dtypes only." sin => UnaryOp::Sin,
        "Cosine (`torch.cos`); float dtypes only." cos => UnaryOp::Cos,
        "GELU, tanh approximation (`F.gelu(x, approximate=\"tanh\")`, GPT-2's); float dtypes only." gelu_tanh => UnaryOp::GeluTanh,
    }

    /// GELU, exact (erf) form: PyTorch's default (`F.gelu`). Elementwise, float dtypes, CPU and
    /// CUDA, differentiable.
    pub fn gelu(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::GeluErf)
    }

    /// `self * mul + add`, elementwise; any dtype (for integers computed in f64 and converted back), CPU and CUDA,
    /// differentiable.
    pub fn affine(&self, mul: f64, add: f64) -> Result<Tensor> {
        self.unary_op(UnaryOp::Affine { mul, add })
    }
    /// `self + v` (`t + v` in PyTorch); see [`Tensor::affine`].
    pub fn add_scalar(&self, v: f64) -> Result<Tensor> {
        self.affine(1.0, v)
    }
    /// `self * v` (`t * v` in PyTorch); see [`Tensor::affine`].
    pub fn mul_scalar(&self, v: f64) -> Result<Tensor> {
        self.affine(v, 0.0)
    }
    /// `x^e` for a float exponent (`torch.pow(t, e)`); float dtypes only, differentiable.
    pub fn powf(&self, e: f64) -> Result<Tensor> {
        self.unary_op(UnaryOp::Powf(e))
    }
    /// Each element limited to `[min, max]` (`torch.clamp`); any dtype. Errors with
    /// [`Error::InvalidArgument`] when `min > max` or either is NaN. The gradient is 1 inside the
    /// range, 0 outside.
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

    /// Both operands broadcast to their common shape (`torch.broadcast_tensors`), as views;
    /// `op` names the caller in the [`Error::ShapeMismatch`] returned when they do not broadcast.
    pub fn broadcast_pair(&self, rhs: &Tensor, op: &'static str) -> Result<(Tensor, Tensor)> {
        if self.shape() == rhs.shape() {
            return Ok((self.clone(), rhs.clone())); // the common case, without building a shape
        }
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
        "`self + rhs` (`torch.add`)." add => BinaryOp::Add,
        "`self - rhs` (`torch.sub`)." sub => BinaryOp::Sub,
        "`self * rhs` (`torch.mul`)." mul => BinaryOp::Mul,
        "`self / rhs` (`torch.div`; integer dtypes truncate)." div => BinaryOp::Div,
        "The larger of the two (`torch.maximum`)." maximum => BinaryOp::Maximum,
        "The smaller of the two (`torch.minimum`)." minimum => BinaryOp::Minimum,
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
        "`self == rhs` (`torch.eq`)." eq => CmpOp::Eq,
        "`self != rhs` (`torch.ne`)." ne => CmpOp::Ne,
        "`self < rhs` (`torch.lt`)." lt => CmpOp::Lt,
        "`self <= rhs` (`torch.le`)." le => CmpOp::Le,
        "`self > rhs` (`torch.gt`)." gt => CmpOp::Gt,
        "`self >= rhs` (`torch.ge`)." ge => CmpOp::Ge,
    }

    /// A scalar of this tensor's dtype and device, for comparisons and fills.
    pub fn scalar_like(&self, v: f64) -> Result<Tensor> {
        Tensor::full(v, (), self.dtype(), self.device())
    }

    /// Pick `on_true` where `self` (the condition, any dtype) is non-zero, else `on_false`;
    /// all three broadcast together (`torch.where(cond, a, b)`). `on_true` and `on_false` must share
    /// dtype and device, and the condition must be on that device. Differentiable in `on_true`
    /// and `on_false`.
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

    /// `value` where `mask` is non-zero, `self` elsewhere (`torch.masked_fill`); the mask
    /// broadcasts.
    pub fn masked_fill(&self, mask: &Tensor, value: f64) -> Result<Tensor> {
        mask.where_cond(&self.scalar_like(value)?, self)
    }

    /// A copy converted to `dtype` (`t.to(dtype)`); returns `self` when the dtype is already
    /// `dtype`. Float to integer truncates toward zero; float-to-float casts are
    /// differentiable (the gradient is cast back).
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

    /// Sum over `dims` (`torch.sum(t, dims, keepdim)`); `keepdim` keeps them with size 1. Any
    /// dtype, CPU and CUDA, differentiable. Errors with [`Error::DimOutOfRange`].
    pub fn sum<D: Dims>(&self, dims: D, keepdim: bool) -> Result<Tensor> {
        self.reduce_op(dims, ReduceOp::Sum, keepdim, "sum")
    }
    /// Maximum over `dims` (`torch.amax`); an empty reduced dim is an error. The gradient goes to
    /// the elements equal to the maximum.
    pub fn max<D: Dims>(&self, dims: D, keepdim: bool) -> Result<Tensor> {
        self.reduce_op(dims, ReduceOp::Max, keepdim, "max")
    }
    /// Minimum over `dims` (`torch.amin`); as [`Tensor::max`].
    pub fn min<D: Dims>(&self, dims: D, keepdim: bool) -> Result<Tensor> {
        self.reduce_op(dims, ReduceOp::Min, keepdim, "min")
    }
    /// Sum of every element, a 0-d tensor (`t.sum()`).
    pub fn sum_all(&self) -> Result<Tensor> {
        self.sum(crate::AllDims, false)
    }

    fn dims_and_count<D: Dims>(&self, dims: D, name: &'static str) -> Result<(Vec<usize>, usize)> {
        let idx = dims.to_indexes(self.rank(), name)?;
        let n = idx.iter().map(|&d| self.dims()[d]).product();
        Ok((idx, n))
    }

    /// Mean over `dims` (`torch.mean(t, dims, keepdim)`); as [`Tensor::sum`].
    pub fn mean<D: Dims>(&self, dims: D, keepdim: bool) -> Result<Tensor> {
        let (idx, n) = self.dims_and_count(dims, "mean")?;
        self.sum(idx, keepdim)?.mul_scalar(1.0 / n as f64)
    }
    /// Mean of every element, a 0-d tensor (`t.mean()`).
    pub fn mean_all(&self) -> Result<Tensor> {
        self.mean(crate::AllDims, false)
    }

    /// Variance over `dims`, with Bessel's correction when `unbiased` (PyTorch's default,
    /// `torch.var`); float dtypes, differentiable.
    pub fn var<D: Dims>(&self, dims: D, keepdim: bool, unbiased: bool) -> Result<Tensor> {
        let (idx, n) = self.dims_and_count(dims, "var")?;
        let mean = self.mean(idx.clone(), true)?;
        let sq = self.sub(&mean)?.sqr()?;
        let denom = if unbiased { n.saturating_sub(1) } else { n };
        sq.sum(idx, keepdim)?.mul_scalar(1.0 / denom as f64)
    }

    /// `log(sum(exp(x)))` over `dims` (`torch.logsumexp`), stable: the max is subtracted first; a
    /// row of `-inf` gives `-inf`. Float dtypes, differentiable.
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

    /// Index (u32) of the largest value along `dim` (`torch.argmax`); not differentiable; an empty
    /// dim is an error.
    pub fn argmax<D: crate::Dim>(&self, dim: D, keepdim: bool) -> Result<Tensor> {
        self.arg_reduce_op(dim, ArgReduceOp::ArgMax, keepdim)
    }
    /// Index (u32) of the smallest value along `dim` (`torch.argmin`).
    pub fn argmin<D: crate::Dim>(&self, dim: D, keepdim: bool) -> Result<Tensor> {
        self.arg_reduce_op(dim, ArgReduceOp::ArgMin, keepdim)
    }

    // ---- matmul -------------------------------------------------------------------------------

    /// Matrix product with PyTorch's rules (`torch.matmul`): `[.., m, k] x [.., k, n] -> [.., m, n]`;
    /// 1-D operands are promoted and the added dim removed, batch dims broadcast. f32, f64, f16
    /// and bf16, on the CPU (`gemm`) and CUDA (cuBLAS).
    /// Errors with [`Error::ShapeMismatch`] for mismatched inner or batch dims and
    /// [`Error::UnsupportedDType`] for integers. Differentiable in both operands.
    ///
    /// ```
    /// use ferrograd_core::{DType, Device, Tensor};
    /// let a = Tensor::ones((5, 2, 3), DType::F32, Device::Cpu)?;
    /// let b = Tensor::ones((3, 4), DType::F32, Device::Cpu)?;
    /// assert_eq!(a.matmul(&b)?.dims(), &[5, 2, 4]);
    /// # Ok::<(), ferrograd_core::Error>(())
    /// ```
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
