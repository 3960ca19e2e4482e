//! The Backend ops traits for [`Shard`](crate::Shard).
//!
//! `forward.rs` is generated (see `codegen/generate.py`): every method forwards to the inner
//! backend, float tensors going through the policies of `policy.rs`: shard-local for
//! elementwise ops, gather-then-compute for the rest. `custom.rs` holds the exceptions
//! (creation, reading, whole-tensor reductions, ops that need only a shape).

pub(crate) mod custom;
mod fast;
mod forward;
pub(crate) mod policy;

#[cfg(test)]
mod coverage;
