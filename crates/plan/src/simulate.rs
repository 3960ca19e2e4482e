//! Running a recipe's training job on shapes: one rank per role, three steps.

use crate::group::{Event, Sim, SimGroup, What, mark_compute_thread, record, take_events};
use crate::shapes::{Shapes, ShapesDevice, reset_work};
use kiln_comm::{GroupOptions, LocalGroup, ProcessGroup};
use kiln_train::report::Silent;
use kiln_train::{Recipe, RunOptions, TrainError, train_rank_with};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What the simulation of one rank gave.
#[derive(Debug, Clone)]
pub struct RoleRun {
    /// The global rank simulated.
    pub rank: usize,
    /// Its pipeline stage.
    pub stage: usize,
    /// Its memory in its most demanding step (from kiln's own counters).
    pub memory: kiln_train::RankMemory,
    /// Its events, from the start of the measured step to its end.
    pub events: Vec<Event>,
}

/// What the simulation of a job gave.
#[derive(Debug, Clone)]
pub struct Simulated {
    /// Ranks of the job.
    pub world: usize,
    /// One run per role (per pipeline stage), in stage order.
    pub roles: Vec<RoleRun>,
    /// How long the simulation took.
    pub elapsed: Duration,
    /// Tensor parallelism's counts of rank 0's last step (when `parallel.tp > 1`).
    pub tensor_parallel: Option<kiln_shard::tp::TpStats>,
}

/// The steps simulated: the first warms up (lazy state: optimizer moments, buffers), the
/// second starts ZeRO-3's prefetch where the group has communication threads (it replays the
/// step before's order), the last is measured (memory: the worst step, as `kiln train`
/// reports it). On NCCL (no prefetch) the second step is already the steady state.
pub fn steps(backend: &str) -> usize {
    match backend {
        "nccl" => 2,
        _ => 3,
    }
}

fn observe(begin: bool) {
    record(match begin {
        true => What::StepBegin,
        false => What::StepEnd,
    });
}

/// Runs `recipe`'s job (its world: `parallel.world_size`, else `parallel.ranks`) on shapes,
/// `per_node` ranks to a node, its groups behaving as `backend`'s (`local`, `tcp` or `nccl`),
/// simulating the first rank of each pipeline stage.
///
/// # Errors
/// The recipe's own errors (a layout that does not divide, a model that cannot be built), and
/// an op the shape backend cannot run, by name.
pub fn simulate(
    recipe: &Recipe,
    per_node: usize,
    backend: &'static str,
) -> Result<Simulated, TrainError> {
    let started = Instant::now();
    let world = match recipe.parallel.world_size {
        0 => recipe.parallel.ranks,
        w => w,
    };
    recipe.check_world(world, false)?;
    kiln_shard::account::observe_steps(observe);
    let mut recipe = recipe.clone();
    recipe.parallel.ranks = world;
    recipe.parallel.world_size = 0;
    recipe.train.steps = steps(backend);
    recipe.train.eval_every = 0;
    recipe.train.sample_chars = 0;
    recipe.output.snapshot_every = 0;
    recipe.output.memory_snapshot_every = 0;
    let out = std::env::temp_dir().join(format!(
        "kiln-plan-{}-{}",
        std::process::id(),
        started.elapsed().as_nanos()
    ));
    recipe.output.dir = out.clone();

    let stages = recipe.parallel.pp.max(1);
    let per_stage = world / stages;
    let simulated: Vec<usize> = (0..stages).map(|s| s * per_stage).collect();
    let sim = Arc::new(Sim {
        simulated: simulated.clone(),
        role: (0..world).map(|r| (r / per_stage) * per_stage).collect(),
        per_node: per_node.max(1),
        backend,
    });
    for &r in &simulated {
        reset_work(r);
        take_events(r);
    }
    let locals = LocalGroup::new_world(simulated.len(), GroupOptions::default());
    kiln_shard::account::set_shapes_only(true);
    let recipe = &recipe;
    let results: Vec<Result<kiln_train::Summary, TrainError>> = std::thread::scope(|s| {
        let handles: Vec<_> = locals
            .into_iter()
            .zip(&simulated)
            .map(|(local, &rank)| {
                let sim = sim.clone();
                s.spawn(move || {
                    mark_compute_thread();
                    let local: Arc<dyn ProcessGroup> = Arc::new(local);
                    let group = SimGroup::world(sim, rank, local);
                    let options = RunOptions {
                        overwrite: true,
                        steps_only: true,
                        ..RunOptions::default()
                    };
                    train_rank_with::<Shapes>(
                        recipe,
                        Arc::new(group),
                        false,
                        options,
                        &ShapesDevice,
                        &mut Silent,
                    )
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| match h.join() {
                Ok(r) => r,
                Err(panic) => Err(TrainError::Model(format!(
                    "kiln plan: the shape-only backend could not run this job: {}",
                    panic_text(&panic)
                ))),
            })
            .collect()
    });
    kiln_shard::account::set_shapes_only(false);
    let _ = std::fs::remove_dir_all(&out);
    if results.iter().any(Result::is_err) {
        return Err(kiln_train::rank_zero_or_root_cause(results).expect_err("a rank failed"));
    }
    let summaries: Vec<kiln_train::Summary> = results.into_iter().flatten().collect();
    let mut roles = Vec::new();
    for (stage, (&rank, summary)) in simulated.iter().zip(&summaries).enumerate() {
        let memory = summary.memory.get(rank).copied().ok_or_else(|| {
            TrainError::World(
                "kiln plan: no memory was counted (the program's global allocator must be \
                 kiln_shard::account::RankAlloc)"
                    .into(),
            )
        })?;
        let events = measured_step(take_events(rank));
        roles.push(RoleRun {
            rank,
            stage,
            memory,
            events,
        });
    }
    Ok(Simulated {
        world,
        roles,
        elapsed: started.elapsed(),
        tensor_parallel: summaries[0].tensor_parallel.clone(),
    })
}

/// The events of the last step (from its begin to its end, both kept).
fn measured_step(events: Vec<Event>) -> Vec<Event> {
    let begin = events
        .iter()
        .rposition(|e| e.what == What::StepBegin)
        .unwrap_or(0);
    let end = events[begin..]
        .iter()
        .position(|e| e.what == What::StepEnd)
        .map_or(events.len(), |i| begin + i + 1);
    events[begin..end].to_vec()
}

fn panic_text(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "a panic".into())
}
