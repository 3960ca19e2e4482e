//! The core: the decorator backend and its float tensor, the forwarding of every Burn ops
//! method, and the per-thread scope. It names no feature: whole tensors, shards and one
//! [`Deferred`](tensor::Deferred) kind behind a trait are all it knows, and features plug in
//! through its traits ([`Deferred`](tensor::Deferred), [`ShardOps`](tensor::ShardOps),
//! [`Recorder`](ops::Recorder)) and the scope's fields.

pub mod backend;
#[cfg(feature = "cuda")]
pub mod device;
pub mod dtype;
pub mod error;
pub mod host;
pub mod ops;
pub mod scope;
pub mod tensor;
