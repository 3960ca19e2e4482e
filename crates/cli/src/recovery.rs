//! Recovery without a person: `kiln launch --max-restarts N` (and elastic `--nnodes MIN:MAX`).
//!
//! The launchers of a job meet in a rendezvous of their own, a [`StoreServer`] hosted by node
//! 0's launcher on `--master-port` (the ranks' store, hosted by rank 0, moves to the next
//! port). A start of the job is a *round*: each launcher says it is ready for round `r`, node
//! 0's publishes the round's plan (which nodes, how many ranks each, the ranks' store port),
//! and every launcher starts its ranks with `KILN_RESTART_COUNT=r` and a job token derived
//! for the round (a rank left over from an earlier round cannot join a later one). When a rank
//! fails, or is named hung (`crate::hang`), its launcher stops its ranks and marks the round
//! failed; the others see the mark and stop theirs; all go on to round `r + 1` after a
//! back-off. `kiln train` resumes from the latest complete snapshot when it sees
//! `KILN_RESTART_COUNT` (from step 0 when there is none).
//!
//! Elastic: node 0's launcher waits `--rdzv-timeout` for every node at each round; an elastic
//! job then starts with the nodes that came, as long as they are at least MIN (the ranks are
//! numbered again, the snapshot resharded by `kiln train`). A node that arrives later is
//! admitted at the next restart. Node 0 hosts the rendezvous: a job does not survive losing it.
//!
//! What each launcher measures (from the heartbeats its ranks write, `kiln_comm::progress`):
//! the step reached before each failure, the step the next round resumed from, and the time
//! from the failure to the first step after it. They are logged as they happen and summed up
//! at the end (`--summary FILE` writes them as JSON).

use crate::hang::HangWatch;
use crate::launch_args::LaunchArgs;
use crate::round::{Ended, Event, Program, Round, Verdict, heartbeat_dir, run_round};
use crate::rounds::{Agent, Next, Plan, finish, first_round, join_round, linger, signalled};
use anyhow::{Context, Result};
use std::path::Path;
use std::time::{Duration, Instant};

/// How a round's failure is recorded in the launchers' rendezvous: whether it was a hang,
/// then what happened.
fn failure_mark(why: &str, hang: bool) -> String {
    format!("{}\t{why}", if hang { "hang" } else { "fail" })
}

/// [`failure_mark`] read back: what happened, and whether it was a hang.
fn failure_of(mark: &str) -> (String, bool) {
    match mark.split_once('\t') {
        Some((kind, why)) => (why.to_string(), kind == "hang"),
        None => (mark.to_string(), false),
    }
}

/// A failure and what recovering from it cost.
#[derive(Debug, Clone, serde::Serialize)]
struct Restart {
    /// The round that failed.
    round: usize,
    why: String,
    /// Whether it was a hang (named by the launcher) rather than a rank that ended.
    hang: bool,
    /// The highest step completed before the failure (any round so far).
    reached: Option<u64>,
    /// The step the next round resumed from.
    resumed_from: Option<u64>,
    /// Steps done again: `reached - resumed_from`.
    recomputed: Option<u64>,
    /// Seconds from the failure to the first step of the next round.
    recover_s: Option<f64>,
    #[serde(skip)]
    failed_ms: u64,
}

/// The run's recovery record.
#[derive(Debug, Default, serde::Serialize)]
struct Record {
    restarts: Vec<Restart>,
    /// The nodes of each round.
    rounds: Vec<Vec<usize>>,
    exit_code: i32,
    elapsed_s: f64,
}

fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    // Nearest rank.
    let i = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[i.clamp(1, sorted.len()) - 1])
}

impl Record {
    /// The figures of the summary line: steps recomputed (total, largest), recovery times
    /// (median, p95).
    fn line(&self) -> String {
        let n = self.restarts.len();
        let hangs = self.restarts.iter().filter(|r| r.hang).count();
        let recomputed: Vec<u64> = self.restarts.iter().filter_map(|r| r.recomputed).collect();
        let mut times: Vec<f64> = self.restarts.iter().filter_map(|r| r.recover_s).collect();
        times.sort_by(f64::total_cmp);
        let steps = if recomputed.is_empty() {
            "steps recomputed: not known here (no rank of this node reports steps)".to_string()
        } else {
            format!(
                "{} steps recomputed (at most {} per failure)",
                recomputed.iter().sum::<u64>(),
                recomputed.iter().max().expect("not empty")
            )
        };
        let time = match (percentile(&times, 50.0), percentile(&times, 95.0)) {
            (Some(m), Some(p)) => format!("time to recover median {m:.2}s, p95 {p:.2}s"),
            _ => "time to recover: not known here".to_string(),
        };
        format!(
            "{n} restart(s) ({} failure(s), {hangs} hang(s)); {steps}; {time}; {:.1}s in all",
            n - hangs,
            self.elapsed_s
        )
    }
}

/// Runs the job with restarts (see the module doc); the launcher's exit code.
pub(crate) fn supervise(args: &LaunchArgs, prog: &Program, token: Option<String>) -> Result<i32> {
    let started = Instant::now();
    let mut s = Supervisor {
        args,
        prog,
        agent: Agent::start(args, token.clone())?,
        token,
        patience: Duration::from_secs_f64(args.rdzv_timeout.max(1.0)),
        record: Record::default(),
        high: None,
        fruitless: 0,
        me: format!("node {}: ", args.node_rank),
    };
    let mut round = first_round(&mut s.agent, s.patience)?;
    let code = loop {
        match s.round(round)? {
            Flow::End(code) => break code,
            Flow::Next => round += 1,
        }
    };
    s.end(code, started)
}

/// What the restart loop keeps from round to round.
struct Supervisor<'a> {
    args: &'a LaunchArgs,
    prog: &'a Program,
    token: Option<String>,
    agent: Agent,
    /// How long to wait for the launchers' rendezvous.
    patience: Duration,
    record: Record,
    /// The highest step seen in any round.
    high: Option<u64>,
    /// The restarts in a row that made no step.
    fruitless: u32,
    /// "node N: ", the prefix of this node's failures.
    me: String,
}

/// What a round leads to.
enum Flow {
    /// The launcher ends with this code.
    End(i32),
    /// The next round.
    Next,
}

/// How a round that ran ended, for the restart loop.
enum Outcome {
    /// The launcher ends with this code.
    End(i32),
    /// The round failed: what happened, the exit code if the launcher gives up, a hang?
    Failed { why: String, code: i32, hang: bool },
}

/// What one round of this node's ranks did.
struct Ran {
    ended: Ended,
    /// When the failure was seen (ms since the epoch; 0 when none).
    failed_ms: u64,
    /// A step, or a minute without failing: not a failure at start.
    progressed: bool,
}

impl Supervisor<'_> {
    /// Round `round`: join it, run this node's ranks if it has any, restart or end.
    fn round(&mut self, round: usize) -> Result<Flow> {
        let plan = match join_round(&mut self.agent, self.args, round)? {
            Next::Plan(p) => p,
            Next::End(why) if why == "done" => {
                eprintln!("[kiln launch] the job finished without this node");
                return Ok(Flow::End(0));
            }
            Next::End(why) => {
                eprintln!("[kiln launch] the job ended: {why}");
                return Ok(Flow::End(1));
            }
        };
        let Some((first_rank, world, group_rank)) = plan.place(self.args.node_rank) else {
            eprintln!(
                "[kiln launch] round {round} started without this node; it waits to be \
                 admitted at the next restart"
            );
            return Ok(Flow::Next);
        };
        let nodes: Vec<usize> = plan.nodes.iter().map(|(n, _)| *n).collect();
        if round > 0 {
            eprintln!(
                "[kiln launch] round {round}: {world} rank(s) on node(s) {nodes:?}, from the \
                 latest snapshot"
            );
        }
        self.record.rounds.push(nodes);
        let dir = heartbeat_dir(round)?;
        let r = Round {
            first_rank,
            world,
            group_rank,
            master_addr: &self.args.master_addr,
            port: plan.port,
            token: self
                .token
                .as_deref()
                .map(|t| kiln_comm::auth::derive_token(t, &format!("round {round}"))),
            restart: Some(round),
            heartbeats: Some(&dir),
        };
        let ran = self.run(round, &r, &dir, plan.nodes.len() == 1)?;
        let (why, code, hang) = match self.outcome(round, &plan, ran.ended)? {
            Outcome::End(code) => return Ok(Flow::End(code)),
            Outcome::Failed { why, code, hang } => (why, code, hang),
        };
        self.restart(round, why, code, hang, ran.failed_ms, ran.progressed)
    }

    /// Runs this node's ranks for `round` (`r`; heartbeats in `dir`, removed after), watching
    /// for hangs and for other nodes' failures; closes the last restart's record with what
    /// the round achieved.
    fn run(&mut self, round: usize, r: &Round<'_>, dir: &Path, one_node: bool) -> Result<Ran> {
        let mut watch = HangWatch::new(self.args.hang_timeout, Some(dir.to_path_buf()), one_node);
        let mut announced = false;
        let round_start = Instant::now();
        let mut last_poll = Instant::now();
        let failed_key = format!("round/{round}/failed");
        let pending = self
            .record
            .restarts
            .last()
            .cloned()
            .filter(|r| r.recover_s.is_none());
        let (agent, me) = (&mut self.agent, &self.me);
        let (ended, failed_ms) = run_round(self.args, self.prog, r, &mut |event| {
            let ranks = match event {
                Event::Tick(ranks) => ranks,
                // Told to the other nodes first (they see the cause before its effects).
                Event::Failing { why, hang } => {
                    // Briefly: a node cut off says it later, once it reaches the rendezvous.
                    let brief = Duration::from_secs(2);
                    if !agent.check(&failed_key, brief).unwrap_or(true) {
                        let why = format!("{me}{why}");
                        let _ = agent.set(&failed_key, &failure_mark(&why, hang), brief);
                    }
                    return Verdict::Continue;
                }
            };
            let verdict = watch.check(ranks);
            if !announced && let (Some(p), Some((first, at_ms))) = (&pending, watch.first_step()) {
                announced = true;
                let resumed = first - 1;
                let recomputed = p.reached.map(|h| h.saturating_sub(resumed));
                eprintln!(
                    "[kiln launch] restart after round {} recovered: resumed at step {resumed}{}, \
                     training again {:.2}s after the failure",
                    p.round,
                    recomputed.map_or(String::new(), |n| format!(" ({n} step(s) recomputed)")),
                    at_ms.saturating_sub(p.failed_ms) as f64 / 1000.0
                );
            }
            if matches!(verdict, Verdict::Stop { .. }) {
                return verdict;
            }
            // Another node's failure, seen through the rendezvous (5 times a second).
            if last_poll.elapsed() >= Duration::from_millis(200) {
                last_poll = Instant::now();
                if let Ok(Some(mark)) = agent.get_now(&failed_key, Duration::ZERO) {
                    let (why, hang) = failure_of(&mark);
                    return Verdict::Stop {
                        why,
                        hung: None,
                        hang,
                    };
                }
            }
            Verdict::Continue
        })?;
        watch.read_last();
        let _ = std::fs::remove_dir_all(dir);
        // What this round achieved: its resumed step and first step close the last restart.
        if let Some((first, at_ms)) = watch.first_step()
            && let Some(last) = self.record.restarts.last_mut()
            && last.recover_s.is_none()
        {
            last.resumed_from = Some(first - 1);
            last.recomputed = last.reached.map(|h| h.saturating_sub(first - 1));
            last.recover_s = Some(at_ms.saturating_sub(last.failed_ms) as f64 / 1000.0);
        }
        let step = watch.step();
        if step > 0 {
            self.high = Some(self.high.map_or(step, |h| h.max(step)));
        }
        Ok(Ran {
            ended,
            failed_ms,
            // A step, or (for a program that reports none, or a node without rank 0) a round
            // that ran a minute: not a failure at start.
            progressed: step > 0 || round_start.elapsed() >= Duration::from_secs(60),
        })
    }

    /// What `ended` means for the job: its end, or a failure (this node's, or another's that
    /// caused it, as recorded in the rendezvous).
    fn outcome(&mut self, round: usize, plan: &Plan, ended: Ended) -> Result<Outcome> {
        let (args, patience, me) = (self.args, self.patience, &self.me);
        let agent = &mut self.agent;
        let failed_key = format!("round/{round}/failed");
        Ok(match ended {
            Ended::Done => {
                let _ = agent.set(
                    &format!("round/{round}/ok/{}", args.node_rank),
                    "1",
                    patience,
                );
                match finish(agent, args, plan, round)? {
                    None => Outcome::End(0),
                    // Another node failed at the end: this round failed after all.
                    Some(mark) => {
                        let (why, hang) = failure_of(&mark);
                        Outcome::Failed { why, code: 1, hang }
                    }
                }
            }
            Ended::Failed { code, why, hang } => {
                let why = format!("{me}{why}");
                // Another node's failure recorded first is the cause; this one its effect
                // (a rank here lost its peer there).
                let (why, hang) = match agent.get_now(&failed_key, patience).ok().flatten() {
                    Some(mark) if !mark.contains(me.as_str()) => {
                        let (cause, hang) = failure_of(&mark);
                        (format!("{cause} (here: {why})"), hang)
                    }
                    Some(_) => (why, hang),
                    None => {
                        let _ = agent.set(&failed_key, &failure_mark(&why, hang), patience);
                        (why, hang)
                    }
                };
                Outcome::Failed { why, code, hang }
            }
            // Another node's failure (its text names the node), or this node's whole job hung.
            Ended::Stopped { why, hang } => {
                let why = if why.starts_with("node ") {
                    why
                } else {
                    format!("node {}: {why}", args.node_rank)
                };
                if !agent.check(&failed_key, patience).unwrap_or(true) {
                    let _ = agent.set(&failed_key, &failure_mark(&why, hang), patience);
                }
                Outcome::Failed { why, code: 1, hang }
            }
            Ended::Signal(sig) => {
                let _ = agent.set(
                    "job/end",
                    &format!("node {}'s launcher received signal {sig}", args.node_rank),
                    Duration::from_secs(2),
                );
                Outcome::End(128 + sig)
            }
        })
    }

    /// After a failed round: the restart recorded, then either the end (restarts run out, or
    /// a signal during the back-off) or the next round after the back-off.
    fn restart(
        &mut self,
        round: usize,
        why: String,
        code: i32,
        hang: bool,
        failed_ms: u64,
        progressed: bool,
    ) -> Result<Flow> {
        let args = self.args;
        self.record.restarts.push(Restart {
            round,
            why: why.clone(),
            hang,
            reached: self.high,
            resumed_from: None,
            recomputed: None,
            recover_s: None,
            failed_ms,
        });
        self.fruitless = if progressed { 0 } else { self.fruitless + 1 };
        let restarts = self.record.restarts.len();
        if restarts > args.max_restarts {
            let end = format!(
                "gave up after {} restart(s) (--max-restarts {}): {why}",
                restarts - 1,
                args.max_restarts
            );
            eprintln!("[kiln launch] {end}");
            // The failure is not a restart: it ends the job.
            self.record.restarts.pop();
            let _ = self.agent.set("job/end", &end, Duration::from_secs(2));
            return Ok(Flow::End(code));
        }
        // Node 0 waits before it starts the next round, doubling the wait for each round in
        // a row that made no progress (a failure at start, a bad node or a port in use, is
        // not retried in a tight loop); the other nodes wait for its plan.
        let backoff = if args.node_rank == 0 {
            (args.restart_backoff * 2f64.powi(self.fruitless.clamp(1, 10) as i32 - 1)).min(60.0)
        } else {
            0.0
        };
        eprintln!(
            "[kiln launch] round {round} failed ({why}) at step {}; restart {restarts} of {} {}",
            self.high
                .map_or("(none reported here)".into(), |h| h.to_string()),
            args.max_restarts,
            if args.node_rank == 0 {
                format!("in {backoff:.1}s")
            } else {
                "when node 0's launcher starts it".to_string()
            }
        );
        let until = Instant::now() + Duration::from_secs_f64(backoff);
        while Instant::now() < until {
            if let Some(sig) = signalled() {
                let _ = self.agent.set(
                    "job/end",
                    &format!("node {}'s launcher received signal {sig}", args.node_rank),
                    Duration::from_secs(2),
                );
                return Ok(Flow::End(128 + sig));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(Flow::Next)
    }

    /// The end of the job on this node: the recovery line and summary, the goodbye.
    fn end(mut self, code: i32, started: Instant) -> Result<i32> {
        let args = self.args;
        self.record.exit_code = code;
        self.record.elapsed_s = started.elapsed().as_secs_f64();
        eprintln!("[kiln launch] recovery: {}", self.record.line());
        if let Some(path) = &args.summary {
            let json = serde_json::to_string_pretty(&self.record).expect("the record serialises");
            std::fs::write(path, json + "\n")
                .with_context(|| format!("cannot write the summary {}", path.display()))?;
        }
        if args.node_rank == 0 {
            // The others learn the end from this store: give them a moment to read it.
            linger(&mut self.agent, args);
        } else {
            let _ = self.agent.set(
                &format!("bye/{}", args.node_rank),
                "1",
                Duration::from_secs(2),
            );
        }
        let _ = std::fs::remove_dir_all(
            std::env::temp_dir().join(format!("kiln-launch-{}", std::process::id())),
        );
        Ok(code)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_mark_keeps_whether_it_was_a_hang() {
        let why = "node 1: rank 3 (pid 9) hangs: it is stopped";
        assert_eq!(
            failure_of(&failure_mark(why, true)),
            (why.to_string(), true)
        );
        assert_eq!(
            failure_of(&failure_mark("x\ty", false)),
            ("x\ty".into(), false)
        );
        assert_eq!(failure_of("older text"), ("older text".into(), false));
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let v = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(percentile(&v, 50.0), Some(2.0));
        assert_eq!(percentile(&v, 95.0), Some(4.0));
        assert_eq!(percentile(&[], 50.0), None);
    }
}
