//! Telling a hung rank from its waiting peers, by the heartbeats the ranks write
//! (`kiln_comm::progress`): `kiln launch --hang-timeout`.

use crate::round::{Running, Verdict};
use kiln_comm::progress::Beat;
use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// What the launcher last saw of one rank's heartbeat.
#[derive(Debug)]
struct Seen {
    pid: u32,
    beat: Beat,
    /// When the heartbeat file last changed (the process runs).
    alive_at: Instant,
}

/// Reads the heartbeats of a round's ranks: the steps they reach, and whether one hangs.
///
/// A hang: no rank of this node completed a step or received a message for `--hang-timeout`.
/// The rank named is one that stopped running (its heartbeat thread stopped writing, or the
/// kernel says it is stopped), else one that is not waiting on a peer while others are; when
/// every rank of the whole job waits on another, all are named (a deadlock). A node whose
/// ranks all wait on ranks elsewhere leaves the naming to the node of the rank that hangs.
#[derive(Debug)]
pub(crate) struct HangWatch {
    timeout: Option<Duration>,
    dir: Option<PathBuf>,
    /// Whether this node runs every rank of the job.
    whole_job: bool,
    seen: HashMap<usize, Seen>,
    progress_at: Instant,
    warned: bool,
}

impl HangWatch {
    /// `whole_job`: whether this node runs every rank of the job.
    pub(crate) fn new(timeout_s: f64, dir: Option<PathBuf>, whole_job: bool) -> HangWatch {
        HangWatch {
            timeout: (timeout_s > 0.0).then(|| Duration::from_secs_f64(timeout_s)),
            dir,
            whole_job,
            seen: HashMap::new(),
            progress_at: Instant::now(),
            warned: false,
        }
    }

    /// The highest step any rank of this node completed in this round (0: none).
    pub(crate) fn step(&self) -> u64 {
        self.seen.values().map(|s| s.beat.step).max().unwrap_or(0)
    }

    /// The first step completed in this round, and when (ms since the epoch).
    pub(crate) fn first_step(&self) -> Option<(u64, u64)> {
        self.seen
            .values()
            .filter(|s| s.beat.first_step > 0)
            .map(|s| (s.beat.first_step, s.beat.first_step_ms))
            .min()
    }

    /// Reads the heartbeat files of the round's ranks once more, after they ended: each holds
    /// the last step its rank completed. The directory is this round's, so a rank that ended
    /// before the watch first saw it (a short round) counts too.
    pub(crate) fn read_last(&mut self) {
        let Some(dir) = &self.dir else { return };
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(rank) = name
                .to_str()
                .and_then(|n| n.strip_prefix("rank-"))
                .and_then(|r| r.parse::<usize>().ok())
            else {
                continue;
            };
            let Some(beat) = Beat::read(&entry.path()) else {
                continue;
            };
            match self.seen.get_mut(&rank) {
                Some(s) if beat.pid == s.pid => s.beat = beat,
                Some(_) => {}
                None => {
                    self.seen.insert(
                        rank,
                        Seen {
                            pid: beat.pid,
                            beat,
                            alive_at: Instant::now(),
                        },
                    );
                }
            }
        }
    }

    /// Reads the heartbeats; a verdict on the round.
    pub(crate) fn check(&mut self, ranks: &[Running]) -> Verdict {
        let Some(dir) = &self.dir else {
            return Verdict::Continue;
        };
        let now = Instant::now();
        for r in ranks {
            let Some(beat) = Beat::read(&dir.join(format!("rank-{}", r.rank))) else {
                continue;
            };
            if beat.pid != r.pid {
                continue;
            }
            match self.seen.get_mut(&r.rank) {
                Some(s) => {
                    if (beat.step, beat.messages) != (s.beat.step, s.beat.messages) {
                        self.progress_at = now;
                    }
                    if beat.beat_ms != s.beat.beat_ms {
                        s.alive_at = now;
                    }
                    s.beat = beat;
                }
                None => {
                    self.progress_at = now;
                    self.seen.insert(
                        r.rank,
                        Seen {
                            pid: r.pid,
                            beat,
                            alive_at: now,
                        },
                    );
                }
            }
        }
        let Some(timeout) = self.timeout else {
            return Verdict::Continue;
        };
        let idle = now.duration_since(self.progress_at);
        if idle < timeout {
            return Verdict::Continue;
        }
        if self.seen.is_empty() {
            if !self.warned {
                self.warned = true;
                eprintln!(
                    "[kiln launch] --hang-timeout: no rank has written a heartbeat in {:.0}s \
                     (a program that does not join through kiln-comm?); hangs cannot be told",
                    idle.as_secs_f64()
                );
            }
            return Verdict::Continue;
        }
        let waiting = |s: &Seen| s.beat.waiting_ms != 0;
        // Stopped: its heartbeat thread stopped (1 s is five beats), or the kernel says so.
        let stopped: Vec<&Running> = ranks
            .iter()
            .filter(|r| {
                proc_state(r.pid).is_some_and(|c| c == 'T' || c == 't')
                    || self
                        .seen
                        .get(&r.rank)
                        .is_some_and(|s| now.duration_since(s.alive_at) > Duration::from_secs(1))
            })
            .collect();
        let for_s = idle.as_secs_f64();
        if let Some(r) = stopped.first() {
            let state = match proc_state(r.pid) {
                Some('T' | 't') => "it is stopped (SIGSTOP?)".to_string(),
                Some(c) => format!("its heartbeat stopped (process state {c})"),
                None => "its heartbeat stopped".to_string(),
            };
            return Verdict::Stop {
                why: format!(
                    "rank {} (pid {}) hangs: {state}, and no rank of this node has made \
                     progress for {for_s:.1}s",
                    r.rank, r.pid
                ),
                hung: Some(r.rank),
                hang: true,
            };
        }
        let any_waiting = self.seen.values().any(waiting);
        let busy: Vec<&Running> = ranks
            .iter()
            .filter(|r| self.seen.get(&r.rank).is_none_or(|s| !waiting(s)))
            .collect();
        if let Some(r) = busy.first().filter(|_| any_waiting) {
            let step = self.seen.get(&r.rank).map_or(0, |s| s.beat.step);
            return Verdict::Stop {
                why: format!(
                    "rank {} (pid {}) hangs: no step or message for {for_s:.1}s, at step {step}, \
                     and it is not waiting on a peer while its peers wait",
                    r.rank, r.pid
                ),
                hung: Some(r.rank),
                hang: true,
            };
        }
        if self.whole_job {
            let names: Vec<String> = ranks.iter().map(|r| r.rank.to_string()).collect();
            return Verdict::Stop {
                why: format!(
                    "no rank has made progress for {for_s:.1}s ({}; ranks {})",
                    if any_waiting {
                        "every rank waits on another: a deadlock"
                    } else {
                        "none waits on a peer"
                    },
                    names.join(", ")
                ),
                hung: None,
                hang: true,
            };
        }
        Verdict::Continue
    }
}

/// The state letter of process `pid` (`R`, `S`, `D`, `T` stopped, `Z`, ...), from /proc.
fn proc_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit(')')
        .next()?
        .split_whitespace()
        .next()?
        .chars()
        .next()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::round::Running;

    /// Heartbeats of two ranks (pids that no process has): rank 0 waits on a peer, rank 1
    /// does not (or has a heartbeat that stopped); neither makes progress.
    fn beats(dir: &std::path::Path, beat_ms: u64, stalled_1: bool) {
        // A stalled rank 1 also waits: only its stopped heartbeat can name it.
        for (rank, waiting_ms) in [(0, 5), (1, u64::from(stalled_1) * 5)] {
            let b = Beat {
                pid: 4_000_000 + rank,
                beat_ms: if rank == 1 && stalled_1 { 1 } else { beat_ms },
                step: 7,
                first_step: 1,
                first_step_ms: 1,
                messages: 100,
                waiting_ms,
            };
            std::fs::write(dir.join(format!("rank-{rank}")), b.to_line()).unwrap();
        }
    }

    fn watch_until_stop(w: &mut HangWatch, dir: &std::path::Path, stalled_1: bool) -> Verdict {
        let ranks = [0, 1].map(|r| Running {
            rank: r,
            pid: 4_000_000 + r as u32,
        });
        for i in 0..100 {
            beats(dir, 2 + i, stalled_1);
            if let v @ Verdict::Stop { .. } = w.check(&ranks) {
                return v;
            }
            std::thread::sleep(Duration::from_millis(30));
        }
        Verdict::Continue
    }

    #[test]
    fn a_hang_names_the_rank_that_does_not_wait_or_that_stopped_running() {
        let dir = tempfile::tempdir().unwrap();
        // Both heartbeats alive: the rank not waiting while its peer waits is named.
        let mut w = HangWatch::new(1.0, Some(dir.path().to_path_buf()), true);
        match watch_until_stop(&mut w, dir.path(), false) {
            Verdict::Stop { why, hung, hang } => {
                assert_eq!(hung, Some(1), "{why}");
                assert!(hang && why.contains("not waiting on a peer"), "{why}");
            }
            Verdict::Continue => panic!("no hang named"),
        }
        // Rank 1's heartbeat stops (its process stopped): named as such.
        let mut w = HangWatch::new(1.5, Some(dir.path().to_path_buf()), true);
        match watch_until_stop(&mut w, dir.path(), true) {
            Verdict::Stop { why, hung, .. } => {
                assert_eq!(hung, Some(1), "{why}");
                assert!(why.contains("its heartbeat stopped"), "{why}");
            }
            Verdict::Continue => panic!("no hang named"),
        }
        // Off: never a verdict.
        let mut w = HangWatch::new(0.0, Some(dir.path().to_path_buf()), true);
        assert!(matches!(
            watch_until_stop(&mut w, dir.path(), true),
            Verdict::Continue
        ));
    }
}
