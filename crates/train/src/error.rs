//! kiln-train's errors: what is wrong, named, with the numbers.
//!
//! A variant that wraps another error says what failed and exposes the cause as its
//! [`source`](std::error::Error::source), without repeating it in its own message: printing the
//! chain (anyhow's `{:#}`, as the `kiln` command does) shows each part once.

use kiln_comm::CommError;
use kiln_hf::HfError;
use kiln_shard::ShardError;

/// Why a run could not start, continue or save.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TrainError {
    /// The recipe: an unknown key (named), a value of the wrong type, an inconsistent setting.
    #[error("{0}")]
    Recipe(String),
    /// Settings that do not fit the world size (batch, hybrid degree, launcher's world size).
    #[error("{0}")]
    World(String),
    /// The corpus: a missing, non-UTF-8 or too short file.
    #[error("{0}")]
    Data(String),
    /// The model: an unknown kind, an unsupported checkpoint, a vocabulary or length that does not fit.
    #[error("{0}")]
    Model(String),
    /// A snapshot: none to resume, damaged, incomplete, or of another model.
    #[error("{0}")]
    Snapshot(String),
    /// The loss stopped being finite.
    #[error("the loss is {loss} at step {step}: lower train.lr or raise train.grad_clip")]
    Diverged {
        /// The step.
        step: usize,
        /// Its (global) loss.
        loss: f64,
    },
    /// A file or directory that cannot be read or written (the operating system's error is
    /// the source).
    #[error("{what}")]
    Io {
        /// What was being done, with the path.
        what: String,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// A collective failed.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// Sharding the model failed.
    #[error(transparent)]
    Shard(#[from] ShardError),
    /// A Hugging Face checkpoint could not be read or written.
    #[error(transparent)]
    Hf(#[from] HfError),
    /// LoRA adapters: a target matching nothing, a rank that does not fit, an adapter
    /// directory for another base.
    #[error(transparent)]
    Lora(#[from] kiln_lora::LoraError),
    /// A pipeline that does not fit, or a failed exchange between stages.
    #[error(transparent)]
    Pipe(#[from] kiln_pipe::PipeError),
    /// The model could not be made this rank's part of the job (`kiln::parallelize`).
    #[error(transparent)]
    Parallel(#[from] kiln::ParallelError),
    /// One rank's failure, in a run of ranks as threads (its error is the source).
    #[error("rank {rank} failed")]
    Rank {
        /// The rank.
        rank: usize,
        /// Its error.
        #[source]
        source: Box<TrainError>,
    },
}

impl TrainError {
    /// Whether this rank failed only because a peer went away or stopped answering (the root
    /// cause is that peer's own error).
    pub fn is_peer_failure(&self) -> bool {
        let comm = match self {
            TrainError::Comm(c)
            | TrainError::Shard(ShardError::Comm(c))
            | TrainError::Parallel(kiln::ParallelError::Comm(c))
            | TrainError::Parallel(kiln::ParallelError::Shard(ShardError::Comm(c))) => c,
            TrainError::Rank { source, .. } => return source.is_peer_failure(),
            _ => return false,
        };
        matches!(comm, CommError::PeerLost { .. } | CommError::Timeout { .. })
    }
}

/// kiln-train's result.
pub type Result<T, E = TrainError> = std::result::Result<T, E>;

/// `return Err(TrainError::Kind(format!(...)))`.
macro_rules! fail {
    ($kind:ident, $($arg:tt)*) => {
        return Err($crate::TrainError::$kind(format!($($arg)*)))
    };
}
pub(crate) use fail;

/// Names the operation and path of an I/O error.
pub(crate) trait IoContext<T> {
    fn io(self, what: impl FnOnce() -> String) -> Result<T>;
}

impl<T> IoContext<T> for std::io::Result<T> {
    fn io(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|source| TrainError::Io {
            what: what(),
            source,
        })
    }
}
