//! A pipeline's bubble over a run: what each stage computed and waited, step after step, and
//! the idle share of the schedule beside two references: the textbook's, for stages of equal
//! cost, and the schedule replayed with the passes' measured times, for stages that cost what
//! these do. Measured against replayed is the pipeline's own overhead (hand-overs, waking a
//! stage, copies); replayed against textbook is the cut (stages of unequal cost).

use crate::{Action, PipeError, PipeStats, Pipeline};
use kiln_comm::{BufMut, BufRef};
use std::time::Duration;

/// One stage's [`PipeStats`] of the steps that should count (the first step of a run is
/// usually left out: it allocates what later steps reuse), the latest [`Tally::KEPT`] of them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Tally {
    /// The stage's passes, in the order it runs them.
    actions: Vec<Action>,
    /// Per step: compute, waiting and wall seconds, then each pass's seconds.
    rows: std::collections::VecDeque<Vec<f64>>,
}

impl Tally {
    /// The most steps kept (the latest): a bubble is averaged over at most this many.
    pub const KEPT: usize = 4096;

    /// Adds one step's figures.
    ///
    /// # Panics
    /// If the step ran other passes than the steps before it (another schedule).
    pub fn add(&mut self, step: &PipeStats) {
        if self.rows.is_empty() {
            self.actions = step.passes.iter().map(|(a, _)| *a).collect();
        }
        assert!(
            self.actions.iter().eq(step.passes.iter().map(|(a, _)| a)),
            "a pipeline tally adds steps of one schedule"
        );
        if self.rows.len() == Self::KEPT {
            self.rows.pop_front();
        }
        let times = [step.compute(), step.waiting, step.wall];
        let passes = step.passes.iter().map(|(_, d)| d);
        self.rows.push_back(
            times
                .iter()
                .chain(passes)
                .map(Duration::as_secs_f64)
                .collect(),
        );
    }

    /// The steps kept.
    pub fn steps(&self) -> usize {
        self.rows.len()
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
    /// averaged over the steps.
    pub measured: f64,
    /// `(p-1)/(v·m + p-1)`: the schedule's for stages of equal cost, communication free.
    pub textbook: f64,
    /// The schedule played out with each pass taking the time it took, communication free
    /// ([`Schedule::simulate_with`](crate::Schedule::simulate_with)), averaged over the steps.
    pub replayed: f64,
    /// Per stage, in stage order: the mean step.
    pub stages: Vec<StageTimes>,
    /// The steps measured (the latest [`Tally::KEPT`] at most).
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
        let (p, stage) = (schedule.stages(), self.stage());
        let ours = schedule.actions(stage);
        if tally.rows.is_empty() || tally.actions != ours {
            return Err(PipeError::Config(format!(
                "stage {stage}: a bubble needs a tally of this pipeline's steps ({} steps of {} \
                 passes, expected {} passes a step)",
                tally.rows.len(),
                tally.actions.len(),
                ours.len()
            )));
        }
        let comm = |what: &str, source| PipeError::Comm {
            stage,
            what: what.into(),
            source: Box::new(source),
        };
        let mut counts = vec![0i64; p];
        self.group()
            .all_gather(
                BufRef::I64(&[tally.rows.len() as i64]),
                BufMut::I64(&mut counts),
            )
            .map_err(|e| comm("gathering the stages' step counts", e))?;
        if counts.iter().any(|&c| c != counts[0]) {
            return Err(PipeError::Config(format!(
                "the stages tallied different numbers of steps: {counts:?}"
            )));
        }
        // Every stage runs 2·m·v passes, so all rows are of one length (f64 bits: the group
        // carries i64 exactly).
        let bits: Vec<i64> = tally
            .rows
            .iter()
            .flatten()
            .map(|v| v.to_bits() as i64)
            .collect();
        let mut all = vec![0i64; bits.len() * p];
        self.group()
            .all_gather(BufRef::I64(&bits), BufMut::I64(&mut all))
            .map_err(|e| comm("gathering the stages' pass times", e))?;
        let all: Vec<f64> = all.iter().map(|&b| f64::from_bits(b as u64)).collect();
        let (steps, width) = (tally.rows.len(), 3 + ours.len());
        // Stage s's row of step k.
        let row = |s: usize, k: usize| &all[(s * steps + k) * width..(s * steps + k + 1) * width];
        let (mut measured, mut replayed) = (0.0, 0.0);
        for k in 0..steps {
            let busy: f64 = (0..p).map(|s| row(s, k)[0]).sum();
            let makespan = (0..p).map(|s| row(s, k)[2]).fold(0.0, f64::max);
            measured += 1.0 - busy / (p as f64 * makespan);
            let took: std::collections::HashMap<Action, f64> = (0..p)
                .flat_map(|s| {
                    schedule
                        .actions(s)
                        .iter()
                        .copied()
                        .zip(row(s, k)[3..].iter().copied())
                })
                .collect();
            replayed += schedule.simulate_with(|a| took[a])?.bubble();
        }
        let mean =
            |s: usize, i: usize| (0..steps).map(|k| row(s, k)[i]).sum::<f64>() / steps as f64;
        Ok(Bubble {
            measured: measured / steps as f64,
            textbook: schedule.ideal_bubble(),
            replayed: replayed / steps as f64,
            stages: (0..p)
                .map(|s| StageTimes {
                    compute: mean(s, 0),
                    waiting: mean(s, 1),
                    wall: mean(s, 2),
                })
                .collect(),
            steps,
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
    use kiln_model::{Carry, Staged, Unit};
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
