//! One error type for the whole library. Every fallible path returns `Result<T>`; user input never
//! panics. Messages name the offending shape, dtype, device or file so a user can act on them.

use crate::{DType, Device};

/// Everything that can go wrong in ferrograd-core (and, through [`Error::Distributed`], above it).
///
/// The `op` fields name the public function that failed (`"matmul"`, `"add"`, `"narrow"`, ...), so
/// the message points at the call in the user's code. Match on the variant to handle a class of
/// failure (for example [`Error::OutOfMemory`] to retry with a smaller batch).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Two operands whose shapes must agree do not (for example matmul's inner dimensions).
    #[error("shape mismatch in {op}: {lhs:?} vs {rhs:?}")]
    ShapeMismatch {
        /// The operation.
        op: &'static str,
        /// The left operand's shape.
        lhs: Vec<usize>,
        /// The right operand's shape.
        rhs: Vec<usize>,
    },

    /// A shape that NumPy's broadcasting rules cannot stretch to the target shape.
    #[error("cannot broadcast {from:?} to {to:?}")]
    Broadcast {
        /// The operand's shape.
        from: Vec<usize>,
        /// The shape it had to become.
        to: Vec<usize>,
    },

    /// Any other invalid shape for an operation; `msg` says what was expected.
    #[error("{op}: {msg}")]
    Shape {
        /// The operation.
        op: &'static str,
        /// What is wrong with the shape.
        msg: String,
    },

    /// Operands of different dtypes: ferrograd never promotes implicitly; cast with `to_dtype`.
    #[error("dtype mismatch in {op}: {lhs:?} vs {rhs:?}")]
    DTypeMismatch {
        /// The operation.
        op: &'static str,
        /// The left operand's dtype.
        lhs: DType,
        /// The right operand's dtype.
        rhs: DType,
    },

    /// The operation is not defined for this dtype (for example `exp` on an integer tensor).
    #[error("{op} does not support dtype {dtype:?}")]
    UnsupportedDType {
        /// The operation.
        op: &'static str,
        /// The dtype it was given.
        dtype: DType,
    },

    /// Operands on different devices: ferrograd never copies implicitly; move with `to_device`.
    #[error("device mismatch in {op}: {lhs} vs {rhs}")]
    DeviceMismatch {
        /// The operation.
        op: &'static str,
        /// The left operand's device.
        lhs: Device,
        /// The right operand's device.
        rhs: Device,
    },

    /// A dimension index outside `-rank..rank`.
    #[error("{op}: dim {dim} out of range for a tensor of rank {rank}")]
    DimOutOfRange {
        /// The operation.
        op: &'static str,
        /// The dimension asked for (negative counts from the end).
        dim: isize,
        /// The tensor's rank.
        rank: usize,
    },

    /// An index (in `index_select`, `gather`, an embedding lookup, a target class, ...) outside
    /// `0..size`.
    #[error("{op}: index {index} out of range for size {size}")]
    IndexOutOfRange {
        /// The operation.
        op: &'static str,
        /// The index given.
        index: i64,
        /// The size of the dimension it indexes.
        size: usize,
    },

    /// A buffer (`from_vec`, file data) whose element count does not match the shape.
    #[error("{op}: expected {expected} elements, got {got}")]
    ElementCount {
        /// The operation.
        op: &'static str,
        /// The element count the shape needs.
        expected: usize,
        /// The element count given.
        got: usize,
    },

    /// A shape whose element count (or byte count) does not fit: `elem_count` would wrap, or the
    /// tensor would need more than `isize::MAX` bytes. Raised before anything is allocated.
    #[error("{op}: shape {shape:?} is too large: {why}")]
    SizeOverflow {
        /// The operation.
        op: &'static str,
        /// The shape asked for.
        shape: Vec<usize>,
        /// Which limit it passes.
        why: String,
    },

    /// A one-element tensor was needed (`item`).
    #[error("{op} needs a tensor of a single element, got shape {shape:?}")]
    NotAScalar {
        /// The operation.
        op: &'static str,
        /// The shape given.
        shape: Vec<usize>,
    },

    /// A backward pass cannot run: an op on the path is not differentiable, or a fused op's
    /// record is inconsistent (saved tensors or inputs missing); the message names the op.
    #[error("backward: {0}")]
    Backward(String),

    /// No usable CUDA driver or device; `reason` says which library or call failed.
    #[error("CUDA is not available: {reason}")]
    CudaUnavailable {
        /// Why CUDA cannot be used here.
        reason: String,
    },

    /// `Device::Cuda(ordinal)` names a GPU that is not visible to this process.
    #[error("CUDA device {ordinal} not found: {visible} device(s) visible")]
    CudaDeviceNotFound {
        /// The ordinal asked for.
        ordinal: usize,
        /// How many devices the driver reports (after `CUDA_VISIBLE_DEVICES`).
        visible: usize,
    },

    /// A GPU allocation failed even after the caching allocator released its free blocks (or
    /// passed `FERROGRAD_CUDA_MEMORY_LIMIT`). The message carries the allocator's figures.
    #[error(
        "CUDA out of memory: tried to allocate {requested} bytes; device has {free} free of {total}; \
         ferrograd holds {allocated} allocated in {reserved} reserved. {hint}"
    )]
    OutOfMemory {
        /// Bytes of the allocation that failed.
        requested: usize,
        /// Free bytes on the device, as the driver reports them.
        free: usize,
        /// Total bytes on the device.
        total: usize,
        /// Bytes held by live tensors (the caching allocator's `allocated`).
        allocated: usize,
        /// Bytes the caching allocator holds from the driver (`reserved`).
        reserved: usize,
        /// What to try next.
        hint: String,
    },

    /// Host (CPU) memory: a planned run or one allocation that cannot fit. `available` and
    /// `total` are what the machine (or its cgroup limit) reports, when it reports anything.
    #[error("host out of memory: {what} needs {} but {}", crate::host::human_bytes(*requested), crate::host::describe_room(*available, *total))]
    HostOutOfMemory {
        /// What needed the memory.
        what: String,
        /// Bytes needed.
        requested: usize,
        /// Bytes available, if known.
        available: Option<usize>,
        /// Total bytes of the machine or cgroup, if known.
        total: Option<usize>,
    },

    /// A value that must be finite is NaN or infinite (a loaded weight, a data file).
    #[error("{what}: element {index} is {value} (not finite)")]
    NonFinite {
        /// What holds the value (a tensor name, a file).
        what: String,
        /// The flat index of the first non-finite element.
        index: usize,
        /// The value found.
        value: f64,
    },

    /// Training met a loss that is NaN or infinite and stopped.
    #[error("loss is {loss} at step {step} (epoch {epoch}): training stopped{hint}")]
    NonFiniteLoss {
        /// The optimizer step.
        step: u64,
        /// The epoch.
        epoch: usize,
        /// The loss value.
        loss: f64,
        /// What to try next.
        hint: String,
    },

    /// A CUDA driver, cuBLAS or NVRTC call failed; the message names the call.
    #[error("CUDA error: {0}")]
    Cuda(String),

    #[error(
        "{call} is not allowed while capturing a CUDA graph (it would make the host wait for the device, \
         reach the driver's allocator, or cannot be recorded); the capture was ended and the device keeps working"
    )]
    /// A call that cannot run inside CUDA-graph capture was made during one.
    GraphCapture {
        /// The call that was refused.
        call: &'static str,
    },

    /// A cuDNN call failed: the call, cuDNN's status code and its message.
    #[error("cuDNN {call} failed (status {status}): {msg}")]
    Cudnn {
        /// The cuDNN function.
        call: String,
        /// Its status code.
        status: i32,
        /// cuDNN's message for it.
        msg: String,
    },

    /// libcudnn (9.x) cannot be loaded here.
    #[error("cuDNN is not available: {reason}")]
    CudnnUnavailable {
        /// Why it cannot be loaded.
        reason: String,
    },

    /// A CUDA kernel could not be compiled, loaded or launched.
    #[error("kernel {name}: {msg}")]
    Kernel {
        /// The kernel's name.
        name: String,
        /// What failed.
        msg: String,
    },

    /// An argument outside its domain (a negative learning rate, `clamp` with `min > max`, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// A file that cannot be read, parsed or written (checkpoints, token shards, configs).
    #[error("{path}: {msg}")]
    File {
        /// The file's path.
        path: String,
        /// What is wrong with it.
        msg: String,
    },

    /// An I/O error without a more specific context.
    #[error(transparent)]
    Io(#[from] std::io::Error),

    /// An error of the multi-GPU layer (`ferrograd-dist`: NCCL, rendezvous, a peer that failed),
    /// carried through APIs that return this type; downcast to `ferrograd_dist::DistError`.
    #[error(transparent)]
    Distributed(Box<dyn std::error::Error + Send + Sync + 'static>),
}

/// `std::result::Result` with ferrograd's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

/// Shorthand for an `Error::Shape` with a formatted message.
#[macro_export]
macro_rules! shape_err {
    ($op:expr, $($arg:tt)*) => { $crate::Error::Shape { op: $op, msg: format!($($arg)*) } };
}
