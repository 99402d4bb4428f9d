//! One error type for the whole library. Every fallible path returns `Result<T>`; user input never
//! panics. Messages name the offending shape, dtype, device or file so a user can act on them.

use crate::{DType, Device};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("shape mismatch in {op}: {lhs:?} vs {rhs:?}")]
    ShapeMismatch { op: &'static str, lhs: Vec<usize>, rhs: Vec<usize> },

    #[error("cannot broadcast {from:?} to {to:?}")]
    Broadcast { from: Vec<usize>, to: Vec<usize> },

    #[error("{op}: {msg}")]
    Shape { op: &'static str, msg: String },

    #[error("dtype mismatch in {op}: {lhs:?} vs {rhs:?}")]
    DTypeMismatch { op: &'static str, lhs: DType, rhs: DType },

    #[error("{op} does not support dtype {dtype:?}")]
    UnsupportedDType { op: &'static str, dtype: DType },

    #[error("device mismatch in {op}: {lhs} vs {rhs}")]
    DeviceMismatch { op: &'static str, lhs: Device, rhs: Device },

    #[error("{op}: dim {dim} out of range for a tensor of rank {rank}")]
    DimOutOfRange { op: &'static str, dim: isize, rank: usize },

    #[error("{op}: index {index} out of range for size {size}")]
    IndexOutOfRange { op: &'static str, index: i64, size: usize },

    #[error("{op}: expected {expected} elements, got {got}")]
    ElementCount { op: &'static str, expected: usize, got: usize },

    /// A shape whose element count (or byte count) does not fit: `elem_count` would wrap, or the
    /// tensor would need more than `isize::MAX` bytes. Raised before anything is allocated.
    #[error("{op}: shape {shape:?} is too large: {why}")]
    SizeOverflow { op: &'static str, shape: Vec<usize>, why: String },

    #[error("{op} needs a tensor of a single element, got shape {shape:?}")]
    NotAScalar { op: &'static str, shape: Vec<usize> },

    #[error("backward: {0}")]
    Backward(String),

    #[error("CUDA is not available: {reason}")]
    CudaUnavailable { reason: String },

    #[error("CUDA device {ordinal} not found: {visible} device(s) visible")]
    CudaDeviceNotFound { ordinal: usize, visible: usize },

    #[error(
        "CUDA out of memory: tried to allocate {requested} bytes; device has {free} free of {total}; \
         ferrograd holds {allocated} allocated in {reserved} reserved. {hint}"
    )]
    OutOfMemory { requested: usize, free: usize, total: usize, allocated: usize, reserved: usize, hint: String },

    /// Host (CPU) memory: a planned run or one allocation that cannot fit. `available` and
    /// `total` are what the machine (or its cgroup limit) reports, when it reports anything.
    #[error("host out of memory: {what} needs {} but {}", crate::host::human_bytes(*requested), crate::host::describe_room(*available, *total))]
    HostOutOfMemory { what: String, requested: usize, available: Option<usize>, total: Option<usize> },

    /// A value that must be finite is NaN or infinite (a loaded weight, a data file).
    #[error("{what}: element {index} is {value} (not finite)")]
    NonFinite { what: String, index: usize, value: f64 },

    /// Training met a loss that is NaN or infinite and stopped.
    #[error("loss is {loss} at step {step} (epoch {epoch}): training stopped{hint}")]
    NonFiniteLoss { step: u64, epoch: usize, loss: f64, hint: String },

    #[error("CUDA error: {0}")]
    Cuda(String),

    #[error(
        "{call} is not allowed while capturing a CUDA graph (it would make the host wait for the device, \
         reach the driver's allocator, or cannot be recorded); the capture was ended and the device keeps working"
    )]
    GraphCapture { call: &'static str },

    /// A cuDNN call failed: the call, cuDNN's status code and its message.
    #[error("cuDNN {call} failed (status {status}): {msg}")]
    Cudnn { call: String, status: i32, msg: String },

    /// libcudnn (9.x) cannot be loaded here.
    #[error("cuDNN is not available: {reason}")]
    CudnnUnavailable { reason: String },

    #[error("kernel {name}: {msg}")]
    Kernel { name: String, msg: String },

    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    #[error("{path}: {msg}")]
    File { path: String, msg: String },

    #[error(transparent)]
    Io(#[from] std::io::Error),

    /// An error of the multi-GPU layer (`ferrograd-dist`: NCCL, rendezvous, a peer that failed),
    /// carried through APIs that return this type; downcast to `ferrograd_dist::DistError`.
    #[error(transparent)]
    Distributed(Box<dyn std::error::Error + Send + Sync + 'static>),
}

pub type Result<T> = std::result::Result<T, Error>;

/// Shorthand for an `Error::Shape` with a formatted message.
#[macro_export]
macro_rules! shape_err {
    ($op:expr, $($arg:tt)*) => { $crate::Error::Shape { op: $op, msg: format!($($arg)*) } };
}
