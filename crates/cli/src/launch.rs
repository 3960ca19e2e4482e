//! `kiln launch`: start the local ranks of a job with torchrun-style variables, prefix their
//! output with the rank, and stop them all when one fails. With `--max-restarts`, or an
//! elastic `--nnodes MIN:MAX`, the job is then started again from its latest snapshot
//! (`crate::recovery`).

use crate::round::{
    Ended, Event, Program, Round, Verdict, free_port, heartbeat_dir, on_signal, run_round,
};
use anyhow::{Context, Result, bail};

pub use crate::launch_args::LaunchArgs;

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
