//! Pipeline schedules: which forward and backward passes each stage runs, in which order.
//!
//! A model cut into `p * v` chunks (virtual stages) runs chunk `c` on stage `c % p`: one chunk
//! per stage for GPipe and 1F1B, `v` for interleaved 1F1B. A global batch is split into `m`
//! micro-batches. Each stage's list of [`Action`]s is its whole step; sends never wait for the
//! receiver (kiln's transports queue them), so a schedule runs exactly when every action's
//! inputs are produced by actions that themselves run: [`Schedule::simulate`] checks that by
//! playing the schedule out, and names the stage and micro-batch that would wait forever.

use crate::PipeError;
use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;

/// A schedule's kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScheduleKind {
    /// All forwards, then all backwards (Huang et al. 2019): every micro-batch's activations are
    /// alive at once.
    GPipe,
    /// One forward, one backward (PipeDream-flush, Narayanan et al. 2021): the same bubble as
    /// GPipe, at most `p - stage` micro-batches' activations alive on a stage.
    OneFOneB,
    /// 1F1B over `chunks` chunks per stage (Megatron-LM's interleaved schedule): the bubble
    /// divided by `chunks`, for `chunks` times the point-to-point messages. Needs the
    /// micro-batches to be a multiple of the stages.
    Interleaved {
        /// Chunks (virtual stages) per stage, at least 2.
        chunks: usize,
    },
}

impl ScheduleKind {
    /// Chunks per stage.
    pub fn chunks(self) -> usize {
        match self {
            ScheduleKind::Interleaved { chunks } => chunks,
            _ => 1,
        }
    }
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ScheduleKind::GPipe => f.write_str("gpipe"),
            ScheduleKind::OneFOneB => f.write_str("1f1b"),
            ScheduleKind::Interleaved { chunks } => write!(f, "interleaved:{chunks}"),
        }
    }
}

impl FromStr for ScheduleKind {
    type Err = PipeError;

    /// `gpipe`, `1f1b` or `interleaved:V`.
    fn from_str(s: &str) -> Result<Self, PipeError> {
        let bad = || {
            PipeError::Config(format!(
                "unknown schedule {s:?}: expected gpipe, 1f1b or interleaved:V (V >= 2 chunks per stage)"
            ))
        };
        match s {
            "gpipe" => Ok(ScheduleKind::GPipe),
            "1f1b" => Ok(ScheduleKind::OneFOneB),
            _ => {
                let v = s.strip_prefix("interleaved:").ok_or_else(bad)?;
                let chunks: usize = v.parse().map_err(|_| bad())?;
                if chunks < 2 {
                    return Err(bad());
                }
                Ok(ScheduleKind::Interleaved { chunks })
            }
        }
    }
}

/// One pass of one micro-batch through one chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// Forward: receive the chunk's input from the previous chunk's stage (or read the
    /// micro-batch's tokens, for chunk 0), run, send the output on (or compute the loss, for
    /// the last chunk).
    Forward {
        /// The micro-batch.
        mb: usize,
        /// The chunk (global index, `0..p * v`).
        chunk: usize,
    },
    /// Backward: receive the gradient of the chunk's output (or start from the loss), run
    /// backward, send the gradient of the input back.
    Backward {
        /// The micro-batch.
        mb: usize,
        /// The chunk (global index).
        chunk: usize,
    },
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Action::Forward { mb, chunk } => {
                write!(f, "forward of micro-batch {mb} (chunk {chunk})")
            }
            Action::Backward { mb, chunk } => {
                write!(f, "backward of micro-batch {mb} (chunk {chunk})")
            }
        }
    }
}

/// Every stage's actions for one step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    kind: Option<ScheduleKind>,
    stages: usize,
    chunks: usize,
    microbatches: usize,
    actions: Vec<Vec<Action>>,
}

/// A schedule played out with given costs (see [`Schedule::simulate`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Timeline {
    /// When the last action ends.
    pub makespan: f64,
    /// Per stage: time spent computing.
    pub busy: Vec<f64>,
    /// Per stage: the most micro-batch chunks whose forward ran and backward has not (their
    /// activations are alive).
    pub peak_in_flight: Vec<usize>,
}

impl Timeline {
    /// The idle share of the stages' time: `1 - Σ busy / (p · makespan)`.
    pub fn bubble(&self) -> f64 {
        let p = self.busy.len() as f64;
        1.0 - self.busy.iter().sum::<f64>() / (p * self.makespan)
    }
}

impl Schedule {
    /// The schedule `kind` for `stages` stages and `microbatches` micro-batches.
    ///
    /// # Errors
    /// No stage or micro-batch; interleaved with micro-batches not a multiple of the stages.
    pub fn new(
        kind: ScheduleKind,
        stages: usize,
        microbatches: usize,
    ) -> Result<Schedule, PipeError> {
        let (p, m, v) = (stages, microbatches, kind.chunks());
        if p == 0 || m == 0 {
            return Err(PipeError::Config(format!(
                "a pipeline needs at least one stage and one micro-batch (got {p} stages, {m} micro-batches)"
            )));
        }
        if v > 1 && !m.is_multiple_of(p) {
            return Err(PipeError::Config(format!(
                "the interleaved schedule sends micro-batches round the stages in groups of {p}: \
                 {m} micro-batches is not a multiple of {p} stages"
            )));
        }
        let actions = (0..p)
            .map(|stage| match kind {
                ScheduleKind::GPipe => gpipe(stage, p, m),
                ScheduleKind::OneFOneB => one_f_one_b(stage, p, m),
                ScheduleKind::Interleaved { chunks } => interleaved(stage, p, m, chunks),
            })
            .collect();
        let schedule = Schedule {
            kind: Some(kind),
            stages: p,
            chunks: v,
            microbatches: m,
            actions,
        };
        schedule.simulate(1.0, 2.0)?;
        Ok(schedule)
    }

    /// A schedule given action by action (per stage), checked: every micro-batch's forward and
    /// backward of every chunk exactly once, on the chunk's stage, in an order that runs.
    ///
    /// # Errors
    /// A missing, repeated or misplaced action, or an order in which some stage would wait
    /// forever (named: the stage, and the pass it waits in).
    pub fn custom(
        stages: usize,
        chunks: usize,
        microbatches: usize,
        actions: Vec<Vec<Action>>,
    ) -> Result<Schedule, PipeError> {
        if actions.len() != stages || stages == 0 || chunks == 0 || microbatches == 0 {
            return Err(PipeError::Config(format!(
                "a schedule for {stages} stages needs one action list per stage (got {})",
                actions.len()
            )));
        }
        let schedule = Schedule {
            kind: None,
            stages,
            chunks,
            microbatches,
            actions,
        };
        schedule.simulate(1.0, 2.0)?;
        Ok(schedule)
    }

    /// The kind, unless given by hand.
    pub fn kind(&self) -> Option<ScheduleKind> {
        self.kind
    }

    /// Stages (p).
    pub fn stages(&self) -> usize {
        self.stages
    }

    /// Chunks per stage (v).
    pub fn chunks_per_stage(&self) -> usize {
        self.chunks
    }

    /// All chunks (p · v).
    pub fn chunks(&self) -> usize {
        self.stages * self.chunks
    }

    /// Micro-batches per step (m).
    pub fn microbatches(&self) -> usize {
        self.microbatches
    }

    /// The stage that runs chunk `chunk`.
    pub fn stage_of(&self, chunk: usize) -> usize {
        chunk % self.stages
    }

    /// Stage `stage`'s actions, in order.
    pub fn actions(&self, stage: usize) -> &[Action] {
        &self.actions[stage]
    }

    /// The idle share in theory, with a backward twice a forward and no communication cost:
    /// `(p - 1) / (v m + p - 1)`, (p-1)/(m+p-1) for GPipe and 1F1B.
    pub fn ideal_bubble(&self) -> f64 {
        let (p, m, v) = (
            self.stages as f64,
            self.microbatches as f64,
            self.chunks as f64,
        );
        (p - 1.0) / (v * m + p - 1.0)
    }

    /// Plays the schedule out with every chunk's forward taking `forward` and backward
    /// `backward` (a stage's work is divided among its chunks), communication free.
    ///
    /// # Errors
    /// The schedule is not a valid one (see [`custom`](Schedule::custom)).
    pub fn simulate(&self, forward: f64, backward: f64) -> Result<Timeline, PipeError> {
        let v = self.chunks as f64;
        self.simulate_with(|a| match a {
            Action::Forward { .. } => forward / v,
            Action::Backward { .. } => backward / v,
        })
    }

    /// Plays the schedule out with each pass taking `cost(pass)`, communication free: with the
    /// passes' measured times ([`PipeStats::passes`](crate::PipeStats::passes)), the timeline
    /// this schedule would have on stages that cost what these did, so that a measured bubble
    /// can be told apart into the stages' imbalance and the pipeline's own overhead.
    ///
    /// # Errors
    /// The schedule is not a valid one (see [`custom`](Schedule::custom)).
    pub fn simulate_with(&self, cost: impl Fn(&Action) -> f64) -> Result<Timeline, PipeError> {
        let (p, n, m) = (self.stages, self.chunks(), self.microbatches);
        // Each action exactly once, on its chunk's stage.
        let mut seen = HashMap::new();
        for (stage, actions) in self.actions.iter().enumerate() {
            for a in actions {
                let (Action::Forward { mb, chunk } | Action::Backward { mb, chunk }) = *a;
                if mb >= m || chunk >= n {
                    return Err(PipeError::Schedule(format!(
                        "stage {stage}: {a} is out of range ({m} micro-batches, {n} chunks)"
                    )));
                }
                if chunk % p != stage {
                    return Err(PipeError::Schedule(format!(
                        "stage {stage}: {a} belongs to stage {}",
                        chunk % p
                    )));
                }
                if seen.insert(*a, stage).is_some() {
                    return Err(PipeError::Schedule(format!(
                        "stage {stage}: {a} appears twice"
                    )));
                }
            }
        }
        for mb in 0..m {
            for chunk in 0..n {
                for a in [
                    Action::Forward { mb, chunk },
                    Action::Backward { mb, chunk },
                ] {
                    if !seen.contains_key(&a) {
                        return Err(PipeError::Schedule(format!(
                            "stage {}: the {a} is missing",
                            chunk % p
                        )));
                    }
                }
            }
        }
        // Play it: each stage runs its next action once that action's inputs exist.
        let mut done: HashMap<Action, f64> = HashMap::new();
        let mut next = vec![0usize; p];
        let mut clock = vec![0.0f64; p];
        let mut busy = vec![0.0f64; p];
        let mut alive = vec![0usize; p];
        let mut peak = vec![0usize; p];
        loop {
            let mut progressed = false;
            for stage in 0..p {
                while let Some(a) = self.actions[stage].get(next[stage]) {
                    let ready = match *a {
                        Action::Forward { mb, chunk } => {
                            if chunk == 0 {
                                Some(0.0)
                            } else {
                                done.get(&Action::Forward {
                                    mb,
                                    chunk: chunk - 1,
                                })
                                .copied()
                            }
                        }
                        Action::Backward { mb, chunk } => {
                            let own = done.get(&Action::Forward { mb, chunk }).copied();
                            let after = if chunk + 1 == n {
                                Some(0.0)
                            } else {
                                done.get(&Action::Backward {
                                    mb,
                                    chunk: chunk + 1,
                                })
                                .copied()
                            };
                            own.zip(after).map(|(a, b)| a.max(b))
                        }
                    };
                    let Some(ready) = ready else { break };
                    let start = clock[stage].max(ready);
                    clock[stage] = start + cost(a);
                    busy[stage] += cost(a);
                    done.insert(*a, clock[stage]);
                    match a {
                        Action::Forward { .. } => {
                            alive[stage] += 1;
                            peak[stage] = peak[stage].max(alive[stage]);
                        }
                        Action::Backward { .. } => alive[stage] -= 1,
                    }
                    next[stage] += 1;
                    progressed = true;
                }
            }
            if (0..p).all(|s| next[s] == self.actions[s].len()) {
                break;
            }
            if !progressed {
                let stuck = (0..p)
                    .find(|&s| next[s] < self.actions[s].len())
                    .expect("some stage is not done");
                let a = self.actions[stuck][next[stuck]];
                let waits = match a {
                    Action::Forward { mb, chunk } => format!(
                        "the activation of micro-batch {mb} from chunk {} (stage {})",
                        chunk - 1,
                        (chunk - 1) % p
                    ),
                    Action::Backward { mb, chunk }
                        if done.contains_key(&Action::Forward { mb, chunk }) =>
                    {
                        format!(
                            "the gradient of micro-batch {mb} from chunk {} (stage {})",
                            chunk + 1,
                            (chunk + 1) % p
                        )
                    }
                    Action::Backward { mb, .. } => {
                        format!("its own forward of micro-batch {mb}, which comes later")
                    }
                };
                return Err(PipeError::Schedule(format!(
                    "the schedule deadlocks: stage {stuck} waits in its {a} for {waits}, which never comes"
                )));
            }
        }
        Ok(Timeline {
            makespan: clock.iter().cloned().fold(0.0, f64::max),
            busy,
            peak_in_flight: peak,
        })
    }
}

/// All forwards, then all backwards, in micro-batch order.
fn gpipe(stage: usize, _p: usize, m: usize) -> Vec<Action> {
    let f = (0..m).map(|mb| Action::Forward { mb, chunk: stage });
    let b = (0..m).map(|mb| Action::Backward { mb, chunk: stage });
    f.chain(b).collect()
}

/// `p - 1 - stage` warm-up forwards, then one forward and one backward in turn, then the
/// remaining backwards.
fn one_f_one_b(stage: usize, p: usize, m: usize) -> Vec<Action> {
    let warmup = (p - 1 - stage).min(m);
    let f = |mb| Action::Forward { mb, chunk: stage };
    let b = |mb| Action::Backward { mb, chunk: stage };
    let mut out: Vec<Action> = (0..warmup).map(f).collect();
    for i in 0..m - warmup {
        out.push(f(warmup + i));
        out.push(b(i));
    }
    out.extend((m - warmup..m).map(b));
    out
}

/// Megatron-LM's interleaved 1F1B: a stage's `m · v` forwards go round its chunks in groups of
/// `p` micro-batches (chunk 0 for micro-batches 0..p, chunk 1 for the same, ..., then the next
/// `p`), backwards likewise from the last chunk; `2 (p - 1 - stage) + (v - 1) p` forwards warm
/// the pipeline up.
fn interleaved(stage: usize, p: usize, m: usize, v: usize) -> Vec<Action> {
    let total = m * v;
    let at = |k: usize, forward: bool| {
        let local = (k % (p * v)) / p;
        let local = if forward { local } else { v - 1 - local };
        let mb = (k / (p * v)) * p + k % p;
        let chunk = local * p + stage;
        if forward {
            Action::Forward { mb, chunk }
        } else {
            Action::Backward { mb, chunk }
        }
    };
    let warmup = (2 * (p - 1 - stage) + (v - 1) * p).min(total);
    let mut out: Vec<Action> = (0..warmup).map(|k| at(k, true)).collect();
    for i in 0..total - warmup {
        out.push(at(warmup + i, true));
        out.push(at(i, false));
    }
    out.extend((total - warmup..total).map(|k| at(k, false)));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_schedule_runs_and_has_the_textbook_bubble() {
        for p in [1, 2, 3, 4, 8] {
            for m in [1, 2, 4, 8, 16] {
                for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
                    let s = Schedule::new(kind, p, m).unwrap();
                    let t = s.simulate(1.0, 2.0).unwrap();
                    let ideal = (p - 1) as f64 / (m + p - 1) as f64;
                    assert!(
                        (t.bubble() - ideal).abs() < 1e-9,
                        "{kind} p={p} m={m}: {}",
                        t.bubble()
                    );
                    let most = *t.peak_in_flight.iter().max().unwrap();
                    match kind {
                        ScheduleKind::GPipe => assert_eq!(most, m),
                        _ => assert_eq!(most, p.min(m), "{kind} p={p} m={m}"),
                    }
                }
            }
        }
    }

    #[test]
    fn interleaving_divides_the_bubble() {
        for p in [2, 4] {
            for m in [p, 2 * p, 4 * p] {
                for v in [2, 3, 4] {
                    let kind = ScheduleKind::Interleaved { chunks: v };
                    let s = Schedule::new(kind, p, m).unwrap();
                    let t = s.simulate(1.0, 2.0).unwrap();
                    let one = Schedule::new(ScheduleKind::OneFOneB, p, m)
                        .unwrap()
                        .simulate(1.0, 2.0)
                        .unwrap();
                    assert!(
                        t.bubble() < one.bubble(),
                        "p={p} m={m} v={v}: {} vs 1F1B {}",
                        t.bubble(),
                        one.bubble()
                    );
                    // Megatron's analysis: the bubble is (p-1)/v of a micro-batch's time.
                    assert!(
                        (t.bubble() - s.ideal_bubble()).abs() < 0.02,
                        "p={p} m={m} v={v}: {} vs {}",
                        t.bubble(),
                        s.ideal_bubble()
                    );
                }
            }
        }
    }

    #[test]
    fn passes_of_unequal_cost_play_out_as_by_hand() {
        // 1F1B, 2 stages, 4 micro-batches; stage 1 costs 1.5x stage 0. Stage 1 is the
        // bottleneck: it starts after stage 0's first forward (1), computes without a gap
        // (4 x 4.5), and stage 0's last backward (2) follows: 21.
        let s = Schedule::new(ScheduleKind::OneFOneB, 2, 4).unwrap();
        let t = s
            .simulate_with(|a| match *a {
                Action::Forward { chunk, .. } => [1.0, 1.5][chunk],
                Action::Backward { chunk, .. } => [2.0, 3.0][chunk],
            })
            .unwrap();
        assert_eq!(t.makespan, 21.0);
        assert_eq!(t.busy, vec![12.0, 18.0]);
        assert!((t.bubble() - (1.0 - 30.0 / 42.0)).abs() < 1e-12);
        // The same costs on both stages give the textbook bubble.
        let even = s.simulate_with(|a| match a {
            Action::Forward { .. } => 1.0,
            Action::Backward { .. } => 2.0,
        });
        assert!((even.unwrap().bubble() - s.ideal_bubble()).abs() < 1e-12);
    }

    #[test]
    fn a_wrong_schedule_names_the_stage_and_micro_batch() {
        // Stage 0 waits for micro-batch 0's gradient, which stage 1 computes only after a forward
        // of micro-batch 1 that stage 0 sends after that gradient.
        let f = |mb, chunk| Action::Forward { mb, chunk };
        let b = |mb, chunk| Action::Backward { mb, chunk };
        let err = Schedule::custom(
            2,
            1,
            2,
            vec![
                vec![f(0, 0), b(0, 0), f(1, 0), b(1, 0)],
                vec![f(0, 1), f(1, 1), b(0, 1), b(1, 1)],
            ],
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("deadlocks"), "{err}");
        assert!(
            err.contains("stage 0") && err.contains("micro-batch 0"),
            "{err}"
        );
        let err = Schedule::custom(2, 1, 1, vec![vec![f(0, 0), b(0, 0)], vec![f(0, 1)]])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("stage 1: the backward of micro-batch 0 (chunk 1) is missing"),
            "{err}"
        );
        let err = Schedule::custom(
            2,
            1,
            1,
            vec![vec![f(0, 0), b(0, 0), f(0, 1)], vec![f(0, 1), b(0, 1)]],
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("belongs to stage 1"), "{err}");
    }

    #[test]
    fn bad_shapes_are_named() {
        let err = Schedule::new(ScheduleKind::Interleaved { chunks: 2 }, 4, 6).unwrap_err();
        assert!(
            err.to_string()
                .contains("6 micro-batches is not a multiple of 4 stages")
        );
        assert!("interleaved:1".parse::<ScheduleKind>().is_err());
        assert_eq!("interleaved:3".parse::<ScheduleKind>().unwrap().chunks(), 3);
        assert!("2f2b".parse::<ScheduleKind>().is_err());
    }
}
