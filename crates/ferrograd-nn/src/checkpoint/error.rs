//! What can be wrong with a checkpoint file. Every variant names the file and, where one is to
//! blame, the tensor or metadata key; loading never panics on bad bytes.

use ferrograd_core::DType;

/// Why a checkpoint could not be saved or loaded. Converts into [`ferrograd_core::Error`]:
/// `File` naming the path (`NonFinite` for non-finite values; tensor errors pass through).
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// The file cannot be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },

    /// The bytes are not a valid safetensors file.
    #[error("{path}: not a valid safetensors file: {msg}")]
    Corrupt {
        /// The file.
        path: String,
        /// What is wrong.
        msg: String,
    },

    /// A tensor's byte range passes the end of the file.
    #[error(
        "{path}: truncated: tensor {name} needs bytes {start}..{end} of the data section, which holds {available}"
    )]
    Truncated {
        /// The file.
        path: String,
        /// The tensor.
        name: String,
        /// First byte needed (within the data section).
        start: u64,
        /// One past the last byte needed.
        end: u64,
        /// Bytes the data section holds.
        available: u64,
    },

    /// A tensor the model or optimizer needs is not in the file.
    #[error("{path}: tensor {name} is missing")]
    Missing {
        /// The file.
        path: String,
        /// The tensor.
        name: String,
    },

    /// The file holds a tensor the model or optimizer does not have (strict loading).
    #[error("{path}: tensor {name} is not part of the model or optimizer being loaded")]
    Unexpected {
        /// The file.
        path: String,
        /// The tensor.
        name: String,
    },

    /// A tensor's shape differs from the parameter it loads into.
    #[error("{path}: tensor {name} has shape {got:?}, expected {expected:?}")]
    Shape {
        /// The file.
        path: String,
        /// The tensor.
        name: String,
        /// What the model expects.
        expected: Vec<usize>,
        /// What the file holds.
        got: Vec<usize>,
    },

    /// A tensor's dtype differs from the parameter's.
    #[error("{path}: tensor {name} has dtype {got}, expected {expected}")]
    DType {
        /// The file.
        path: String,
        /// The tensor.
        name: String,
        /// What the model expects.
        expected: DType,
        /// What the file holds.
        got: String,
    },

    /// A tensor's dtype is valid safetensors but has no ferrograd dtype (I64, BOOL, F8, ...).
    #[error("{path}: tensor {name} has dtype {dtype}, which ferrograd cannot hold (it has F32, F64, F16, BF16, I32, U32, U8, I8)")]
    Unsupported {
        /// The file.
        path: String,
        /// The tensor.
        name: String,
        /// The file's dtype name.
        dtype: String,
    },

    /// A tensor holds NaN or infinity (refused unless non-finite values are allowed).
    #[error("{path}: tensor {name} holds {value} at element {index} (not finite)")]
    NonFinite {
        /// The file.
        path: String,
        /// The tensor.
        name: String,
        /// Flat index of the first bad element.
        index: usize,
        /// The value found.
        value: f64,
    },

    /// A metadata entry (step, optimizer state, RNG) is missing or malformed.
    #[error("{path}: metadata {key}: {msg}")]
    Metadata {
        /// The file.
        path: String,
        /// The metadata key.
        key: String,
        /// What is wrong.
        msg: String,
    },

    #[error(transparent)]
    /// A tensor operation failed while loading (for example a cast or a copy to the device).
    Tensor(#[from] ferrograd_core::Error),
}

impl CheckpointError {
    /// The tensor this error is about, if any.
    pub fn tensor_name(&self) -> Option<&str> {
        match self {
            CheckpointError::Truncated { name, .. }
            | CheckpointError::Missing { name, .. }
            | CheckpointError::Unexpected { name, .. }
            | CheckpointError::Shape { name, .. }
            | CheckpointError::DType { name, .. }
            | CheckpointError::Unsupported { name, .. }
            | CheckpointError::NonFinite { name, .. } => Some(name),
            _ => None,
        }
    }
}

/// For callers that use core's `Result` throughout (the trainer, the CLI): a core `Error::File`
/// with the same message; a non-finite value stays `Error::NonFinite` so that a caller can tell
/// it apart (the CLI adds what `--allow-nonfinite` does).
impl From<CheckpointError> for ferrograd_core::Error {
    fn from(e: CheckpointError) -> Self {
        if let CheckpointError::NonFinite { path, name, index, value } = e {
            return ferrograd_core::Error::NonFinite { what: format!("{path}: tensor {name}"), index, value };
        }
        let path = match &e {
            CheckpointError::Tensor(_) => String::new(),
            CheckpointError::Io { path, .. }
            | CheckpointError::Corrupt { path, .. }
            | CheckpointError::Truncated { path, .. }
            | CheckpointError::Missing { path, .. }
            | CheckpointError::Unexpected { path, .. }
            | CheckpointError::Shape { path, .. }
            | CheckpointError::DType { path, .. }
            | CheckpointError::Unsupported { path, .. }
            | CheckpointError::NonFinite { path, .. }
            | CheckpointError::Metadata { path, .. } => path.clone(),
        };
        if let CheckpointError::Tensor(inner) = e {
            return inner;
        }
        let msg = e.to_string();
        let msg = msg.strip_prefix(&format!("{path}: ")).map_or_else(|| msg.clone(), str::to_string);
        ferrograd_core::Error::File { path, msg }
    }
}
