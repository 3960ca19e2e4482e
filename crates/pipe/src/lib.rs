//! kiln's pipeline parallelism: a model cut into stages on different ranks, a global batch cut
//! into micro-batches that fill the pipeline, scheduled GPipe, 1F1B or interleaved 1F1B, and
//! composed with data parallelism (DDP, ZeRO-1/2/3, hybrid) on the other axis of the mesh.
//!
//! # Design
//! A pipeline needs the order in which a model's parts run; kiln asks the model for it rather
//! than tracing it: a [`Staged`](kiln_model::Staged) model lists its units (for kiln's GPT-2 and
//! Llama: the embedding, each block, the head) and runs any contiguous range of them. This is
//! DeepSpeed's `PipelineModule` idea (a layer list) with the model's own code; the model's
//! `forward` is the chain of all its units, so one device and the pipeline compute the same
//! function. (Running every op of any model through the backend decorator, placing ops by the
//! stage of their parameters, would need the shape of every op's output without computing it,
//! for all of Burn's ~400 ops; kiln does not do that.)
//!
//! - [`Placement`]: units cut into `p · v` contiguous chunks, balanced by parameter count or at
//!   named units; chunk `c` on stage `c % p`.
//! - [`Schedule`]: each stage's forwards and backwards of (micro-batch, chunk), checked by
//!   playing it out before it runs: a schedule that would wait forever is an error naming the
//!   stage and micro-batch.
//! - [`Pipeline`]: every rank builds the whole model, then keeps only its stage's parameters
//!   (the others become empty placeholders, before sharding); [`Pipeline::step`] runs the
//!   schedule, sending activations and gradients between stages through the stage group's
//!   `send`/`recv`, and then takes the one kiln step ([`kiln_shard::step_with`]): gradients
//!   reduced over the data-parallel group, the norm summed over the stages, clipping, the
//!   optimizer.
//! - Parameters read by units on several stages (a head tied to the embedding) live on each
//!   such stage: their gradients are summed on the first before reduction, and the first's
//!   updated values copied to the others after the step (Megatron's tied embeddings).
//!
//! # Limits
//! - Between units flows one `[batch, seq, d]` tensor; masks and positions are rebuilt per unit.
//! - A model is pipelined only if it implements [`Staged`](kiln_model::Staged).
//! - Sends must not wait for the receiver. kiln's groups all keep that promise, NCCL's
//!   included (its sends are queued, `kiln_comm::Outbox`); the pipeline tests also run over
//!   [`RendezvousGroup`](kiln_comm::RendezvousGroup), whose channels have NCCL's semantics.
//!   Stage-to-stage tensors travel through host memory, on GPUs too.
#![warn(missing_docs)]

mod bubble;
mod mailbox;
mod measure;
mod pipeline;
pub mod placement;
pub mod schedule;

pub use bubble::{Bubble, StageTimes, Tally};
pub use measure::measure_costs;
pub use pipeline::{PipeStats, Pipeline, PipelineConfig, SHARDED_STAGE_THREADS};
pub use placement::{Placement, Split};
pub use schedule::{Action, Schedule, ScheduleKind, Timeline};

/// What can go wrong in a pipeline.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PipeError {
    /// The pipeline's shape does not fit the model, the batch or the group.
    #[error("pipeline: {0}")]
    Config(String),
    /// A schedule that is incomplete, misplaced or would deadlock.
    #[error("pipeline schedule: {0}")]
    Schedule(String),
    /// A send or receive between stages failed.
    #[error("pipeline stage {stage}: {what}: {source}")]
    Comm {
        /// This rank's stage.
        stage: usize,
        /// What it was sending or waiting for.
        what: String,
        /// The group's error.
        #[source]
        source: Box<kiln_comm::CommError>,
    },
    /// A peer sent something that is not a pipeline message.
    #[error("pipeline: {0}")]
    Protocol(String),
    /// A collective of the step (the gradient norm over the stages) failed.
    #[error(transparent)]
    Shard(#[from] kiln_shard::ShardError),
}
