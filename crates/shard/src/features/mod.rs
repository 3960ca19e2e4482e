//! Features beside the core, each depending on the core only and never on one another:
//!
//! | feature | what it adds | how it plugs in |
//! | --- | --- | --- |
//! | [`zero`] | gathering flat shards; layout ops on shards deferred as views | `ShardOps` (every shard carries one), `Deferred` (the view) |
//! | [`remat`] | activations given up under a memory budget and recomputed | `Recorder` (in the scope), `Deferred` (the handle) |
//! | [`precision`] | mixed precision: autocast, loss scaling, the backend probe | the scope's precision policy |
//! | [`lowrank`] | LoRA weights used by `Linear` without being formed | `Deferred` (the weight), the core's deferred weight gradient |
//! | [`tp`] | tensor parallelism: tensors split over the tp group, rules that keep them split | `Deferred` (the part) |
//! | [`account`] | per-rank memory by kind: allocators, step measurements | the scope's allocation tag and per-rank counters |

pub mod account;
pub mod lowrank;
pub mod precision;
pub mod remat;
pub mod tp;
pub mod zero;
