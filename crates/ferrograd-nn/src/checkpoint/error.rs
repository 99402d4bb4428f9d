//! What can be wrong with a checkpoint file. Every variant names the file and, where one is to
//! blame, the tensor or metadata key; loading never panics on bad bytes.

use ferrograd_core::DType;

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },

    #[error("{path}: not a valid safetensors file: {msg}")]
    Corrupt { path: String, msg: String },

    #[error(
        "{path}: truncated: tensor {name} needs bytes {start}..{end} of the data section, which holds {available}"
    )]
    Truncated { path: String, name: String, start: u64, end: u64, available: u64 },

    #[error("{path}: tensor {name} is missing")]
    Missing { path: String, name: String },

    #[error("{path}: tensor {name} is not part of the model or optimizer being loaded")]
    Unexpected { path: String, name: String },

    #[error("{path}: tensor {name} has shape {got:?}, expected {expected:?}")]
    Shape { path: String, name: String, expected: Vec<usize>, got: Vec<usize> },

    #[error("{path}: tensor {name} has dtype {got}, expected {expected}")]
    DType { path: String, name: String, expected: DType, got: String },

    #[error("{path}: tensor {name} holds {value} at element {index} (not finite)")]
    NonFinite { path: String, name: String, index: usize, value: f64 },

    #[error("{path}: metadata {key}: {msg}")]
    Metadata { path: String, key: String, msg: String },

    #[error(transparent)]
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
