//! What a run did ([`Summary`]), and every rank's memory in its most demanding step.

use crate::error::Result;
use kiln_comm::{ProcessGroup, ReduceOp};
use kiln_shard::account::{MemKind, StepMemory};
use std::path::PathBuf;

/// How a run starts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RunOptions {
    /// Continue from the newest snapshot of the run directory.
    pub resume: bool,
    /// Start afresh even if the run directory holds snapshots (they are deleted).
    pub overwrite: bool,
    /// Stop after this step, with a snapshot (a job that must fit a time slot: the next job
    /// resumes). The schedule stays that of `train.steps`.
    pub stop_after: Option<usize>,
    /// A restart of a job (by `kiln launch --max-restarts`): continue from the newest snapshot
    /// if there is one (on disk, or in memory), else start afresh.
    pub restart: bool,
    /// Run the steps and measure them, nothing else: no validation, sample, snapshot or
    /// output, and a pretrained base's weights are not read (`kiln plan` runs a job's steps on
    /// shapes).
    pub steps_only: bool,
}

/// What a rank's run did.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    /// The step the run started from (0, or the resumed snapshot's).
    pub first_step: usize,
    /// The step it ended at.
    pub last_step: usize,
    /// The global training loss of every step run, in order.
    pub losses: Vec<f64>,
    /// The final validation loss.
    pub val_loss: Option<f64>,
    /// Tokens per second over the steps run.
    pub tokens_per_s: f64,
    /// The fraction of this rank's step time spent blocked on collectives (exposed
    /// communication; 0 on one rank).
    pub comm_wait: f64,
    /// The generated sample (prompt included).
    pub sample: Option<String>,
    /// Fine-tuning: the validation loss before the first step (the base's).
    pub val_loss_before: Option<f64>,
    /// Fine-tuning: the base's sample, from the same prompt and seed.
    pub sample_before: Option<String>,
    /// What the run wrote besides snapshots (adapters, a merged model), and where.
    pub outputs: Vec<(String, PathBuf)>,
    /// The newest snapshot written.
    pub snapshot: Option<PathBuf>,
    /// Every rank's memory in its step with the highest heap peak, in rank order (empty when
    /// the global allocator does not count per rank; the `kiln` binary's does).
    pub memory: Vec<RankMemory>,
    /// Steps skipped for gradients that were not finite (f16 loss scaling).
    pub skipped_steps: usize,
    /// The loss scale at the end (f16 only).
    pub loss_scale: Option<f64>,
    /// A pipelined run's bubble, from its second step on (stage group of data-parallel rank
    /// 0 as reported; every stage group computes its own).
    pub bubble: Option<kiln_pipe::Bubble>,
    /// Tensor parallelism's communication in rank 0's last step (with `parallel.tp > 1`).
    pub tensor_parallel: Option<kiln_shard::tp::TpStats>,
}

/// One rank's memory in its most demanding step, beside its optimizer state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankMemory {
    /// The step's measurement ([`kiln_shard::step`]).
    pub step: StepMemory,
    /// Bytes of the rank's optimizer state (its moments; shards count their local part).
    pub optimizer: usize,
}

impl RankMemory {
    const FIELDS: usize = 6 + 5;

    fn to_row(self) -> [i64; Self::FIELDS] {
        let s = self.step;
        let mut row = [0i64; Self::FIELDS];
        let head = [
            s.rank,
            s.params,
            s.grads,
            self.optimizer,
            s.held_before,
            s.peak,
        ];
        for (slot, v) in row
            .iter_mut()
            .zip(head.into_iter().chain(s.peak_above_start))
        {
            *slot = v as i64;
        }
        row
    }

    fn from_row(row: &[i64]) -> RankMemory {
        let u = |i: usize| row[i] as usize;
        RankMemory {
            step: StepMemory {
                rank: u(0),
                params: u(1),
                grads: u(2),
                held_before: u(4),
                peak: u(5),
                peak_above_start: std::array::from_fn(|k| u(6 + k)),
            },
            optimizer: u(3),
        }
    }
}

/// Every rank's [`RankMemory`], on every rank (a collective): `mine` is this rank's.
pub(crate) fn gather_memory(
    group: &dyn ProcessGroup,
    mine: Option<RankMemory>,
) -> Result<Vec<RankMemory>> {
    let counted = i64::from(mine.is_some());
    let mut all_counted = [counted];
    group.all_reduce((&mut all_counted[..]).into(), ReduceOp::Min)?;
    let Some(mine) = mine.filter(|_| all_counted[0] == 1) else {
        return Ok(Vec::new());
    };
    let row = mine.to_row();
    let mut table = vec![0i64; RankMemory::FIELDS * group.world_size()];
    group.all_gather((&row[..]).into(), (&mut table[..]).into())?;
    Ok(table
        .chunks(RankMemory::FIELDS)
        .map(RankMemory::from_row)
        .collect())
}

pub(crate) fn memory_json(m: &RankMemory) -> serde_json::Value {
    let mut v = serde_json::json!({
        "rank": m.step.rank,
        "params": m.step.params,
        "grads": m.step.grads,
        "optimizer": m.optimizer,
        "held_before": m.step.held_before,
        "peak": m.step.peak,
    });
    for kind in MemKind::ALL {
        v[format!("peak_{}", kind.name())] = m.step.peak_of(kind).into();
    }
    v
}
