//! kiln: train any Burn model the way large models are trained.
pub use kiln_comm as comm;
