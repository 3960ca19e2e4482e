//! The errors of the communication layer.

use crate::dtype::DType;
use std::time::Duration;

/// Which collective (or point-to-point operation) a message or an error belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum OpKind {
    /// [`ProcessGroup::all_reduce`](crate::ProcessGroup::all_reduce).
    AllReduce,
    /// [`ProcessGroup::all_gather`](crate::ProcessGroup::all_gather).
    AllGather,
    /// [`ProcessGroup::reduce_scatter`](crate::ProcessGroup::reduce_scatter).
    ReduceScatter,
    /// [`ProcessGroup::broadcast`](crate::ProcessGroup::broadcast).
    Broadcast,
    /// [`ProcessGroup::barrier`](crate::ProcessGroup::barrier).
    Barrier,
    /// [`ProcessGroup::send`](crate::ProcessGroup::send) and [`recv`](crate::ProcessGroup::recv).
    SendRecv,
}

impl OpKind {
    /// Every kind, in a stable order.
    pub const ALL: [OpKind; 6] = [
        OpKind::AllReduce,
        OpKind::AllGather,
        OpKind::ReduceScatter,
        OpKind::Broadcast,
        OpKind::Barrier,
        OpKind::SendRecv,
    ];

    pub(crate) fn code(self) -> u8 {
        self as u8
    }

    pub(crate) fn from_code(code: u8) -> Option<Self> {
        Self::ALL.get(code as usize).copied()
    }

    /// The snake_case name, as in the method names.
    pub fn name(self) -> &'static str {
        match self {
            OpKind::AllReduce => "all_reduce",
            OpKind::AllGather => "all_gather",
            OpKind::ReduceScatter => "reduce_scatter",
            OpKind::Broadcast => "broadcast",
            OpKind::Barrier => "barrier",
            OpKind::SendRecv => "send/recv",
        }
    }
}

impl std::fmt::Display for OpKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Where a failing operation stood: the collective, its sequence number and the group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpContext {
    /// The operation.
    pub kind: OpKind,
    /// Its sequence number in the group (0 for the first collective), or the p2p message count.
    pub seq: u64,
    /// The group's name.
    pub group: String,
    /// This rank's index in the group.
    pub rank: usize,
    /// The group's size.
    pub world_size: usize,
}

impl std::fmt::Display for OpContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} #{} on group '{}' (rank {} of {})",
            self.kind, self.seq, self.group, self.rank, self.world_size
        )
    }
}

/// An error of the communication layer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CommError {
    /// A peer did not send what this rank waited for within the timeout.
    #[error("{op}: timed out after {timeout:?} waiting for {}", peer_name(*.peer))]
    Timeout {
        /// The operation that waited.
        op: OpContext,
        /// The rank (in the group) that never answered.
        peer: usize,
        /// The timeout in force.
        timeout: Duration,
    },
    /// A peer's connection closed or its thread ended before it sent what this rank waited for.
    #[error("{op}: lost rank {peer}: {reason}")]
    PeerLost {
        /// The operation that was under way.
        op: OpContext,
        /// The rank (in the group) that went away.
        peer: usize,
        /// What the transport saw.
        reason: String,
    },
    /// Ranks called different collectives, or the same one with different arguments.
    #[error(
        "{op}: mismatched collective: this rank called {expected} but rank {peer} called {found}"
    )]
    Mismatch {
        /// This rank's operation.
        op: OpContext,
        /// The peer whose message disagreed.
        peer: usize,
        /// What this rank called.
        expected: String,
        /// What the peer called.
        found: String,
    },
    /// The arguments of a call are inconsistent on this rank alone.
    #[error("{op}: {message}")]
    InvalidArgument {
        /// The operation.
        op: OpContext,
        /// What is wrong, with the numbers.
        message: String,
    },
    /// A buffer's element type differs from what the call needs.
    #[error("{op}: element type mismatch: {a} vs {b}")]
    DTypeMismatch {
        /// The operation.
        op: OpContext,
        /// One buffer's type.
        a: DType,
        /// The other's.
        b: DType,
    },
    /// An earlier collective on this group failed; the group cannot be used any more.
    #[error("group '{group}' is unusable after an earlier failure: {first}")]
    Poisoned {
        /// The group's name.
        group: String,
        /// The first failure, as text.
        first: String,
    },
    /// The launch configuration is incomplete or inconsistent.
    #[error("configuration: {0}")]
    Config(String),
    /// Setting up the group (rendezvous, connections) failed.
    #[error("setup: {0}")]
    Setup(String),
    /// The rendezvous store failed.
    #[error("rendezvous store at {addr}: {message}")]
    Store {
        /// The store's address.
        addr: String,
        /// What went wrong.
        message: String,
    },
    /// An asynchronous collective could not run or report back ([`CommQueue`](crate::CommQueue)).
    #[error("communication queue of group '{group}': {message}")]
    Queue {
        /// The queue's group.
        group: String,
        /// What happened.
        message: String,
    },
    /// CUDA or NCCL is unavailable or returned an error.
    #[error("nccl: {0}")]
    Nccl(String),
    /// The MPI library reported an error (feature `mpi`).
    #[error("mpi: {0}")]
    Mpi(String),
    /// An I/O error outside any collective (the operating system's error is the source).
    #[error("{context}")]
    Io {
        /// What was being done.
        context: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
}

/// "rank N", or "a peer" where the transport cannot tell which (`usize::MAX`: NCCL and MPI
/// collectives wait on the whole group).
fn peer_name(peer: usize) -> String {
    if peer == usize::MAX {
        "a peer".into()
    } else {
        format!("rank {peer}")
    }
}

/// The result type of this crate.
pub type Result<T, E = CommError> = std::result::Result<T, E>;

/// The error of a real group handed a shape-only buffer ([`BufRef::Shape`](crate::BufRef)):
/// only a simulated group (`kiln plan`'s) takes them.
pub fn shape_buffer(backend: &str, group: &str) -> CommError {
    CommError::Config(format!(
        "a shape-only buffer (a job simulated on shapes, kiln plan) reached the {backend} group \
         '{group}': only a simulated group takes them"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_collective_sequence_and_group() {
        let err = CommError::Timeout {
            op: OpContext {
                kind: OpKind::AllReduce,
                seq: 7,
                group: "world".into(),
                rank: 1,
                world_size: 4,
            },
            peer: 0,
            timeout: Duration::from_secs(3),
        };
        assert_eq!(
            err.to_string(),
            "all_reduce #7 on group 'world' (rank 1 of 4): timed out after 3s waiting for rank 0"
        );
    }

    #[test]
    fn op_kind_codes_round_trip() {
        for k in OpKind::ALL {
            assert_eq!(OpKind::from_code(k.code()), Some(k));
        }
    }
}
