//! One round of `kiln launch` on this node: start the local ranks with torchrun-style
//! variables, prefix their output with the rank, watch them, and stop them all when one fails
//! (or the watcher says so).

use crate::launch_args::LaunchArgs;
use anyhow::{Context, Result, bail};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Signals received by the launcher, forwarded to the ranks.
static SIGNAL: AtomicI32 = AtomicI32::new(0);

pub(crate) extern "C" fn on_signal(sig: libc::c_int) {
    SIGNAL.store(sig, Ordering::SeqCst);
}

/// A signal received since the last call, if any.
pub(crate) fn take_signal() -> Option<i32> {
    Some(SIGNAL.swap(0, Ordering::SeqCst)).filter(|s| *s != 0)
}

struct Rank {
    rank: usize,
    child: Child,
    status: Option<ExitStatus>,
}

fn exit_code(status: ExitStatus) -> i32 {
    status
        .code()
        .unwrap_or_else(|| 128 + status.signal().unwrap_or(0))
}

fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exited with code {c}"),
        (None, Some(s)) => format!("was killed by signal {s}"),
        _ => "ended".to_string(),
    }
}

/// Copies a child's output line by line, each line prefixed with its rank.
fn pump(
    rank: usize,
    from: impl std::io::Read + Send + 'static,
    to_stderr: bool,
    lock: Arc<Mutex<()>>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut reader = BufReader::new(from);
        let mut line = Vec::new();
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    let _guard = lock.lock();
                    let text = String::from_utf8_lossy(&line);
                    let text = text.trim_end_matches('\n');
                    if to_stderr {
                        let _ = writeln!(std::io::stderr(), "[rank {rank}] {text}");
                    } else {
                        let _ = writeln!(std::io::stdout(), "[rank {rank}] {text}");
                    }
                }
            }
        }
    })
}

/// Why a rank could not be started, with the fix when a bare name was meant as a file here.
fn start_error(program: &str, e: &std::io::Error) -> String {
    let path = std::path::Path::new(program);
    if e.kind() != std::io::ErrorKind::NotFound || path.components().count() != 1 {
        e.to_string()
    } else if path.is_file() {
        format!(
            "{e}: '{program}' is not on PATH; for the file in this directory, write ./{program}"
        )
    } else {
        format!("{e}: '{program}' is not on PATH")
    }
}

/// A free TCP port on this machine (for `--master-port 0`).
pub(crate) fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("0.0.0.0:0").context("finding a free port")?;
    Ok(l.local_addr()?.port())
}

/// What every round of the job runs: the program, its environment, this node's threads.
#[derive(Debug)]
pub(crate) struct Program {
    /// As given (for messages).
    pub name: String,
    /// As run.
    pub resolved: PathBuf,
    pub args: Vec<String>,
    pub threads: usize,
    pub nccl_dir: Option<PathBuf>,
}

/// One start of this node's ranks.
#[derive(Debug)]
pub(crate) struct Round<'a> {
    /// The job's global rank of this node's first rank.
    pub first_rank: usize,
    /// Ranks in the job.
    pub world: usize,
    /// This node's index among the nodes of this round.
    pub group_rank: usize,
    pub master_addr: &'a str,
    /// Where rank 0 hosts the ranks' rendezvous store.
    pub port: u16,
    pub token: Option<String>,
    /// KILN_RESTART_COUNT for the ranks (restarts only).
    pub restart: Option<usize>,
    /// Where each rank writes its heartbeat (`rank-N`), when watched.
    pub heartbeats: Option<&'a Path>,
}

/// A rank of a round, as the round's watcher sees it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Running {
    pub rank: usize,
    pub pid: u32,
}

/// What the round's watcher is told.
#[derive(Debug)]
pub(crate) enum Event<'a> {
    /// About every 100 ms: the ranks still running.
    Tick(&'a [Running]),
    /// A rank of this node failed (or hangs: `hang`), said before the others are stopped, so
    /// that the other nodes learn the cause before they see its consequences.
    Failing { why: &'a str, hang: bool },
}

/// What the round's watcher wants.
#[derive(Debug)]
pub(crate) enum Verdict {
    Continue,
    /// Stop the ranks: `why`; `hung` is killed at once (it may not act on SIGTERM); `hang`:
    /// whether this is a hang rather than a failure seen elsewhere.
    Stop {
        why: String,
        hung: Option<usize>,
        hang: bool,
    },
}

/// How a round ended.
#[derive(Debug)]
pub(crate) enum Ended {
    /// Every rank exited 0.
    Done,
    /// A rank failed (or was named hung): the launcher's exit code and what happened.
    Failed { code: i32, why: String, hang: bool },
    /// The launcher was sent a signal.
    Signal(i32),
    /// The watcher stopped the round without naming a rank of this node: a failure elsewhere,
    /// or a hang of the whole job (`hang`).
    Stopped { why: String, hang: bool },
}

/// A fresh directory for round `round`'s heartbeat files.
pub(crate) fn heartbeat_dir(round: usize) -> Result<PathBuf> {
    let dir =
        std::env::temp_dir().join(format!("kiln-launch-{}/round-{round}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)
        .with_context(|| format!("cannot create the heartbeat directory {}", dir.display()))?;
    Ok(dir)
}

/// Starts this node's ranks for `round`, watches them and returns how the round ended and
/// when that was seen (milliseconds since the epoch: a failure's detection, before the other
/// ranks are stopped); every rank has exited when it returns.
pub(crate) fn run_round(
    args: &LaunchArgs,
    prog: &Program,
    round: &Round<'_>,
    watch: &mut dyn FnMut(Event<'_>) -> Verdict,
) -> Result<(Ended, u64)> {
    let lock = Arc::new(Mutex::new(()));
    let mut ranks = Vec::with_capacity(args.nproc_per_node);
    let mut pumps = Vec::new();
    for local in 0..args.nproc_per_node {
        let rank = round.first_rank + local;
        let mut cmd = Command::new(&prog.resolved);
        cmd.args(&prog.args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", round.world.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", args.nproc_per_node.to_string())
            .env("GROUP_RANK", round.group_rank.to_string())
            .env("MASTER_ADDR", round.master_addr)
            .env("MASTER_PORT", round.port.to_string())
            .env("RAYON_NUM_THREADS", prog.threads.to_string())
            .env("OMP_NUM_THREADS", prog.threads.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // Own process group: stopping a rank stops what it started too.
            .process_group(0);
        if let Some(token) = &round.token {
            cmd.env("KILN_JOB_TOKEN", token);
        }
        if let Some(n) = round.restart {
            cmd.env("KILN_RESTART_COUNT", n.to_string());
        }
        if let Some(dir) = round.heartbeats {
            cmd.env(
                kiln_comm::progress::HEARTBEAT_FILE,
                dir.join(format!("rank-{rank}")),
            );
        }
        if let Some(dir) = &prog.nccl_dir {
            let old = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
            cmd.env("LD_LIBRARY_PATH", format!("{}:{old}", dir.display()));
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                stop_all(&mut ranks, args.grace);
                bail!(
                    "cannot start rank {rank} ({}): {}",
                    prog.name,
                    start_error(&prog.name, &e)
                );
            }
        };
        pumps.push(pump(
            rank,
            child.stdout.take().expect("piped"),
            false,
            lock.clone(),
        ));
        pumps.push(pump(
            rank,
            child.stderr.take().expect("piped"),
            true,
            lock.clone(),
        ));
        ranks.push(Rank {
            rank,
            child,
            status: None,
        });
    }

    let mut last_watch = Instant::now();
    let seen_ms = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64)
    };
    let mut at_ms;
    let ended = loop {
        at_ms = seen_ms();
        let sig = SIGNAL.swap(0, Ordering::SeqCst);
        if sig != 0 {
            eprintln!("[kiln launch] received signal {sig}; stopping the ranks");
            stop_all(&mut ranks, args.grace);
            break Ended::Signal(sig);
        }
        let mut failed = reap(&mut ranks)?;
        if !failed.is_empty() {
            // A rank's death makes its peers fail too (a reset connection) within milliseconds:
            // the others that end meanwhile are reaped, and the cause named is a rank killed by
            // a signal if one was, else the first to fail.
            std::thread::sleep(Duration::from_millis(50));
            failed.extend(reap(&mut ranks)?);
        }
        let cause = failed
            .iter()
            .find(|(_, s)| s.signal().is_some())
            .or(failed.first())
            .copied();
        if let Some((rank, status)) = cause {
            let running = ranks.iter().filter(|r| r.status.is_none()).count();
            let why = format!("rank {rank} {}", describe(status));
            eprintln!("[kiln launch] {why}; stopping the {running} other running rank(s)");
            watch(Event::Failing {
                why: &why,
                hang: false,
            });
            stop_all(&mut ranks, args.grace);
            break Ended::Failed {
                code: exit_code(status),
                why,
                hang: false,
            };
        }
        if ranks.iter().all(|r| r.status.is_some()) {
            break Ended::Done;
        }
        if last_watch.elapsed() >= Duration::from_millis(100) {
            last_watch = Instant::now();
            let running: Vec<Running> = ranks
                .iter()
                .filter(|r| r.status.is_none())
                .map(|r| Running {
                    rank: r.rank,
                    pid: r.child.id(),
                })
                .collect();
            if let Verdict::Stop { why, hung, hang } = watch(Event::Tick(&running)) {
                let running = running.len();
                eprintln!("[kiln launch] {why}; stopping the {running} running rank(s)");
                if hung.is_some() {
                    watch(Event::Failing { why: &why, hang });
                }
                if let Some(r) = hung.and_then(|h| ranks.iter_mut().find(|r| r.rank == h)) {
                    // SAFETY: kill(2) on a process group this launcher created.
                    unsafe { libc::kill(-(r.child.id() as libc::pid_t), libc::SIGKILL) };
                }
                stop_all(&mut ranks, args.grace);
                break match hung {
                    Some(_) => Ended::Failed { code: 1, why, hang },
                    None => Ended::Stopped { why, hang },
                };
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    for p in pumps {
        let _ = p.join();
    }
    Ok((ended, at_ms))
}

/// The ranks that ended since the last call, recorded; those that failed, in rank order.
fn reap(ranks: &mut [Rank]) -> Result<Vec<(usize, ExitStatus)>> {
    let mut failed = Vec::new();
    for r in ranks.iter_mut().filter(|r| r.status.is_none()) {
        if let Some(status) = r.child.try_wait().context("waiting for a rank")? {
            r.status = Some(status);
            if !status.success() {
                failed.push((r.rank, status));
            }
        }
    }
    Ok(failed)
}

/// SIGTERM to every running rank's process group, SIGKILL after `grace` seconds.
fn stop_all(ranks: &mut [Rank], grace: f64) {
    let signal_all = |ranks: &mut [Rank], sig| {
        for r in ranks.iter_mut().filter(|r| r.status.is_none()) {
            // SAFETY: kill(2) on a process group this launcher created.
            unsafe { libc::kill(-(r.child.id() as libc::pid_t), sig) };
        }
    };
    signal_all(ranks, libc::SIGTERM);
    // A stopped rank (SIGSTOP) acts on SIGTERM only once continued.
    signal_all(ranks, libc::SIGCONT);
    let deadline = Instant::now() + Duration::from_secs_f64(grace.max(0.0));
    loop {
        for r in ranks.iter_mut().filter(|r| r.status.is_none()) {
            if let Ok(Some(s)) = r.child.try_wait() {
                r.status = Some(s);
            }
        }
        if ranks.iter().all(|r| r.status.is_some()) {
            return;
        }
        if Instant::now() >= deadline {
            signal_all(ranks, libc::SIGKILL);
            for r in ranks.iter_mut().filter(|r| r.status.is_none()) {
                r.status = r.child.wait().ok();
            }
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
