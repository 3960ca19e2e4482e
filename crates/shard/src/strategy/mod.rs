//! The strategies: which of a model's parameters, gradients and optimizer state each rank holds,
//! and when the ranks talk.
//!
//! | strategy | parameters between steps | gradients | optimizer state | talks | where |
//! | --- | --- | --- | --- | --- | --- |
//! | DDP | whole | all-reduced (averaged) in buckets during backward | whole | backward | `hook.rs`, `reduce.rs` |
//! | ZeRO-1 | whole | reduce-scattered once, when backward ends | this rank's slice | backward end; all-gather of parameters after the step | `hook.rs`, `optim.rs` |
//! | ZeRO-2 | whole | reduce-scattered in buckets during backward | this rank's slice | backward; all-gather after the step | `hook.rs`, `optim.rs` |
//! | ZeRO-3 (FSDP) | this rank's shard | reduce-scattered during backward | this rank's slice | every use of a parameter (gather, prefetched in the last step's order), backward | `shard.rs`, `prefetch.rs`, `hook.rs` |
//! | hybrid (HSDP) | shard within a group of `shard_size` ranks | reduce-scattered in the group, all-reduced across groups | the group's slice | as ZeRO-3, plus the all-reduce across | `shard.rs`, `reduce.rs` |
//!
//! Every strategy starts in [`shard`](shard::shard) (`shard.rs`): shapes checked and weights made
//! equal across ranks (`sync.rs`), parameters marked for the gradient hook and registered
//! (`state.rs`), sharded where the strategy says. `optim.rs` is the optimizer's side
//! ([`ShardedOptimizer`](optim::ShardedOptimizer), global-norm clipping); `buffers.rs` keeps
//! buffers (BatchNorm's running statistics) whole and equal across ranks; `stats.rs` what a
//! model's strategy did.
//!
//! This layer sits on the core and the features (ZeRO's gathers and views, precision), never the
//! other way round: a shard carries its own gather (`ShardOps`), and a parameter's shard carries
//! its model's prefetcher weakly (`prefetch::Tagged`), so the core never looks a model up.

pub mod buffers;
pub mod config;
pub(crate) mod hook;
pub mod optim;
pub(crate) mod params;
pub mod prefetch;
pub(crate) mod reduce;
pub mod shard;
pub(crate) mod state;
pub mod stats;
pub(crate) mod sync;
pub mod tp;
