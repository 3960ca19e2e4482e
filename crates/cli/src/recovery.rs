//! Recovery without a person: `kiln launch --max-restarts N` (and elastic `--nnodes MIN:MAX`).
//!
//! The launchers of a job meet in a rendezvous of their own, a [`StoreServer`] hosted by node
//! 0's launcher on `--master-port` (the ranks' store, hosted by rank 0, moves to the next
//! port). A start of the job is a *round*: each launcher says it is ready for round `r`, node
//! 0's publishes the round's plan (which nodes, how many ranks each, the ranks' store port),
//! and every launcher starts its ranks with `KILN_RESTART_COUNT=r` and a job token derived
//! for the round (a rank left over from an earlier round cannot join a later one). When a rank
//! fails, or is named hung ([`HangWatch`]), its launcher stops its ranks and marks the round
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

use crate::launch::{Ended, LaunchArgs, Program, Round, Running, Verdict, run_round};
use anyhow::{Context, Result};
use kiln_comm::progress::Beat;
use kiln_comm::store::{StoreClient, StoreServer};
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
    fn step(&self) -> u64 {
        self.seen.values().map(|s| s.beat.step).max().unwrap_or(0)
    }

    /// The first step completed in this round, and when (ms since the epoch).
    fn first_step(&self) -> Option<(u64, u64)> {
        self.seen
            .values()
            .filter(|s| s.beat.first_step > 0)
            .map(|s| (s.beat.first_step, s.beat.first_step_ms))
            .min()
    }

    /// Reads the heartbeat files of the round's ranks once more, after they ended: each holds
    /// the last step its rank completed.
    fn read_last(&mut self) {
        let Some(dir) = &self.dir else { return };
        for (rank, s) in &mut self.seen {
            if let Some(beat) = Beat::read(&dir.join(format!("rank-{rank}")))
                && beat.pid == s.pid
            {
                s.beat = beat;
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

/// The launchers' rendezvous (see the module doc): node 0 hosts it, every node talks to it.
/// A lost connection is opened again on the next call.
struct Agent {
    _server: Option<StoreServer>,
    addr: String,
    token: Option<String>,
    client: Option<StoreClient>,
}

const PREFIX: &str = "kiln/launch/";

impl Agent {
    fn start(args: &LaunchArgs, token: Option<String>) -> Result<Agent> {
        let server = if args.node_rank == 0 {
            let host = std::env::var("KILN_STORE_BIND")
                .ok()
                .filter(|h| !h.trim().is_empty())
                .unwrap_or_else(|| args.master_addr.clone());
            let host = host
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_string();
            let port = args.master_port;
            let server = StoreServer::bind_with_token((host.as_str(), port), token.clone())
                .with_context(|| format!("hosting the launchers' rendezvous on {host}:{port}"))?;
            Some(server)
        } else {
            None
        };
        let port = server
            .as_ref()
            .map_or(args.master_port, |s| s.local_addr().port());
        let addr = format!("{}:{port}", args.master_addr);
        let mut agent = Agent {
            _server: server,
            addr,
            token,
            client: None,
        };
        agent.connect(Duration::from_secs_f64(args.rdzv_timeout.max(1.0)))?;
        Ok(agent)
    }

    fn connect(&mut self, timeout: Duration) -> Result<&StoreClient> {
        if self.client.is_none() {
            let c = StoreClient::connect_with_token(&self.addr, timeout, self.token.as_deref())
                .with_context(|| format!("reaching the launchers' rendezvous at {}", self.addr))?;
            self.client = Some(c);
        }
        Ok(self.client.as_ref().expect("connected"))
    }

    /// One request, the connection opened again if it was lost (within `patience`).
    fn call<T>(
        &mut self,
        patience: Duration,
        f: impl Fn(&StoreClient) -> kiln_comm::Result<T>,
    ) -> Result<T> {
        let deadline = Instant::now() + patience;
        loop {
            let result = self
                .connect(Duration::from_secs(2))
                .and_then(|c| f(c).map_err(anyhow::Error::from));
            match result {
                Ok(v) => return Ok(v),
                Err(e) => {
                    self.client = None;
                    if Instant::now() >= deadline {
                        return Err(e.context(format!(
                            "lost the launchers' rendezvous at {} for {:.0}s (node 0's \
                             launcher gone, or this node cut off)",
                            self.addr,
                            patience.as_secs_f64()
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
        }
    }

    fn check(&mut self, key: &str, patience: Duration) -> Result<bool> {
        let key = format!("{PREFIX}{key}");
        self.call(patience, |c| c.check(&key))
    }

    fn get_now(&mut self, key: &str, patience: Duration) -> Result<Option<String>> {
        let key = format!("{PREFIX}{key}");
        self.call(patience, |c| {
            Ok(if c.check(&key)? {
                Some(String::from_utf8_lossy(&c.get(&key)?).into_owned())
            } else {
                None
            })
        })
    }

    fn set(&mut self, key: &str, value: &str, patience: Duration) -> Result<()> {
        let key = format!("{PREFIX}{key}");
        self.call(patience, |c| c.set(&key, value.as_bytes()))
    }
}

/// A round's plan: the nodes taking part (node rank, ranks on it), the ranks' store port.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Plan {
    port: u16,
    nodes: Vec<(usize, usize)>,
}

impl Plan {
    fn encode(&self) -> String {
        let nodes: Vec<String> = self.nodes.iter().map(|(n, p)| format!("{n}:{p}")).collect();
        format!("{} {}", self.port, nodes.join(","))
    }

    fn decode(s: &str) -> Option<Plan> {
        let (port, nodes) = s.split_once(' ')?;
        let nodes = nodes
            .split(',')
            .map(|np| {
                let (n, p) = np.split_once(':')?;
                Some((n.parse().ok()?, p.parse().ok()?))
            })
            .collect::<Option<Vec<_>>>()?;
        Some(Plan {
            port: port.parse().ok()?,
            nodes,
        })
    }

    /// This node's first global rank, the world size and this node's index, if it takes part.
    fn place(&self, node: usize) -> Option<(usize, usize, usize)> {
        let world = self.nodes.iter().map(|(_, p)| p).sum();
        let i = self.nodes.iter().position(|(n, _)| *n == node)?;
        let first = self.nodes[..i].iter().map(|(_, p)| p).sum();
        Some((first, world, i))
    }
}

/// What waiting for a round's plan came to.
enum Next {
    Plan(Plan),
    /// The job ended (`done`, or why it was given up).
    End(String),
}

/// Whether the launcher was sent a signal (then: stop).
fn signalled() -> Option<i32> {
    crate::launch::take_signal()
}

/// Node 0: waits for the nodes of round `r`, then publishes its plan.
fn coordinate(agent: &mut Agent, args: &LaunchArgs, r: usize) -> Result<Next> {
    let patience = Duration::from_secs(10);
    let wait = Duration::from_secs_f64(args.rdzv_timeout);
    let start = Instant::now();
    let present = loop {
        let mut present = Vec::new();
        for n in 0..args.nnodes.max {
            if let Some(p) = agent.get_now(&format!("round/{r}/node/{n}"), patience)? {
                present.push((n, p.parse::<usize>().context("a node's rank count")?));
            }
        }
        if present.len() == args.nnodes.max {
            break present;
        }
        if start.elapsed() >= wait {
            if present.len() >= args.nnodes.min {
                let missing: Vec<usize> = (0..args.nnodes.max)
                    .filter(|n| !present.iter().any(|(p, _)| p == n))
                    .collect();
                eprintln!(
                    "[kiln launch] node(s) {missing:?} did not come within {:.0}s: the job goes \
                     on with {} node(s) ({} at least); they are admitted at a later restart",
                    wait.as_secs_f64(),
                    present.len(),
                    args.nnodes.min
                );
                break present;
            }
            let why = format!(
                "only {} of the {} nodes needed came to the rendezvous within {:.0}s (nodes \
                 present: {:?})",
                present.len(),
                args.nnodes.min,
                wait.as_secs_f64(),
                present.iter().map(|(n, _)| n).collect::<Vec<_>>()
            );
            agent.set("job/end", &why, patience)?;
            return Ok(Next::End(why));
        }
        if let Some(sig) = signalled() {
            let why = format!("node 0's launcher received signal {sig}");
            agent.set("job/end", &why, patience)?;
            return Ok(Next::End(why));
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let port = if args.nnodes.max == 1 && args.master_port == 0 {
        crate::launch::free_port()?
    } else {
        args.master_port + 1
    };
    let plan = Plan {
        port,
        nodes: present,
    };
    agent.set(&format!("round/{r}/plan"), &plan.encode(), patience)?;
    agent.set("round/current", &r.to_string(), patience)?;
    Ok(Next::Plan(plan))
}

/// Every node: says it is ready for round `r` and waits for the plan (node 0 makes it).
fn join_round(agent: &mut Agent, args: &LaunchArgs, r: usize) -> Result<Next> {
    let patience = Duration::from_secs_f64(args.rdzv_timeout.max(1.0));
    agent.set(
        &format!("round/{r}/node/{}", args.node_rank),
        &args.nproc_per_node.to_string(),
        patience,
    )?;
    agent.set(&format!("known/{}", args.node_rank), "1", patience)?;
    if args.node_rank == 0 {
        return coordinate(agent, args, r);
    }
    loop {
        if let Some(end) = agent.get_now("job/end", patience)? {
            return Ok(Next::End(end));
        }
        if let Some(p) = agent.get_now(&format!("round/{r}/plan"), patience)? {
            return Plan::decode(&p)
                .map(Next::Plan)
                .with_context(|| format!("a damaged plan for round {r}: {p:?}"));
        }
        if let Some(sig) = signalled() {
            return Ok(Next::End(format!("this launcher received signal {sig}")));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The round a launcher joins first: the one after the job's current round if that one is
/// under way (a node that comes late, or again), else the current one.
fn first_round(agent: &mut Agent, patience: Duration) -> Result<usize> {
    let Some(cur) = agent.get_now("round/current", patience)? else {
        return Ok(0);
    };
    let cur: usize = cur.parse().context("the job's current round")?;
    Ok(if agent.check(&format!("round/{cur}/plan"), patience)? {
        cur + 1
    } else {
        cur
    })
}

/// Runs the job with restarts (see the module doc); the launcher's exit code.
pub(crate) fn supervise(args: &LaunchArgs, prog: &Program, token: Option<String>) -> Result<i32> {
    let started = Instant::now();
    let mut agent = Agent::start(args, token.clone())?;
    let patience = Duration::from_secs_f64(args.rdzv_timeout.max(1.0));
    let mut record = Record::default();
    let mut round = first_round(&mut agent, patience)?;
    // The highest step seen in any round, and the restarts in a row that made no step.
    let mut high: Option<u64> = None;
    let mut fruitless = 0u32;
    let code = loop {
        let plan = match join_round(&mut agent, args, round)? {
            Next::Plan(p) => p,
            Next::End(why) if why == "done" => {
                eprintln!("[kiln launch] the job finished without this node");
                break 0;
            }
            Next::End(why) => {
                eprintln!("[kiln launch] the job ended: {why}");
                break 1;
            }
        };
        let Some((first_rank, world, group_rank)) = plan.place(args.node_rank) else {
            eprintln!(
                "[kiln launch] round {round} started without this node; it waits to be \
                 admitted at the next restart"
            );
            round += 1;
            continue;
        };
        record
            .rounds
            .push(plan.nodes.iter().map(|(n, _)| *n).collect());
        if round > 0 {
            eprintln!(
                "[kiln launch] round {round}: {world} rank(s) on node(s) {:?}, from the latest \
                 snapshot",
                plan.nodes.iter().map(|(n, _)| n).collect::<Vec<_>>()
            );
        }
        let dir = crate::launch::heartbeat_dir(round)?;
        let mut watch = HangWatch::new(args.hang_timeout, Some(dir.clone()), plan.nodes.len() == 1);
        let r = Round {
            first_rank,
            world,
            group_rank,
            master_addr: &args.master_addr,
            port: plan.port,
            token: token
                .as_deref()
                .map(|t| kiln_comm::auth::derive_token(t, &format!("round {round}"))),
            restart: Some(round),
            heartbeats: Some(&dir),
        };
        let mut announced = false;
        let round_start = Instant::now();
        let mut last_poll = Instant::now();
        let failed_key = format!("round/{round}/failed");
        let pending = record
            .restarts
            .last()
            .cloned()
            .filter(|r| r.recover_s.is_none());
        let (ended, failed_ms) = run_round(args, prog, &r, &mut |ranks| {
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
                if let Ok(Some(why)) = agent.get_now(&failed_key, Duration::ZERO) {
                    return Verdict::Stop {
                        why,
                        hung: None,
                        hang: false,
                    };
                }
            }
            Verdict::Continue
        })?;
        watch.read_last();
        let _ = std::fs::remove_dir_all(&dir);
        // What this round achieved: its resumed step and first step close the last restart.
        if let Some((first, at_ms)) = watch.first_step()
            && let Some(last) = record.restarts.last_mut()
            && last.recover_s.is_none()
        {
            last.resumed_from = Some(first - 1);
            last.recomputed = last.reached.map(|h| h.saturating_sub(first - 1));
            last.recover_s = Some(at_ms.saturating_sub(last.failed_ms) as f64 / 1000.0);
        }
        let step = watch.step();
        // A step, or (for a program that reports none, or a node without rank 0) a round
        // that ran a minute: not a failure at start.
        let progressed = step > 0 || round_start.elapsed() >= Duration::from_secs(60);
        if step > 0 {
            high = Some(high.map_or(step, |h| h.max(step)));
        }
        let (why, code, hang) = match ended {
            Ended::Done => {
                let _ = agent.set(
                    &format!("round/{round}/ok/{}", args.node_rank),
                    "1",
                    patience,
                );
                match finish(&mut agent, args, &plan, round)? {
                    None => break 0,
                    // Another node failed at the end: this round failed after all.
                    Some(why) => (why, 1, false),
                }
            }
            Ended::Failed { code, why, hang } => {
                let why = format!("node {}: {why}", args.node_rank);
                if !agent.check(&failed_key, patience).unwrap_or(true) {
                    let _ = agent.set(&failed_key, &why, patience);
                }
                (why, code, hang)
            }
            Ended::Stopped { why, hang } => {
                let why = if hang {
                    format!("node {}: {why}", args.node_rank)
                } else {
                    why
                };
                if !agent.check(&failed_key, patience).unwrap_or(true) {
                    let _ = agent.set(&failed_key, &why, patience);
                }
                (why, 1, hang)
            }
            Ended::Signal(sig) => {
                let _ = agent.set(
                    "job/end",
                    &format!("node {}'s launcher received signal {sig}", args.node_rank),
                    Duration::from_secs(2),
                );
                break 128 + sig;
            }
        };
        record.restarts.push(Restart {
            round,
            why: why.clone(),
            hang,
            reached: high,
            resumed_from: None,
            recomputed: None,
            recover_s: None,
            failed_ms,
        });
        fruitless = if progressed { 0 } else { fruitless + 1 };
        if record.restarts.len() > args.max_restarts {
            let end = format!(
                "gave up after {} restart(s) (--max-restarts {}): {why}",
                record.restarts.len() - 1,
                args.max_restarts
            );
            eprintln!("[kiln launch] {end}");
            // The failure is not a restart: it ends the job.
            record.restarts.pop();
            let _ = agent.set("job/end", &end, Duration::from_secs(2));
            break code;
        }
        // Node 0 waits before it starts the next round, doubling the wait for each round in
        // a row that made no progress (a failure at start, a bad node or a port in use, is
        // not retried in a tight loop); the other nodes wait for its plan.
        let backoff = if args.node_rank == 0 {
            (args.restart_backoff * 2f64.powi(fruitless.clamp(1, 10) as i32 - 1)).min(60.0)
        } else {
            0.0
        };
        eprintln!(
            "[kiln launch] round {round} failed ({why}) at step {}; restart {} of {} {}",
            high.map_or("(none reported here)".into(), |h| h.to_string()),
            record.restarts.len(),
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
                let _ = agent.set(
                    "job/end",
                    &format!("node {}'s launcher received signal {sig}", args.node_rank),
                    Duration::from_secs(2),
                );
                return Ok(128 + sig);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        round += 1;
    };
    record.exit_code = code;
    record.elapsed_s = started.elapsed().as_secs_f64();
    eprintln!("[kiln launch] recovery: {}", record.line());
    if let Some(path) = &args.summary {
        let json = serde_json::to_string_pretty(&record).expect("the record serialises");
        std::fs::write(path, json + "\n")
            .with_context(|| format!("cannot write the summary {}", path.display()))?;
    }
    if args.node_rank == 0 {
        // The others learn the end from this store: give them a moment to read it.
        linger(&mut agent, args);
    } else {
        let _ = agent.set(
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

/// After this node's ranks all exited 0: waits for the other nodes of the round. `None`: the
/// job is done; `Some(why)`: another node failed the round.
fn finish(agent: &mut Agent, args: &LaunchArgs, plan: &Plan, r: usize) -> Result<Option<String>> {
    let patience = Duration::from_secs_f64(args.rdzv_timeout.max(1.0));
    let start = Instant::now();
    loop {
        if let Some(why) = agent.get_now(&format!("round/{r}/failed"), patience)? {
            return Ok(Some(why));
        }
        let mut all = true;
        for (n, _) in &plan.nodes {
            all &= agent.check(&format!("round/{r}/ok/{n}"), patience)?;
        }
        if all {
            if args.node_rank == 0 {
                agent.set("job/end", "done", patience)?;
            }
            return Ok(None);
        }
        if agent.get_now("job/end", patience)?.as_deref() == Some("done") {
            return Ok(None);
        }
        if start.elapsed() >= patience {
            // Every rank here succeeded; a node that never says so is not waited for.
            if args.node_rank == 0 {
                agent.set("job/end", "done", patience)?;
            }
            return Ok(None);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Node 0, before its rendezvous goes: up to 5 s for every node that ever joined to say bye
/// (having read the end).
fn linger(agent: &mut Agent, args: &LaunchArgs) {
    let until = Instant::now() + Duration::from_secs(5);
    let patience = Duration::from_millis(500);
    while Instant::now() < until {
        let waiting = (1..args.nnodes.max).any(|n| {
            agent
                .check(&format!("known/{n}"), patience)
                .unwrap_or(false)
                && !agent.check(&format!("bye/{n}"), patience).unwrap_or(true)
        });
        if !waiting {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_round_trip_and_place_each_node() {
        let plan = Plan {
            port: 29501,
            nodes: vec![(0, 2), (2, 4)],
        };
        assert_eq!(Plan::decode(&plan.encode()), Some(plan.clone()));
        assert_eq!(plan.place(0), Some((0, 6, 0)));
        assert_eq!(plan.place(2), Some((2, 6, 1)));
        assert_eq!(plan.place(1), None);
        assert_eq!(Plan::decode("x 0:1"), None);
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let v = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(percentile(&v, 50.0), Some(2.0));
        assert_eq!(percentile(&v, 95.0), Some(4.0));
        assert_eq!(percentile(&[], 50.0), None);
    }

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
