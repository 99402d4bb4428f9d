//! Element types. `WithDType` ties a Rust scalar to its `DType` and to the `CpuStorage` variant
//! that holds it, so generic CPU code can move between the two without a match per call site.

use crate::cpu::CpuStorage;
use half::{bf16, f16};

/// Element types. Ops never promote: both operands of a binary op must have the same dtype
/// (cast with [`Tensor::to_dtype`](crate::Tensor::to_dtype)). Reductions and fused ops accumulate
/// in [`DType::acc`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit float (`torch.float32`), the default for parameters.
    F32,
    /// 64-bit float (`torch.float64`): gradchecks.
    F64,
    /// IEEE half (`torch.float16`).
    F16,
    /// bfloat16 (`torch.bfloat16`): autocast on GPUs.
    BF16,
    /// 32-bit signed integer (`torch.int32`).
    I32,
    /// 32-bit unsigned integer: token ids, `argmax` results.
    U32,
    /// 8-bit unsigned integer (`torch.uint8`): masks and comparison results.
    U8,
    /// 8-bit signed integer (`torch.int8`).
    I8,
}

impl DType {
    /// Every dtype, for tests and tables.
    pub const ALL: [DType; 8] =
        [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I32, DType::U32, DType::U8, DType::I8];

    /// Bytes per element (`t.element_size()`).
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F64 => 8,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::U8 | DType::I8 => 1,
        }
    }

    /// Whether this is f32, f64, f16 or bf16 (`dtype.is_floating_point`).
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }

    /// `Ok` for a float dtype, else the typed error naming `op`: the one check every float-only op
    /// (softmax, layer norm, cross entropy, ...) makes.
    pub fn check_float(self, op: &'static str) -> crate::Result<()> {
        if self.is_float() {
            Ok(())
        } else {
            Err(crate::Error::UnsupportedDType { op, dtype: self })
        }
    }

    /// The dtype that reductions, norms and fused ops accumulate in and keep their statistics in:
    /// f32 for f32, f16 and bf16 (as the kernels' `FgAcc` and PyTorch's `acc_type` do), f64 for
    /// f64 and for every integer dtype (their sums are exact in f64 up to 2^53, which f32 would
    /// round from 2^24: the CUDA integer reductions and the kernel ABI's ACC have always used it).
    pub fn acc(self) -> DType {
        match self {
            DType::F32 | DType::F16 | DType::BF16 => DType::F32,
            DType::F64 | DType::I32 | DType::U32 | DType::U8 | DType::I8 => DType::F64,
        }
    }

    /// The short name (`"f32"`, `"bf16"`, ...), also what `Display` and `FromStr` use.
    pub fn as_str(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::U32 => "u32",
            DType::U8 => "u8",
            DType::I8 => "i8",
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for DType {
    type Err = crate::Error;
    fn from_str(s: &str) -> crate::Result<Self> {
        DType::ALL
            .into_iter()
            .find(|d| d.as_str() == s)
            .ok_or_else(|| crate::Error::InvalidArgument(format!("unknown dtype {s:?}")))
    }
}

/// A Rust scalar type that a tensor can hold.
pub trait WithDType:
    Copy + Send + Sync + PartialOrd + std::fmt::Debug + std::fmt::Display + bytemuck::Pod + 'static
{
    /// The dtype of `Self`.
    const DTYPE: DType;
    /// Convert from f64 (Rust's `as` for integers: truncating, saturating).
    fn from_f64(v: f64) -> Self;
    /// Convert to f64 (exact for every dtype).
    fn to_f64(self) -> f64;
    /// Wrap a vector as CPU storage.
    fn to_cpu_storage(data: Vec<Self>) -> CpuStorage;
    /// The storage's elements when it holds `Self`.
    fn cpu_slice(s: &CpuStorage) -> Option<&[Self]>;
}

macro_rules! with_dtype {
    ($ty:ty, $variant:ident, $from:expr, $to:expr) => {
        impl WithDType for $ty {
            const DTYPE: DType = DType::$variant;
            #[inline]
            fn from_f64(v: f64) -> Self {
                $from(v)
            }
            #[inline]
            fn to_f64(self) -> f64 {
                $to(self)
            }
            fn to_cpu_storage(data: Vec<Self>) -> CpuStorage {
                CpuStorage::$variant(data)
            }
            fn cpu_slice(s: &CpuStorage) -> Option<&[Self]> {
                match s {
                    CpuStorage::$variant(v) => Some(v),
                    _ => None,
                }
            }
        }
    };
}

with_dtype!(f32, F32, |v: f64| v as f32, |v: f32| v as f64);
with_dtype!(f64, F64, |v: f64| v, |v: f64| v);
with_dtype!(f16, F16, f16::from_f64, f16::to_f64);
with_dtype!(bf16, BF16, bf16::from_f64, bf16::to_f64);
// Float-to-int casts saturate (Rust `as` semantics), matching the CUDA cast kernels.
with_dtype!(i32, I32, |v: f64| v as i32, |v: i32| v as f64);
with_dtype!(u32, U32, |v: f64| v as u32, |v: u32| v as f64);
with_dtype!(u8, U8, |v: f64| v as u8, |v: u8| v as f64);
with_dtype!(i8, I8, |v: f64| v as i8, |v: i8| v as f64);
