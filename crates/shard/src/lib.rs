//! kiln's sharding decorator: DDP and ZeRO-1/2/3 (FSDP) for any Burn model, with budgeted
//! rematerialisation, mixed precision and LoRA weights as features of the same decorator.
//!
//! `Shard<B>` wraps an inner backend. A user writes `Autodiff<Shard<B>>` (or, through the
//! facade, `Autodiff<Kiln<Flex>>`) where they wrote `Autodiff<Flex>`, builds their model as
//! usual and calls [`shard()`] once:
//!
//! - float tensors are [`ShardTensor`]s: whole (`Local`), this rank's shard of a flattened
//!   tensor (`Sharded`), or a value a feature defers (`Deferred`), always reporting the logical
//!   shape;
//! - elementwise ops on shards run shard by shard; whole-tensor reductions reduce locally, then
//!   all-reduce; every other op gathers its sharded inputs, runs on the inner backend, and drops
//!   the gathered copy (the forwarding of all 418 ops methods is generated);
//! - under `Autodiff`, each parameter's gradient is reduced the moment it is final (burn's
//!   `distributed` hook), in buckets: all-reduced for DDP and ZeRO-1, reduce-scattered for
//!   ZeRO-2/3, so under ZeRO-2/3 whole-model gradients never coexist;
//! - Burn's stock optimizers then run unchanged on shards (Adam/AdamW are elementwise);
//!   [`ShardedOptimizer`] slices replicated parameters before the step and gathers them after
//!   for ZeRO-1/2.
//!
//! Every collective must be reached by every rank: anything that reads a sharded tensor
//! (validation, metrics, saving) runs on all ranks.
//!
//! # Layers
//!
//! ```text
//! step, measurement   step.rs  check.rs  pieces.rs  threads.rs        one training step; parity; snapshot pieces
//!        |
//! strategies          strategy/  shard  hook  reduce  sync  prefetch  optim  state  stats
//!        |
//! features            features/  zero | remat | precision | lowrank | account   (none imports another)
//!        |
//! core                core/  backend  tensor  ops/*  scope  dtype  host  error
//! ```
//!
//! Imports run down only; `kiln-tests`' `layers` test fails on one that runs up or across
//! features, and on any import circle between files.
#![warn(missing_docs)]

pub mod check;
pub mod core;
pub mod features;
pub mod pieces;
mod step;
pub mod strategy;
pub mod threads;

/// Per-rank memory and traffic: the accounting feature, and what a model's strategy moved.
pub mod account {
    pub use crate::features::account::*;
    pub use crate::strategy::stats::{comm_stats, prefetch_stats};
}

pub use crate::core::backend::Shard;

/// The training stack over the inner backend `B`: `Autodiff` over kiln's decorator, with
/// autodiff's checkpointing strategy `C` (none by default, or Burn's op-level
/// `BalancedCheckpointing`). The one alias every kiln crate uses (the facade re-exports it).
pub type Train<B, C = burn::backend::autodiff::checkpoint::strategy::NoCheckpointing> =
    burn::backend::Autodiff<Shard<B>, C>;
pub use crate::core::error::ShardError;
pub use crate::core::scope::local_reads;
pub use crate::core::tensor::{Deferred, ShardOps, ShardTensor, Sharded, ViewOp, WeightGrad};
pub use features::zero::View;
pub use features::{lowrank, precision, remat, tp};
pub use precision::{LossScale, Precision, autocast};
pub use step::{Passes, StepConfig, StepStats, step, step_with};
pub use strategy::buffers::{buffer_paths, sync_buffers};
pub use strategy::config::{BufferPolicy, InitSync, ShardConfig, Strategy};
pub use strategy::optim::{ShardedOptimizer, clip_grad_norm, grad_norm, scale_grads};
pub use strategy::prefetch::PrefetchStats;
pub use strategy::shard::{
    ShardGroups, backward, gather_model, no_sync, optimizer_state_group, reduce_gradients, release,
    remark, shard, shard_over, with_batch_statistics,
};
pub use strategy::tp::{Style as TpStyle, TpPlan, TpReport, tensor_parallel};
