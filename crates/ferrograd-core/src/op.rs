//! What backends compute (`UnaryOp`, `BinaryOp`, ...) and how each tensor was made (`Op`), which
//! is all `backprop.rs` needs to walk the graph backwards.

use crate::Tensor;

/// Elementwise maps. The `*Grad` variants are derivatives used by backward rules.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum UnaryOp {
    Neg,
    Abs,
    Sqr,
    Sign,
    Relu,
    Exp,
    Log,
    Sqrt,
    Rsqrt,
    Recip,
    Tanh,
    Sigmoid,
    GeluTanh,
    GeluErf,
    Silu,
    Sin,
    Cos,
    /// `x * mul + add`
    Affine {
        mul: f64,
        add: f64,
    },
    Powf(f64),
    Clamp {
        min: f64,
        max: f64,
    },
    /// d/dx gelu_tanh(x)
    GeluTanhGrad,
    /// d/dx gelu_erf(x)
    GeluErfGrad,
    /// d/dx silu(x)
    SiluGrad,
}

impl UnaryOp {
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
            UnaryOp::Relu => {
                if x > 0.0 {
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
            UnaryOp::Clamp { min, max } => x.max(min).min(max),
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
            UnaryOp::Relu => x.max(0.0),
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
            UnaryOp::Clamp { min, max } => x.max(min as f32).min(max as f32),
            _ => self.eval_f64(x as f64) as f32,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    Div,
    Maximum,
    Minimum,
    /// Floored remainder (sign of the divisor), as Python's `%` and `torch.remainder`.
    Rem,
    /// `a` where `b > 0`, else 0: ReLU's backward (`g`, `x`) in one pass. Not differentiated.
    MaskPositive,
}

impl BinaryOp {
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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CmpOp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    Max,
    Min,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArgReduceOp {
    ArgMax,
    ArgMin,
}

/// How a tensor that tracks gradients was made. Holding the inputs keeps the graph alive until the
/// output is dropped; backward drops intermediate gradients as soon as they have been propagated.
#[derive(Clone)]
pub enum Op {
    Unary(Tensor, UnaryOp),
    /// Operands already broadcast to the output shape (their `Broadcast` ops reduce the gradient).
    Binary(Tensor, Tensor, BinaryOp),
    /// Gradient flows to the two branches; the condition gets none.
    WhereCond(Tensor, Tensor, Tensor),
    /// Output keeps the reduced dims as size 1.
    Reduce(Tensor, ReduceOp, Vec<usize>),
    Matmul(Tensor, Tensor),
    Reshape(Tensor),
    Permute(Tensor, Vec<usize>),
    Narrow(Tensor, usize, usize),
    Broadcast(Tensor),
    Copy(Tensor),
    ToDType(Tensor),
    Cat(Vec<Tensor>, usize),
    IndexSelect(Tensor, Tensor, usize),
    Gather(Tensor, Tensor, usize),
    /// A fused op (`src/fused/`): its own forward per device and its own backward.
    Fused(crate::fused::FusedRecord),
}
