//! A pipeline's bubble over a run: what each stage computed and waited, step after step, and
//! the idle share of the schedule beside two references: the textbook's, for stages of equal
//! cost, and the schedule replayed with the passes' measured times, for stages that cost what
//! these do. Measured against replayed is the pipeline's own overhead (hand-overs, waking a
//! stage, copies); replayed against textbook is the cut (stages of unequal cost).

use crate::{Action, PipeError, PipeStats, Pipeline};
use kiln_comm::{BufMut, BufRef};

/// One stage's [`PipeStats`] summed over steps (add every step that should count; the first
/// step of a run is usually left out: it allocates what later steps reuse).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Tally {
    steps: usize,
    compute: f64,
    waiting: f64,
    wall: f64,
    /// Each pass's summed seconds, in the order the stage runs them.
    passes: Vec<(Action, f64)>,
}

impl Tally {
    /// Adds one step's figures.
    ///
    /// # Panics
    /// If the step ran other passes than the steps before it (another schedule).
    pub fn add(&mut self, step: &PipeStats) {
        if self.steps == 0 {
            self.passes = step.passes.iter().map(|(a, _)| (*a, 0.0)).collect();
        }
        assert!(
            self.passes.len() == step.passes.len()
                && self
                    .passes
                    .iter()
                    .zip(&step.passes)
                    .all(|(a, b)| a.0 == b.0),
            "a pipeline tally adds steps of one schedule"
        );
        for (sum, (_, d)) in self.passes.iter_mut().zip(&step.passes) {
            sum.1 += d.as_secs_f64();
        }
        self.steps += 1;
        self.compute += step.compute.as_secs_f64();
        self.waiting += step.waiting.as_secs_f64();
        self.wall += step.wall.as_secs_f64();
    }

    /// The steps added.
    pub fn steps(&self) -> usize {
        self.steps
    }
}

/// One stage's mean figures per step, in seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StageTimes {
    /// Forward and backward passes.
    pub compute: f64,
    /// Waiting for a neighbour's activation or gradient.
    pub waiting: f64,
    /// The schedule's time on the stage, from its first pass to its last.
    pub wall: f64,
}

/// A pipeline's bubble over the steps of a [`Tally`], on every stage alike.
#[derive(Debug, Clone, PartialEq)]
pub struct Bubble {
    /// The idle share measured: `1 - Σ compute / (p · the longest stage's schedule time)`,
    /// from the stages' mean step.
    pub measured: f64,
    /// `(p-1)/(v·m + p-1)`: the schedule's for stages of equal cost, communication free.
    pub textbook: f64,
    /// The schedule played out with each pass taking its mean measured time, communication
    /// free ([`Schedule::simulate_with`](crate::Schedule::simulate_with)).
    pub replayed: f64,
    /// Per stage, in stage order.
    pub stages: Vec<StageTimes>,
    /// The steps measured.
    pub steps: usize,
}

impl Pipeline {
    /// The bubble of the steps in every stage's `tally`: a collective over the stage group
    /// (every stage calls it, with tallies of the same steps), returning the same on every stage.
    ///
    /// # Errors
    /// The stage group's all-gather failed, or a stage tallied no step or other steps.
    pub fn bubble(&self, tally: &Tally) -> Result<Bubble, PipeError> {
        let schedule = self.schedule();
        let p = schedule.stages();
        let n = self.schedule().actions(self.stage()).len();
        let ours = schedule.actions(self.stage()).iter();
        if tally.steps == 0
            || tally.passes.len() != n
            || !ours.eq(tally.passes.iter().map(|p| &p.0))
        {
            return Err(PipeError::Config(format!(
                "stage {}: a bubble needs a tally of this pipeline's steps ({} steps of {} passes, \
                 expected {n} passes a step)",
                self.stage(),
                tally.steps,
                tally.passes.len()
            )));
        }
        // Every stage runs 2·m·v passes, so the rows are of one length: steps, compute,
        // waiting, wall, then each pass's sum (f64 bits: the group carries i64 exactly).
        let mut mine = vec![tally.steps as f64, tally.compute, tally.waiting, tally.wall];
        mine.extend(tally.passes.iter().map(|(_, s)| *s));
        let bits: Vec<i64> = mine.iter().map(|v| v.to_bits() as i64).collect();
        let mut all = vec![0i64; bits.len() * p];
        self.group()
            .all_gather(BufRef::I64(&bits), BufMut::I64(&mut all))
            .map_err(|source| PipeError::Comm {
                stage: self.stage(),
                what: "gathering the stages' pass times".into(),
                source: Box::new(source),
            })?;
        let rows: Vec<Vec<f64>> = all
            .chunks(bits.len())
            .map(|r| r.iter().map(|&b| f64::from_bits(b as u64)).collect())
            .collect();
        if rows.iter().any(|r| r[0] != rows[0][0]) {
            let counts: Vec<f64> = rows.iter().map(|r| r[0]).collect();
            return Err(PipeError::Config(format!(
                "the stages tallied different numbers of steps: {counts:?}"
            )));
        }
        let steps = tally.steps as f64;
        let stages: Vec<StageTimes> = rows
            .iter()
            .map(|r| StageTimes {
                compute: r[1] / steps,
                waiting: r[2] / steps,
                wall: r[3] / steps,
            })
            .collect();
        // Each stage's passes in its schedule order, as its row lists them.
        let mut took = std::collections::HashMap::new();
        for (stage, row) in rows.iter().enumerate() {
            for (action, sum) in schedule.actions(stage).iter().zip(&row[4..]) {
                took.insert(*action, sum / steps);
            }
        }
        let replayed = schedule.simulate_with(|a| took[a])?.bubble();
        let makespan = stages.iter().map(|s| s.wall).fold(0.0, f64::max);
        let busy: f64 = stages.iter().map(|s| s.compute).sum();
        Ok(Bubble {
            measured: 1.0 - busy / (p as f64 * makespan),
            textbook: schedule.ideal_bubble(),
            replayed,
            stages,
            steps: tally.steps,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{PipelineConfig, ScheduleKind, Split};
    use burn::module::Module;
    use burn::nn::{Linear, LinearConfig};
    use burn::tensor::backend::Backend;
    use kiln_comm::{GroupOptions, LocalGroup, run_ranks};
    use kiln_hf::{Carry, Staged, Unit};
    use std::ops::Range;
    use std::sync::Arc;
    use std::time::Duration;

    /// Two units; the test runs no pass through them.
    #[derive(Module, Debug)]
    struct Two<B: Backend> {
        a: Linear<B>,
        b: Linear<B>,
    }

    impl<B: Backend> Staged<B> for Two<B> {
        fn units(&self) -> Vec<Unit> {
            vec![Unit::new("a", &["a"]), Unit::new("b", &["b"])]
        }
        fn forward_units(&self, _: Range<usize>, _: Carry<B>) -> Carry<B> {
            unreachable!("the bubble is computed from given pass times")
        }
    }

    #[test]
    fn the_stages_times_are_gathered_and_replayed() {
        // 1F1B, 2 stages, 4 micro-batches; stage 1's passes cost 1.5x stage 0's (ms): the
        // schedule's bubble for these stages is 1 - 30/42 (`passes_of_unequal_cost_play_out_as_
        // by_hand`), the textbook's 1/5.
        let bubbles = run_ranks(LocalGroup::new_world(2, GroupOptions::default()), |group| {
            let device = Default::default();
            let model = Two::<kiln::Flex> {
                a: LinearConfig::new(2, 2).init(&device),
                b: LinearConfig::new(2, 2).init(&device),
            };
            let config = PipelineConfig {
                stages: 2,
                microbatches: 4,
                schedule: ScheduleKind::OneFOneB,
                split: Split::Balanced,
            };
            let (pipe, _) = Pipeline::new(model, Arc::new(group), &config).unwrap();
            let stage = pipe.stage();
            let ms = |x: f64| Duration::from_secs_f64(x / 1e3);
            let passes: Vec<(Action, Duration)> = pipe
                .schedule()
                .actions(stage)
                .iter()
                .map(|a| match a {
                    Action::Forward { .. } => (*a, ms([1.0, 1.5][stage])),
                    Action::Backward { .. } => (*a, ms([2.0, 3.0][stage])),
                })
                .collect();
            let step = PipeStats {
                compute: passes.iter().map(|p| p.1).sum(),
                waiting: ms([9.0, 1.0][stage]),
                wall: ms([21.0, 19.0][stage]),
                sent: 0,
                passes,
            };
            let mut tally = Tally::default();
            assert!(pipe.bubble(&tally).is_err(), "no step tallied");
            tally.add(&step);
            tally.add(&step);
            pipe.bubble(&tally).unwrap()
        });
        for b in &bubbles {
            assert_eq!(b, &bubbles[0], "every stage gets the same");
        }
        let b = &bubbles[0];
        assert_eq!(b.steps, 2);
        assert!((b.textbook - 0.2).abs() < 1e-12);
        assert!((b.replayed - (1.0 - 30.0 / 42.0)).abs() < 1e-9, "{b:?}");
        // Busy 12 + 18 ms over 2 stages x the longer schedule (21 ms).
        assert!((b.measured - (1.0 - 30.0 / 42.0)).abs() < 1e-9, "{b:?}");
        assert!((b.stages[1].compute - 0.018).abs() < 1e-9);
        assert!((b.stages[0].waiting - 0.009).abs() < 1e-9);
        assert!((b.stages[1].wall - 0.019).abs() < 1e-9);
    }
}
