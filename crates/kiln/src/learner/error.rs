//! What can go wrong before and while a Learner trains under kiln.

use crate::ParallelError;
use kiln_comm::CommError;
use kiln_shard::ShardError;

/// Why kiln cannot train a Learner as asked.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LearnerError {
    /// A setting kiln refuses, named (a pipeline, f16 loss scaling, ...), with the reason.
    #[error("kiln::learner: {0}")]
    Unsupported(String),
    /// A plan or mesh that does not fit the world, or a model that cannot be parallelized.
    #[error("kiln::learner: {0}")]
    Parallel(#[from] ParallelError),
    /// A process group that could not be joined, or a collective that failed.
    #[error("kiln::learner: {0}")]
    Comm(#[from] CommError),
    /// kiln's decorator refused (threads, a collective of its own).
    #[error("kiln::learner: {0}")]
    Shard(#[from] ShardError),
    /// A tensor's values could not be read.
    #[error("kiln::learner: reading a tensor: {0}")]
    Data(String),
    /// The ranks disagree on what they should all do alike (their batches, their options).
    #[error("kiln::learner: the ranks disagree: {0}")]
    Disagree(String),
}
