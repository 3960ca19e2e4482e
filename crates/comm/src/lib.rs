//! kiln's communication layer.
//!
//! One trait, [`ProcessGroup`], carries every collective kiln needs (all-reduce, all-gather,
//! reduce-scatter, broadcast, send/recv, barrier) for `f32`, `f16`, `bf16` and `i64` buffers.
//! It is implemented by
//! - [`LocalGroup`]: ranks as threads of one process (tests; one process driving several devices),
//! - [`TcpGroup`]: ranks as processes over TCP, with ring algorithms, on one machine or many,
//! - `NcclGroup` (feature `nccl`): GPUs through NCCL, the production path,
//! - `MpiGroup` (feature `mpi`): the processes of an MPI job (`mpirun`, `srun`), through the
//!   system's MPI library: CPU clusters on their fabric.
//!
//! Processes find each other through a small TCP key-value [`store`] hosted by rank 0, configured
//! from torchrun-style, SLURM or Open MPI environment variables ([`LaunchEnv`]); `kiln launch`
//! sets them. A [`DeviceMesh`] splits a group into the sub-groups of each parallel dimension.
//!
//! Every collective has a timeout and detects a dead or mismatched peer: a failure is an error
//! naming the collective, its sequence number and the group, never a hang.
//!
//! ```
//! use kiln_comm::{LocalGroup, ProcessGroup, ReduceOp, shard_range};
//! let shards = kiln_comm::spawn_ranks(3, |group: LocalGroup| {
//!     // Every rank holds the whole gradient; each keeps the averaged shard it owns.
//!     let grad = vec![group.rank() as f32; 10];
//!     let mut shard = vec![0.0; shard_range(10, 3, group.rank()).len()];
//!     group.reduce_scatter((&grad[..]).into(), (&mut shard[..]).into(), ReduceOp::Avg).unwrap();
//!     shard
//! });
//! assert_eq!(shards, [vec![1.0; 4], vec![1.0; 3], vec![1.0; 3]]);
//! ```
#![warn(missing_docs)]

pub mod auth;
pub mod device;
mod dtype;
mod env;
mod error;
mod group;
pub mod hash;
mod join;
mod local;
mod mesh;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "nccl")]
pub mod nccl;
mod outbox;
pub mod progress;
mod rendezvous;
pub mod selftest;
mod shard;
mod stats;
pub mod store;
mod tcp;
pub mod tensor;
mod transport;
mod work;

#[cfg(feature = "cuda")]
pub use device::choose_cuda_device;
pub use device::{DeviceSharing, cuda_ordinal};
pub use dtype::{BufMut, BufRef, DType, Element, OwnedBuf, ReduceOp};
pub use env::{EnvSource, LaunchEnv};
pub use error::{CommError, OpContext, OpKind, Result};
pub use group::{AsAny, DEFAULT_TIMEOUT, GroupOptions, ProcessGroup};
pub use join::{BACKENDS, join};
pub use local::{LocalGroup, run_ranks, spawn_ranks, spawn_ranks_with};
pub use mesh::{DeviceMesh, MeshAxis, MeshGroups, MeshShape};
#[cfg(feature = "mpi")]
pub use mpi::MpiGroup;
#[cfg(feature = "nccl")]
pub use nccl::NcclGroup;
pub use outbox::{Link, OpenLink, Outbox};
pub use rendezvous::{RendezvousGroup, Sends};
pub use shard::{shard_len, shard_range};
pub use stats::{CommStats, Counters, KindStats};
pub use tcp::TcpGroup;
pub use work::{CommQueue, Work};

macro_rules! buf_from {
    ($t:ty) => {
        impl<'a> From<&'a [$t]> for BufRef<'a> {
            fn from(s: &'a [$t]) -> Self {
                <$t as Element>::buf(s)
            }
        }
        impl<'a> From<&'a mut [$t]> for BufMut<'a> {
            fn from(s: &'a mut [$t]) -> Self {
                <$t as Element>::buf_mut(s)
            }
        }
        impl<'a> From<&'a Vec<$t>> for BufRef<'a> {
            fn from(s: &'a Vec<$t>) -> Self {
                <$t as Element>::buf(s)
            }
        }
        impl<'a> From<&'a mut Vec<$t>> for BufMut<'a> {
            fn from(s: &'a mut Vec<$t>) -> Self {
                <$t as Element>::buf_mut(s)
            }
        }
    };
}
buf_from!(f32);
buf_from!(half::f16);
buf_from!(half::bf16);
buf_from!(i64);

pub use half::{bf16, f16};

/// Locks `m`, taking its data even if a thread panicked while holding it: what kiln's groups
/// keep under their locks stays consistent across a panic (a panicking rank poisons its group
/// through its errors, not through the lock).
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
