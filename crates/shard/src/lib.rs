//! kiln's sharding decorator: DDP and ZeRO-1/2/3 (FSDP) for any Burn model.
//!
//! `Shard<B>` wraps an inner backend. A user writes `Autodiff<Shard<Flex>>` (or, through the
//! facade, `Autodiff<Kiln<Flex>>`) where they wrote `Autodiff<Flex>`, builds their model as
//! usual and calls [`shard()`] once:
//!
//! - float tensors are [`ShardTensor`]s: whole (`Local`) or this rank's shard of a flattened
//!   tensor (`Sharded`), always reporting the logical shape;
//! - elementwise ops on shards run shard by shard; whole-tensor reductions reduce locally, then
//!   all-reduce; every other op gathers its sharded inputs, runs on the inner backend, and drops
//!   the gathered copy (the policies are in `ops/policy.rs`, the forwarding of all 418 ops
//!   methods is generated);
//! - under `Autodiff`, each parameter's gradient is reduced the moment it is final (burn's
//!   `distributed` hook), in buckets: all-reduced for DDP and ZeRO-1, reduce-scattered for
//!   ZeRO-2/3, so under ZeRO-2/3 whole-model gradients never coexist;
//! - Burn's stock optimizers then run unchanged on shards (Adam/AdamW are elementwise);
//!   [`ShardedOptimizer`] slices replicated parameters before the step and gathers them after
//!   for ZeRO-1/2.
//!
//! Every collective must be reached by every rank: anything that reads a sharded tensor
//! (validation, metrics, saving) runs on all ranks.
#![warn(missing_docs)]

pub mod account;
mod backend;
pub mod check;
#[cfg(feature = "cuda")]
pub mod device;
mod hook;
pub mod lowrank;
#[cfg(feature = "cuda")]
mod on_device;
mod ops;
mod optim;
pub mod pieces;
pub mod precision;
mod prefetch;
pub mod remat;
mod state;
mod step;
mod strategy;
mod sync;
mod tensor;
pub mod threads;

pub use backend::Shard;
pub use optim::{ShardedOptimizer, clip_grad_norm, grad_norm, scale_grads};
pub use precision::{LossScale, Precision, autocast};
pub use prefetch::PrefetchStats;
pub use state::{InitSync, ShardConfig, ShardError, Strategy, local_reads};
pub use step::{Passes, StepConfig, StepStats, step, step_with};
pub use strategy::{
    backward, gather_model, no_sync, optimizer_state_group, reduce_gradients, release, remark,
    shard,
};
pub use tensor::{ShardTensor, Sharded, View, ViewOp};
