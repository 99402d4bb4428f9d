//! Element types. `WithDType` ties a Rust scalar to its `DType` and to the `CpuStorage` variant
//! that holds it, so generic CPU code can move between the two without a match per call site.

use crate::cpu::CpuStorage;
use half::{bf16, f16};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F64,
    F16,
    BF16,
    I32,
    U32,
    U8,
    I8,
}

impl DType {
    pub const ALL: [DType; 8] =
        [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I32, DType::U32, DType::U8, DType::I8];

    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F64 => 8,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::U8 | DType::I8 => 1,
        }
    }

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
    const DTYPE: DType;
    fn from_f64(v: f64) -> Self;
    fn to_f64(self) -> f64;
    fn to_cpu_storage(data: Vec<Self>) -> CpuStorage;
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
