//! `kiln launch`: start the local ranks of a job with torchrun-style variables, prefix their
//! output with the rank, and stop them all when one fails.

use anyhow::{Context, Result, bail};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
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
    /// Nodes in the job.
    #[arg(long, default_value_t = 1)]
    pub nnodes: usize,
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
    /// The program and its arguments.
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
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
fn free_port() -> Result<u16> {
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

/// Runs the job's local ranks; returns the exit code for the launcher.
pub fn launch(args: &LaunchArgs) -> Result<i32> {
    if args.nproc_per_node == 0 {
        bail!("--nproc-per-node must be at least 1");
    }
    if args.nnodes == 0 {
        bail!("--nnodes must be at least 1");
    }
    if args.node_rank >= args.nnodes {
        bail!(
            "--node-rank {} is out of range for --nnodes {} (nodes are 0..{})",
            args.node_rank,
            args.nnodes,
            args.nnodes
        );
    }
    let port = match args.master_port {
        0 if args.nnodes > 1 => bail!(
            "--master-port 0 (pick a free port) only works on one node: every node must be given \
             the same port"
        ),
        0 => free_port()?,
        p => p,
    };
    let world = args.nproc_per_node * args.nnodes;
    let token = job_token(args.nnodes)?;
    let (program, program_args) = args.command.split_first().expect("clap requires a command");
    let resolved = resolve_program(program)?;
    let nccl_dir = nccl_link_dir();
    let lock = Arc::new(Mutex::new(()));

    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }

    let threads = threads_per_rank(
        args.threads_per_rank,
        std::env::var("RAYON_NUM_THREADS").ok().as_deref(),
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        args.nproc_per_node,
    )?;

    let mut ranks = Vec::with_capacity(args.nproc_per_node);
    let mut pumps = Vec::new();
    for local in 0..args.nproc_per_node {
        let rank = args.node_rank * args.nproc_per_node + local;
        let mut cmd = Command::new(&resolved);
        cmd.args(program_args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", args.nproc_per_node.to_string())
            .env("GROUP_RANK", args.node_rank.to_string())
            .env("MASTER_ADDR", &args.master_addr)
            .env("MASTER_PORT", port.to_string())
            .env("RAYON_NUM_THREADS", threads.to_string())
            .env("OMP_NUM_THREADS", threads.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // Own process group: stopping a rank stops what it started too.
            .process_group(0);
        if let Some(token) = &token {
            cmd.env("KILN_JOB_TOKEN", token);
        }
        if let Some(dir) = &nccl_dir {
            let old = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
            cmd.env("LD_LIBRARY_PATH", format!("{}:{old}", dir.display()));
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                stop_all(&mut ranks, args.grace);
                bail!(
                    "cannot start rank {rank} ({program}): {}",
                    start_error(program, &e)
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

    let code = loop {
        let sig = SIGNAL.swap(0, Ordering::SeqCst);
        if sig != 0 {
            eprintln!("[kiln launch] received signal {sig}; stopping the ranks");
            stop_all(&mut ranks, args.grace);
            break 128 + sig;
        }
        let mut failed = None;
        for r in ranks.iter_mut().filter(|r| r.status.is_none()) {
            if let Some(status) = r.child.try_wait().context("waiting for a rank")? {
                r.status = Some(status);
                if !status.success() && failed.is_none() {
                    failed = Some((r.rank, status));
                }
            }
        }
        if let Some((rank, status)) = failed {
            let running = ranks.iter().filter(|r| r.status.is_none()).count();
            eprintln!(
                "[kiln launch] rank {rank} {}; stopping the {running} other running rank(s)",
                describe(status)
            );
            stop_all(&mut ranks, args.grace);
            break exit_code(status);
        }
        if ranks.iter().all(|r| r.status.is_some()) {
            break 0;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    for p in pumps {
        let _ = p.join();
    }
    if let Some(dir) = nccl_dir {
        let _ = std::fs::remove_dir_all(dir);
    }
    Ok(code)
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
