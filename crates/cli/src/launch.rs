//! `kiln launch`: start the local ranks of a job with torchrun-style variables, prefix their
//! output with the rank, and stop them all when one fails. With `--max-restarts`, or an
//! elastic `--nnodes MIN:MAX`, the job is then started again from its latest snapshot
//! (`crate::recovery`).

use anyhow::{Context, Result, bail};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What `kiln launch` was asked to do.
#[derive(Debug, Clone, clap::Args)]
pub struct LaunchArgs {
    /// Ranks to start on this node.
    #[arg(long)]
    pub nproc_per_node: usize,
    /// Nodes in the job: N, or MIN:MAX for an elastic job (a node that does not come back
    /// within --rdzv-timeout after a failure is left out, while MIN remain).
    #[arg(long, default_value = "1", value_parser = parse_nnodes)]
    pub nnodes: NodeCount,
    /// This node's index (0 hosts rank 0 and the rendezvous store).
    #[arg(long, default_value_t = 0)]
    pub node_rank: usize,
    /// Address of node 0, reachable from every node.
    #[arg(long, default_value = "127.0.0.1")]
    pub master_addr: String,
    /// Port of the rendezvous store on node 0 (0: pick a free one; single node only).
    #[arg(long, default_value_t = 29500)]
    pub master_port: u16,
    /// Seconds the other ranks get to exit after one fails, before they are killed.
    #[arg(long, default_value_t = 5.0)]
    pub grace: f64,
    /// Compute threads per rank (Burn's CPU kernels: RAYON_NUM_THREADS, and OMP_NUM_THREADS).
    /// Default: this node's cores divided among its ranks (at least 1), so that ranks do not
    /// oversubscribe the cores; a RAYON_NUM_THREADS already set is kept.
    #[arg(long)]
    pub threads_per_rank: Option<usize>,
    /// Restart the job this many times after a failure (a rank that exits with an error or
    /// is killed, or hangs: --hang-timeout), from its latest snapshot: the ranks see
    /// KILN_RESTART_COUNT, and `kiln train` then resumes (from step 0 when there is no
    /// snapshot yet).
    #[arg(long, default_value_t = 0)]
    pub max_restarts: usize,
    /// Seconds before the first restart; doubled for each restart in a row whose job made no
    /// step (at most 60).
    #[arg(long, default_value_t = 1.0)]
    pub restart_backoff: f64,
    /// Seconds without progress (no step, no message received) after which a rank that is not
    /// waiting on its peers, or that stopped running (SIGSTOP), is named and the job restarted
    /// as after a failure. 0: off.
    #[arg(long, default_value_t = 0.0)]
    pub hang_timeout: f64,
    /// With restarts: seconds the launchers wait for each other's nodes at each (re)start; an
    /// elastic job goes on without the nodes that have not come by then.
    #[arg(long, default_value_t = 60.0)]
    pub rdzv_timeout: f64,
    /// With restarts: write the recovery summary (restarts, steps recomputed, times to
    /// recover) to this file as JSON.
    #[arg(long)]
    pub summary: Option<PathBuf>,
    /// The program and its arguments.
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

/// `--nnodes`: a fixed count, or an elastic range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeCount {
    /// The fewest nodes the job runs on.
    pub min: usize,
    /// The most (node ranks are 0..max).
    pub max: usize,
}

impl NodeCount {
    /// Whether the job may run on fewer nodes than it has.
    pub fn elastic(&self) -> bool {
        self.min < self.max
    }
}

fn parse_nnodes(s: &str) -> std::result::Result<NodeCount, String> {
    let count = |t: &str| {
        t.trim()
            .parse::<usize>()
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| format!("'{t}' is not a node count (a whole number, at least 1)"))
    };
    let (min, max) = match s.split_once(':') {
        Some((a, b)) => (count(a)?, count(b)?),
        None => (count(s)?, count(s)?),
    };
    if min > max {
        return Err(format!("MIN:MAX with MIN ({min}) above MAX ({max})"));
    }
    Ok(NodeCount { min, max })
}

/// Compute threads per rank: `--threads-per-rank`, else a RAYON_NUM_THREADS the user set,
/// else the node's cores shared among its ranks.
fn threads_per_rank(
    flag: Option<usize>,
    env: Option<&str>,
    cores: usize,
    ranks: usize,
) -> Result<usize> {
    if let Some(n) = flag {
        if n == 0 {
            bail!("--threads-per-rank must be at least 1");
        }
        return Ok(n);
    }
    if let Some(n) = kiln::shard::threads::rayon_threads(env).map_err(anyhow::Error::msg)? {
        return Ok(n);
    }
    Ok((cores / ranks.max(1)).max(1))
}

/// Signals received by the launcher, forwarded to the ranks.
static SIGNAL: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
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

/// The program each rank runs. A path with a directory part (`target/release/kiln`,
/// `./train`) is made absolute against the launcher's working directory, so that it names the
/// same file whatever a rank does with its own; a bare name (`python3`) is looked up on `PATH`.
fn resolve_program(program: &str) -> Result<std::path::PathBuf> {
    let path = std::path::Path::new(program);
    if path.is_absolute() || path.components().count() < 2 {
        return Ok(path.to_path_buf());
    }
    Ok(std::env::current_dir()
        .context("reading the working directory")?
        .join(path))
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

/// Where `libnccl.so.2` lives when cudarc's name `libnccl.so` does not resolve: the launcher
/// makes a `libnccl.so` link to it in a private directory and puts that on the ranks'
/// `LD_LIBRARY_PATH` (cudarc dlopens by that name only).
fn nccl_link_dir() -> Option<std::path::PathBuf> {
    let mut dirs: Vec<std::path::PathBuf> = std::env::var("LD_LIBRARY_PATH")
        .unwrap_or_default()
        .split(':')
        .filter(|s| !s.is_empty())
        .map(Into::into)
        .collect();
    dirs.extend(
        [
            "/usr/lib/x86_64-linux-gnu",
            "/usr/lib/aarch64-linux-gnu",
            "/usr/local/cuda/lib64",
            "/usr/lib64",
            "/usr/lib",
        ]
        .map(Into::into),
    );
    if dirs.iter().any(|d| d.join("libnccl.so").exists()) {
        return None;
    }
    let target = dirs
        .iter()
        .map(|d| d.join("libnccl.so.2"))
        .find(|p| p.exists())?;
    let dir = std::env::temp_dir().join(format!("kiln-nccl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).ok()?;
    let link = dir.join("libnccl.so");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&target, &link).ok()?;
    Some(dir)
}

/// The job's secret, which every rank presents to the store and its peers: `KILN_JOB_TOKEN`
/// when set (on several nodes it must be, the same on each: a node's launcher cannot tell the
/// others), else, on one node, 128 fresh random bits.
fn job_token(nnodes: usize) -> Result<Option<String>> {
    if let Some(t) = std::env::var("KILN_JOB_TOKEN")
        .ok()
        .filter(|t| !t.trim().is_empty())
    {
        return Ok(Some(t));
    }
    if nnodes > 1 {
        eprintln!(
            "kiln launch: KILN_JOB_TOKEN is not set, so the rendezvous store and the ranks admit \
             any connection that reaches them; export the same secret on every node (e.g. \
             KILN_JOB_TOKEN=$(openssl rand -hex 16)) to admit only this job"
        );
        return Ok(None);
    }
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut bytes))
        .context("cannot read /dev/urandom for the job token; set KILN_JOB_TOKEN")?;
    Ok(Some(bytes.iter().map(|b| format!("{b:02x}")).collect()))
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

/// Runs the job's local ranks; returns the exit code for the launcher.
pub fn launch(args: &LaunchArgs) -> Result<i32> {
    if args.nproc_per_node == 0 {
        bail!("--nproc-per-node must be at least 1");
    }
    if args.node_rank >= args.nnodes.max {
        bail!(
            "--node-rank {} is out of range for --nnodes {} (nodes are 0..{})",
            args.node_rank,
            args.nnodes.max,
            args.nnodes.max
        );
    }
    for (flag, v) in [
        ("--grace", args.grace),
        ("--restart-backoff", args.restart_backoff),
        ("--hang-timeout", args.hang_timeout),
        ("--rdzv-timeout", args.rdzv_timeout),
    ] {
        if !v.is_finite() || v < 0.0 {
            bail!("{flag} must be a number of seconds, at least 0 (got {v})");
        }
    }
    if args.hang_timeout > 0.0 && args.hang_timeout < 1.0 {
        // Heartbeats come every 200 ms; a process is taken as stopped after 1 s without one.
        bail!(
            "--hang-timeout must be 0 (off) or at least 1 second (got {})",
            args.hang_timeout
        );
    }
    let restarts = args.max_restarts > 0 || args.nnodes.elastic();
    if args.master_port == 0 && args.nnodes.max > 1 {
        bail!(
            "--master-port 0 (pick a free port) only works on one node: every node must be given \
             the same port"
        );
    }
    if restarts && args.master_port == u16::MAX {
        bail!(
            "--master-port {}: restarts use it and the next port",
            u16::MAX
        );
    }
    let token = job_token(args.nnodes.max)?;
    let (program, program_args) = args.command.split_first().expect("clap requires a command");
    let prog = Program {
        name: program.clone(),
        resolved: resolve_program(program)?,
        args: program_args.to_vec(),
        threads: threads_per_rank(
            args.threads_per_rank,
            std::env::var("RAYON_NUM_THREADS").ok().as_deref(),
            std::thread::available_parallelism().map_or(1, |n| n.get()),
            args.nproc_per_node,
        )?,
        nccl_dir: nccl_link_dir(),
    };

    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }

    let code = if restarts {
        crate::recovery::supervise(args, &prog, token)
    } else {
        let port = match args.master_port {
            0 => free_port()?,
            p => p,
        };
        let heartbeats = (args.hang_timeout > 0.0)
            .then(|| heartbeat_dir(0))
            .transpose()?;
        let round = Round {
            first_rank: args.node_rank * args.nproc_per_node,
            world: args.nproc_per_node * args.nnodes.max,
            group_rank: args.node_rank,
            master_addr: &args.master_addr,
            port,
            token,
            restart: None,
            heartbeats: heartbeats.as_deref(),
        };
        let mut hangs = crate::hang::HangWatch::new(
            args.hang_timeout,
            heartbeats.clone(),
            args.nnodes.max == 1,
        );
        let ended = run_round(args, &prog, &round, &mut |event| match event {
            Event::Tick(ranks) => hangs.check(ranks),
            Event::Failing { .. } => Verdict::Continue,
        });
        if let Some(dir) = &heartbeats {
            let _ = std::fs::remove_dir_all(dir);
        }
        match ended?.0 {
            Ended::Done => Ok(0),
            Ended::Failed { code, .. } => Ok(code),
            Ended::Signal(sig) => Ok(128 + sig),
            Ended::Stopped { .. } => Ok(1),
        }
    };
    if let Some(dir) = &prog.nccl_dir {
        let _ = std::fs::remove_dir_all(dir);
    }
    code
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

#[cfg(test)]
mod tests {
    use super::threads_per_rank;

    #[test]
    fn ranks_share_the_cores_unless_told_otherwise() {
        assert_eq!(threads_per_rank(None, None, 16, 4).unwrap(), 4);
        assert_eq!(threads_per_rank(None, None, 2, 4).unwrap(), 1);
        assert_eq!(threads_per_rank(None, Some("3"), 16, 4).unwrap(), 3);
        assert_eq!(threads_per_rank(Some(2), Some("3"), 16, 4).unwrap(), 2);
        let err = threads_per_rank(None, Some("many"), 16, 4).unwrap_err();
        assert!(err.to_string().contains("RAYON_NUM_THREADS"), "{err}");
        assert!(threads_per_rank(Some(0), None, 16, 4).is_err());
    }
}
