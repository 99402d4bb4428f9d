//! What can go wrong across processes. Every variant says what to do next: which variable to
//! set, which ranks never arrived, which library was searched for where.

use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum DistError {
    #[error(
        "NCCL was not found (searched: {}). Set FERROGRAD_NCCL_LIBRARY to the path of libnccl.so.2, add its \
         folder to LD_LIBRARY_PATH, or install it (pip install nvidia-nccl-cu13, or the libnccl2 package)",
        .searched.join("; ")
    )]
    NcclNotFound { searched: Vec<String> },

    #[error("NCCL {found} ({path}) is too old: ferrograd needs NCCL 2.10 or newer (for ncclAvg)")]
    NcclTooOld { path: String, found: String },

    #[error("NCCL {op} failed: {msg} (NCCL error {code}; rerun with NCCL_DEBUG=INFO for NCCL's own account)")]
    Nccl { op: &'static str, code: i32, msg: String },

    #[error("{var}={value:?}: {msg}")]
    Env { var: &'static str, value: String, msg: String },

    #[error(
        "rendezvous at {addr} timed out after {:.0} s: rank(s) {missing:?} of {world} never arrived (arrived: \
         {arrived:?}). Check that every rank was started with the same MASTER_ADDR/MASTER_PORT and WORLD_SIZE, \
         or raise FERROGRAD_DIST_TIMEOUT (seconds)",
        .waited.as_secs_f64()
    )]
    RendezvousTimeout { addr: String, world: usize, missing: Vec<usize>, arrived: Vec<usize>, waited: Duration },

    #[error(
        "rendezvous: rank 0 at {addr} did not answer within {:.0} s ({last}). Is rank 0 running, and is \
         MASTER_ADDR an address of its host that this host can reach?",
        .waited.as_secs_f64()
    )]
    RendezvousUnreachable { addr: String, waited: Duration, last: String },

    #[error("rendezvous at {addr}: {msg}")]
    Rendezvous { addr: String, msg: String },

    #[error("{op}: {msg}")]
    Collective { op: &'static str, msg: String },

    #[error(
        "{op} did not finish within {:.0} s: a peer rank has probably died or hung (raise FERROGRAD_DIST_TIMEOUT \
         if a step legitimately takes longer)",
        .waited.as_secs_f64()
    )]
    Timeout { op: String, waited: Duration },

    #[error(transparent)]
    Checkpoint(#[from] ferrograd_nn::checkpoint::CheckpointError),

    #[error(transparent)]
    Core(ferrograd_core::Error),
}

pub type DistResult<T> = std::result::Result<T, DistError>;

impl From<ferrograd_core::Error> for DistError {
    /// A core error that itself carries a `DistError` (it went through an API that returns core's
    /// type) comes back out unwrapped.
    fn from(e: ferrograd_core::Error) -> Self {
        match e {
            ferrograd_core::Error::Distributed(inner) => match inner.downcast::<DistError>() {
                Ok(d) => *d,
                Err(other) => DistError::Core(ferrograd_core::Error::Distributed(other)),
            },
            e => DistError::Core(e),
        }
    }
}

impl From<DistError> for ferrograd_core::Error {
    fn from(e: DistError) -> Self {
        match e {
            DistError::Core(c) => c,
            e => ferrograd_core::Error::Distributed(Box::new(e)),
        }
    }
}

impl From<std::io::Error> for DistError {
    fn from(e: std::io::Error) -> Self {
        DistError::Core(ferrograd_core::Error::Io(e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_survive_a_trip_through_cores_error_type() {
        let e = DistError::Timeout { op: "all_reduce".into(), waited: Duration::from_secs(2) };
        let core: ferrograd_core::Error = e.into();
        assert!(core.to_string().contains("all_reduce did not finish"), "{core}");
        match DistError::from(core) {
            DistError::Timeout { op, .. } => assert_eq!(op, "all_reduce"),
            other => panic!("{other:?}"),
        }
        let plain: ferrograd_core::Error = DistError::Core(ferrograd_core::Error::Backward("x".into())).into();
        assert!(matches!(plain, ferrograd_core::Error::Backward(_)));
    }
}
