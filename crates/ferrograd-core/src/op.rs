//! What backends compute (`UnaryOp`, `BinaryOp`, ...) and how each tensor was made (`Op`), which
//! is all `backprop.rs` needs to walk the graph backwards.
//!
//! The op enums the kernels switch on are `#[repr(i32)]` with explicit values: the same values as
//! the `.cu` enums (`FgBinaryOp`, ...) and docs/kernel-abi.md, which a test (`src/cuda/abi.rs`)
//! compares. `UnaryOp` carries parameters, so its kernel code is the separate [`UnaryCode`].

use crate::Tensor;

/// Elementwise maps. The `*Grad` variants are derivatives used by backward rules.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum UnaryOp {
    /// `-x`.
    Neg,
    /// `|x|`.
    Abs,
    /// `x * x`.
    Sqr,
    /// -1, 0 or 1.
    Sign,
    /// `max(x, 0)`.
    Relu,
    /// `e^x`.
    Exp,
    /// Natural log.
    Log,
    /// Square root.
    Sqrt,
    /// `1 / sqrt(x)`.
    Rsqrt,
    /// `1 / x`.
    Recip,
    /// Hyperbolic tangent.
    Tanh,
    /// `1 / (1 + e^-x)`.
    Sigmoid,
    /// GELU, tanh approximation.
    GeluTanh,
    /// GELU, exact (erf).
    GeluErf,
    /// `x * sigmoid(x)`.
    Silu,
    /// Sine.
    Sin,
    /// Cosine.
    Cos,
    /// `x * mul + add`
    Affine {
        /// Factor.
        mul: f64,
        /// Offset.
        add: f64,
    },
    /// `x^e`.
    Powf(f64),
    /// Limit to `[min, max]`.
    Clamp {
        /// Lower bound.
        min: f64,
        /// Upper bound.
        max: f64,
    },
    /// d/dx gelu_tanh(x)
    GeluTanhGrad,
    /// d/dx gelu_erf(x)
    GeluErfGrad,
    /// d/dx silu(x)
    SiluGrad,
}

/// The kernel code of a [`UnaryOp`] (`FgUnaryOp` in kernels/unary.cu); the op's parameters travel
/// beside it (`p0`, `p1`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub enum UnaryCode {
    /// Kernel code of [`UnaryOp::Neg`].
    Neg = 0,
    /// Kernel code of [`UnaryOp::Abs`].
    Abs = 1,
    /// Kernel code of [`UnaryOp::Sqr`].
    Sqr = 2,
    /// Kernel code of [`UnaryOp::Sign`].
    Sign = 3,
    /// Kernel code of [`UnaryOp::Relu`].
    Relu = 4,
    /// Kernel code of [`UnaryOp::Exp`].
    Exp = 5,
    /// Kernel code of [`UnaryOp::Log`].
    Log = 6,
    /// Kernel code of [`UnaryOp::Sqrt`].
    Sqrt = 7,
    /// Kernel code of [`UnaryOp::Rsqrt`].
    Rsqrt = 8,
    /// Kernel code of [`UnaryOp::Recip`].
    Recip = 9,
    /// Kernel code of [`UnaryOp::Tanh`].
    Tanh = 10,
    /// Kernel code of [`UnaryOp::Sigmoid`].
    Sigmoid = 11,
    /// Kernel code of [`UnaryOp::GeluTanh`].
    GeluTanh = 12,
    /// Kernel code of [`UnaryOp::GeluErf`].
    GeluErf = 13,
    /// Kernel code of [`UnaryOp::Silu`].
    Silu = 14,
    /// Kernel code of [`UnaryOp::Sin`].
    Sin = 15,
    /// Kernel code of [`UnaryOp::Cos`].
    Cos = 16,
    /// Kernel code of [`UnaryOp::Affine`].
    Affine = 17,
    /// Kernel code of [`UnaryOp::Powf`].
    Powf = 18,
    /// Kernel code of [`UnaryOp::Clamp`].
    Clamp = 19,
    /// Kernel code of [`UnaryOp::GeluTanhGrad`].
    GeluTanhGrad = 20,
    /// Kernel code of [`UnaryOp::GeluErfGrad`].
    GeluErfGrad = 21,
    /// Kernel code of [`UnaryOp::SiluGrad`].
    SiluGrad = 22,
}

impl UnaryCode {
    /// Every variant, in kernel-code order.
    pub const ALL: [UnaryCode; 23] = [
        UnaryCode::Neg,
        UnaryCode::Abs,
        UnaryCode::Sqr,
        UnaryCode::Sign,
        UnaryCode::Relu,
        UnaryCode::Exp,
        UnaryCode::Log,
        UnaryCode::Sqrt,
        UnaryCode::Rsqrt,
        UnaryCode::Recip,
        UnaryCode::Tanh,
        UnaryCode::Sigmoid,
        UnaryCode::GeluTanh,
        UnaryCode::GeluErf,
        UnaryCode::Silu,
        UnaryCode::Sin,
        UnaryCode::Cos,
        UnaryCode::Affine,
        UnaryCode::Powf,
        UnaryCode::Clamp,
        UnaryCode::GeluTanhGrad,
        UnaryCode::GeluErfGrad,
        UnaryCode::SiluGrad,
    ];
}

impl UnaryOp {
    /// The kernel code and the two parameters the kernel reads (`p0`, `p1`; 0 when unused).
    pub fn code(&self) -> (UnaryCode, f64, f64) {
        match *self {
            UnaryOp::Neg => (UnaryCode::Neg, 0., 0.),
            UnaryOp::Abs => (UnaryCode::Abs, 0., 0.),
            UnaryOp::Sqr => (UnaryCode::Sqr, 0., 0.),
            UnaryOp::Sign => (UnaryCode::Sign, 0., 0.),
            UnaryOp::Relu => (UnaryCode::Relu, 0., 0.),
            UnaryOp::Exp => (UnaryCode::Exp, 0., 0.),
            UnaryOp::Log => (UnaryCode::Log, 0., 0.),
            UnaryOp::Sqrt => (UnaryCode::Sqrt, 0., 0.),
            UnaryOp::Rsqrt => (UnaryCode::Rsqrt, 0., 0.),
            UnaryOp::Recip => (UnaryCode::Recip, 0., 0.),
            UnaryOp::Tanh => (UnaryCode::Tanh, 0., 0.),
            UnaryOp::Sigmoid => (UnaryCode::Sigmoid, 0., 0.),
            UnaryOp::GeluTanh => (UnaryCode::GeluTanh, 0., 0.),
            UnaryOp::GeluErf => (UnaryCode::GeluErf, 0., 0.),
            UnaryOp::Silu => (UnaryCode::Silu, 0., 0.),
            UnaryOp::Sin => (UnaryCode::Sin, 0., 0.),
            UnaryOp::Cos => (UnaryCode::Cos, 0., 0.),
            UnaryOp::Affine { mul, add } => (UnaryCode::Affine, mul, add),
            UnaryOp::Powf(e) => (UnaryCode::Powf, e, 0.),
            UnaryOp::Clamp { min, max } => (UnaryCode::Clamp, min, max),
            UnaryOp::GeluTanhGrad => (UnaryCode::GeluTanhGrad, 0., 0.),
            UnaryOp::GeluErfGrad => (UnaryCode::GeluErfGrad, 0., 0.),
            UnaryOp::SiluGrad => (UnaryCode::SiluGrad, 0., 0.),
        }
    }

    /// The op's name in error messages and kernel names.
    pub fn name(&self) -> &'static str {
        match self {
            UnaryOp::Neg => "neg",
            UnaryOp::Abs => "abs",
            UnaryOp::Sqr => "sqr",
            UnaryOp::Sign => "sign",
            UnaryOp::Relu => "relu",
            UnaryOp::Exp => "exp",
            UnaryOp::Log => "log",
            UnaryOp::Sqrt => "sqrt",
            UnaryOp::Rsqrt => "rsqrt",
            UnaryOp::Recip => "recip",
            UnaryOp::Tanh => "tanh",
            UnaryOp::Sigmoid => "sigmoid",
            UnaryOp::GeluTanh => "gelu_tanh",
            UnaryOp::GeluErf => "gelu_erf",
            UnaryOp::Silu => "silu",
            UnaryOp::Sin => "sin",
            UnaryOp::Cos => "cos",
            UnaryOp::Affine { .. } => "affine",
            UnaryOp::Powf(_) => "powf",
            UnaryOp::Clamp { .. } => "clamp",
            UnaryOp::GeluTanhGrad => "gelu_tanh_grad",
            UnaryOp::GeluErfGrad => "gelu_erf_grad",
            UnaryOp::SiluGrad => "silu_grad",
        }
    }

    /// Ops that make sense on integer tensors (computed exactly, results saturate).
    pub fn int_ok(&self) -> bool {
        matches!(
            self,
            UnaryOp::Neg
                | UnaryOp::Abs
                | UnaryOp::Sqr
                | UnaryOp::Sign
                | UnaryOp::Relu
                | UnaryOp::Affine { .. }
                | UnaryOp::Clamp { .. }
        )
    }

    /// The reference definition in f64; backends must agree with it to within rounding.
    pub fn eval_f64(&self, x: f64) -> f64 {
        use std::f64::consts::{FRAC_2_SQRT_PI, SQRT_2};
        const GELU_C: f64 = 0.044715;
        let sqrt_2_over_pi = FRAC_2_SQRT_PI / SQRT_2;
        match *self {
            UnaryOp::Neg => -x,
            UnaryOp::Abs => x.abs(),
            UnaryOp::Sqr => x * x,
            UnaryOp::Sign => {
                if x > 0.0 {
                    1.0
                } else if x < 0.0 {
                    -1.0
                } else {
                    0.0
                }
            }
            // NaN propagates, as in PyTorch (a NaN mapped to 0 would hide a diverged model).
            UnaryOp::Relu => {
                if x > 0.0 || x.is_nan() {
                    x
                } else {
                    0.0
                }
            }
            UnaryOp::Exp => x.exp(),
            UnaryOp::Log => x.ln(),
            UnaryOp::Sqrt => x.sqrt(),
            UnaryOp::Rsqrt => 1.0 / x.sqrt(),
            UnaryOp::Recip => 1.0 / x,
            UnaryOp::Tanh => x.tanh(),
            UnaryOp::Sigmoid => 1.0 / (1.0 + (-x).exp()),
            UnaryOp::GeluTanh => 0.5 * x * (1.0 + (sqrt_2_over_pi * (x + GELU_C * x * x * x)).tanh()),
            UnaryOp::GeluErf => 0.5 * x * (1.0 + libm::erf(x / SQRT_2)),
            UnaryOp::Silu => x / (1.0 + (-x).exp()),
            UnaryOp::Sin => x.sin(),
            UnaryOp::Cos => x.cos(),
            UnaryOp::Affine { mul, add } => x * mul + add,
            UnaryOp::Powf(e) => x.powf(e),
            // `f64::max` ignores a NaN operand; torch.clamp propagates it.
            UnaryOp::Clamp { min, max } => {
                if x.is_nan() {
                    x
                } else {
                    x.max(min).min(max)
                }
            }
            UnaryOp::GeluTanhGrad => {
                let inner = sqrt_2_over_pi * (x + GELU_C * x * x * x);
                let t = inner.tanh();
                0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * sqrt_2_over_pi * (1.0 + 3.0 * GELU_C * x * x)
            }
            UnaryOp::GeluErfGrad => {
                let pdf = (-0.5 * x * x).exp() * FRAC_2_SQRT_PI / (2.0 * SQRT_2);
                0.5 * (1.0 + libm::erf(x / SQRT_2)) + x * pdf
            }
            UnaryOp::SiluGrad => {
                let s = 1.0 / (1.0 + (-x).exp());
                s * (1.0 + x * (1.0 - s))
            }
        }
    }

    /// The same in f32, for f32/f16/bf16 tensors.
    pub fn eval_f32(&self, x: f32) -> f32 {
        use std::f32::consts::{FRAC_2_SQRT_PI, SQRT_2};
        const GELU_C: f32 = 0.044715;
        let sqrt_2_over_pi = FRAC_2_SQRT_PI / SQRT_2;
        match *self {
            UnaryOp::Neg => -x,
            UnaryOp::Abs => x.abs(),
            UnaryOp::Sqr => x * x,
            UnaryOp::Relu => {
                if x > 0.0 || x.is_nan() {
                    x
                } else {
                    0.0
                }
            }
            UnaryOp::Exp => x.exp(),
            UnaryOp::Log => x.ln(),
            UnaryOp::Sqrt => x.sqrt(),
            UnaryOp::Rsqrt => 1.0 / x.sqrt(),
            UnaryOp::Recip => 1.0 / x,
            UnaryOp::Tanh => x.tanh(),
            UnaryOp::Sigmoid => 1.0 / (1.0 + (-x).exp()),
            UnaryOp::GeluTanh => 0.5 * x * (1.0 + (sqrt_2_over_pi * (x + GELU_C * x * x * x)).tanh()),
            UnaryOp::GeluErf => 0.5 * x * (1.0 + libm::erff(x / SQRT_2)),
            UnaryOp::Silu => x / (1.0 + (-x).exp()),
            UnaryOp::Sin => x.sin(),
            UnaryOp::Cos => x.cos(),
            UnaryOp::Affine { mul, add } => (x as f64 * mul + add) as f32,
            UnaryOp::Powf(e) => x.powf(e as f32),
            UnaryOp::Clamp { min, max } => {
                if x.is_nan() {
                    x
                } else {
                    x.max(min as f32).min(max as f32)
                }
            }
            _ => self.eval_f64(x as f64) as f32,
        }
    }
}

/// Elementwise binary ops (`FgBinaryOp` in kernels/binary.cu).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub enum BinaryOp {
    /// `a + b`.
    Add = 0,
    /// `a - b`.
    Sub = 1,
    /// `a * b`.
    Mul = 2,
    /// `a / b` (integers truncate).
    Div = 3,
    /// The larger of `a` and `b`.
    Maximum = 4,
    /// The smaller of `a` and `b`.
    Minimum = 5,
    /// Floored remainder (sign of the divisor), as Python's `%` and `torch.remainder`.
    Rem = 6,
    /// `a` where `b > 0` or `b` is NaN, else 0: ReLU's backward (`g`, `x`) in one pass, passing
    /// the gradient through where the forward passed a NaN (PyTorch's `threshold_backward`
    /// zeroes only where `x <= 0`). Not differentiated.
    MaskPositive = 7,
}

impl BinaryOp {
    /// Every variant, in kernel-code order.
    pub const ALL: [BinaryOp; 8] = [
        BinaryOp::Add,
        BinaryOp::Sub,
        BinaryOp::Mul,
        BinaryOp::Div,
        BinaryOp::Maximum,
        BinaryOp::Minimum,
        BinaryOp::Rem,
        BinaryOp::MaskPositive,
    ];

    /// The op's name in error messages and kernel names.
    pub fn name(&self) -> &'static str {
        match self {
            BinaryOp::Add => "add",
            BinaryOp::Sub => "sub",
            BinaryOp::Mul => "mul",
            BinaryOp::Div => "div",
            BinaryOp::Maximum => "maximum",
            BinaryOp::Minimum => "minimum",
            BinaryOp::Rem => "rem",
            BinaryOp::MaskPositive => "mask_positive",
        }
    }
}

/// Elementwise comparisons, giving u8 0 / 1 (`FgCmpOp` in kernels/binary.cu).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub enum CmpOp {
    /// `a == b`.
    Eq = 0,
    /// `a != b`.
    Ne = 1,
    /// `a < b`.
    Lt = 2,
    /// `a <= b`.
    Le = 3,
    /// `a > b`.
    Gt = 4,
    /// `a >= b`.
    Ge = 5,
}

impl CmpOp {
    /// Every variant, in kernel-code order.
    pub const ALL: [CmpOp; 6] = [CmpOp::Eq, CmpOp::Ne, CmpOp::Lt, CmpOp::Le, CmpOp::Gt, CmpOp::Ge];
}

/// Folds over dims (`FgReduceOp` in kernels/reduce.cu); max and min propagate NaN.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub enum ReduceOp {
    /// Sum.
    Sum = 0,
    /// Maximum.
    Max = 1,
    /// Minimum.
    Min = 2,
}

impl ReduceOp {
    /// Every variant, in kernel-code order.
    pub const ALL: [ReduceOp; 3] = [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min];
}

/// Index of the max / min along a dim (`FgArgReduceOp` in kernels/reduce.cu).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub enum ArgReduceOp {
    /// Index of the maximum.
    ArgMax = 0,
    /// Index of the minimum.
    ArgMin = 1,
}

impl ArgReduceOp {
    /// Every variant, in kernel-code order.
    pub const ALL: [ArgReduceOp; 2] = [ArgReduceOp::ArgMax, ArgReduceOp::ArgMin];
}

/// How a tensor that tracks gradients was made. Holding the inputs keeps the graph alive until the
/// output is dropped; backward drops intermediate gradients as soon as they have been propagated.
#[derive(Clone)]
pub enum Op {
    /// An elementwise map of the input.
    Unary(Tensor, UnaryOp),
    /// Operands already broadcast to the output shape (their `Broadcast` ops reduce the gradient).
    Binary(Tensor, Tensor, BinaryOp),
    /// Gradient flows to the two branches; the condition gets none.
    WhereCond(Tensor, Tensor, Tensor),
    /// Output keeps the reduced dims as size 1.
    Reduce(Tensor, ReduceOp, Vec<usize>),
    /// A (batched) matrix product of operands already broadcast.
    Matmul(Tensor, Tensor),
    /// A reshape of the input.
    Reshape(Tensor),
    /// A permutation of the input's dims.
    Permute(Tensor, Vec<usize>),
    /// A slice of the input: dim and start.
    Narrow(Tensor, usize, usize),
    /// A broadcast view of the input.
    Broadcast(Tensor),
    /// A contiguous copy of the input.
    Copy(Tensor),
    /// A cast of the input (between float dtypes).
    ToDType(Tensor),
    /// A concatenation of the inputs along a dim.
    Cat(Vec<Tensor>, usize),
    /// Rows of the source (first) picked by the index tensor (second) along a dim.
    IndexSelect(Tensor, Tensor, usize),
    /// Elements of the source (first) picked by the index tensor (second) along a dim.
    Gather(Tensor, Tensor, usize),
    /// A fused op (`src/fused/`): its own forward per device and its own backward.
    Fused(crate::fused::FusedRecord),
}
