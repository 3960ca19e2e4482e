//! `kiln plan`: a job's memory per rank, step time and GPU-hour cost before it starts.
//!
//! kiln's own training step runs on [`Shapes`], a Burn backend whose tensors are a shape and a
//! dtype: the real model, strategy, pipeline schedule, tensor-parallel plan, remat budget,
//! precision and LoRA adapters run for any model size in seconds, the decorator's per-rank
//! memory counters fill as in a real step, and the work of every op and the bytes of every
//! collective are counted. One rank of each distinct role is simulated ([`SimGroup`]).

pub mod shapes;

pub use shapes::{Shapes, ShapesDevice, Work};
pub mod group;

pub use group::{Collective, Event, Kind, Sim, SimGroup, What};
pub mod simulate;

pub use simulate::{RoleRun, Simulated, simulate};
pub mod calibrate;
pub mod estimate;
pub mod profile;

pub use estimate::{Cost, Layout, Memory, Plan, RolePlan, cost, estimate};
pub use profile::{Profile, profile};
