//! kiln-shard's errors.

use kiln_comm::CommError;

/// Errors of the sharding decorator.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ShardError {
    /// An inconsistent configuration, with the numbers.
    #[error("sharding configuration: {0}")]
    Config(String),
    /// The ranks hold different models.
    #[error("ranks disagree about the model: {0}")]
    Inconsistent(String),
    /// The inner backend cannot run a precision policy (the backend and dtype named).
    #[error("{0}")]
    Precision(String),
    /// A rank's compute threads could not be set up (an invalid `RAYON_NUM_THREADS`).
    #[error("{0}")]
    Threads(String),
    /// A collective failed.
    #[error(transparent)]
    Comm(#[from] CommError),
}
