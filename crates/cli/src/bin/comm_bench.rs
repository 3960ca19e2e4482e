//! `comm-bench`: all-reduce bandwidth of kiln's process groups, beside this machine's memcpy
//! bandwidth measured in the same run.
//!
//! ```text
//! cargo run --release -p kiln-cli --bin comm-bench                      # local + tcp, N = 2,4,8
//! cargo run --release -p kiln-cli --bin comm-bench -- --max-size 16M    # a quicker run
//! kiln launch --nproc-per-node 4 -- target/release/comm-bench           # tcp across processes
//! target/release/comm-bench --groups tcp-mp --ranks 2,4 --min-size 1M --repeat 3
//! ```
//!
//! `tcp-mp` spawns the ranks as processes of this binary (the launcher's variables set for
//! each), one job per world size; `mpi-mp` starts them with `mpirun` over the system's MPI
//! (a build with `--features mpi`); `--repeat` keeps each size's best of several timed runs, for
//! a machine that is busy with other work. `bench/torch/allreduce_gloo.py` prints the same
//! columns for PyTorch's gloo, and `scripts/bench-allreduce.sh` puts the two side by side.
//!
//! busbw = algbw x 2(N-1)/N, as nccl-tests defines it: the bandwidth each rank's links carry in
//! a ring all-reduce, comparable across world sizes. Without launcher variables the ranks are
//! threads of this process: `local` passes messages in memory, `tcp` uses real loopback
//! sockets (one per pair of ranks). Under `kiln launch` the ranks are processes.

use anyhow::{Context, Result, bail};
use clap::Parser;
use kiln_comm::store::{StoreClient, StoreServer};
use kiln_comm::{GroupOptions, LocalGroup, ProcessGroup, ReduceOp, TcpGroup};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Debug, Parser)]
#[command(
    name = "comm-bench",
    about = "All-reduce bandwidth of kiln's process groups"
)]
struct Args {
    /// World sizes to run (in-process mode).
    #[arg(long, value_delimiter = ',', default_value = "2,4,8")]
    ranks: Vec<usize>,
    /// Group kinds to run: local, tcp (ranks as threads), tcp-mp (ranks as processes), mpi-mp
    /// (ranks as processes of an `mpirun` job; needs `--features mpi`).
    #[arg(long, value_delimiter = ',', default_value = "local,tcp")]
    groups: Vec<String>,
    /// Smallest message (bytes; K, M, G suffixes).
    #[arg(long, default_value = "1K", value_parser = parse_size)]
    min_size: usize,
    /// Largest message.
    #[arg(long, default_value = "256M", value_parser = parse_size)]
    max_size: usize,
    /// Each size grows by this factor, from --min-size to --max-size.
    #[arg(long, default_value_t = 4)]
    factor: usize,
    /// Timed runs per size; the best is reported (a busy machine only ever slows a run).
    #[arg(long, default_value_t = 1)]
    repeat: usize,
    /// Process group under a launcher: tcp, nccl (needs `--features nccl`) or mpi (under
    /// mpirun; needs `--features mpi`).
    #[arg(long, default_value = "tcp")]
    backend: String,
}

fn parse_size(s: &str) -> Result<usize, String> {
    let (num, mult) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>()
        .map(|n| n * mult)
        .map_err(|_| format!("{s:?} is not a size like 4K, 16M"))
}

fn human(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 30 => format!("{}G", b >> 30),
        b if b >= 1 << 20 => format!("{}M", b >> 20),
        b if b >= 1 << 10 => format!("{}K", b >> 10),
        b => format!("{b}B"),
    }
}

fn sizes(args: &Args) -> Vec<usize> {
    let mut v = Vec::new();
    let mut s = args.min_size.max(4);
    while s <= args.max_size {
        v.push(s);
        s *= args.factor.max(2);
    }
    v
}

/// memcpy bandwidth: bytes copied per second, best of a few copies of the largest message.
fn memcpy_bandwidth(bytes: usize) -> f64 {
    let n = bytes.max(1 << 20) / 4;
    let src = vec![1.0f32; n];
    let mut dst = vec![0.0f32; n];
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        dst.copy_from_slice(&src);
        std::hint::black_box(&mut dst);
        best = best.min(t.elapsed().as_secs_f64());
    }
    (n * 4) as f64 / best
}

/// Iterations per size: enough to time small messages, few for large ones. Every rank
/// computes the same count, as collectives require.
fn iterations(bytes: usize) -> usize {
    ((64usize << 20) / bytes).clamp(2, 200)
}

/// Times all-reduces on one rank; returns seconds per all-reduce for each size, the best of
/// `repeat` timed runs.
fn run_rank(group: &dyn ProcessGroup, sizes: &[usize], repeat: usize) -> Result<Vec<f64>> {
    let mut times = Vec::new();
    for &bytes in sizes {
        let mut buf = vec![1.0f32; bytes / 4];
        group.all_reduce((&mut buf[..]).into(), ReduceOp::Sum)?; // warm-up
        let iters = iterations(bytes);
        let mut best = f64::MAX;
        for _ in 0..repeat.max(1) {
            group.barrier()?;
            let t = Instant::now();
            for _ in 0..iters {
                group.all_reduce((&mut buf[..]).into(), ReduceOp::Sum)?;
            }
            group.barrier()?;
            best = best.min(t.elapsed().as_secs_f64() / iters as f64);
        }
        times.push(best);
    }
    Ok(times)
}

fn report(kind: &str, n: usize, sizes: &[usize], times: &[f64], memcpy: f64) {
    for (&bytes, &t) in sizes.iter().zip(times) {
        let algbw = bytes as f64 / t;
        let busbw = algbw * 2.0 * (n as f64 - 1.0) / n as f64;
        println!(
            "{kind:<6} {n:>3} {:>6}  {:<4}  {:>12.1} {:>10.3} {:>10.3} {:>10.3}",
            human(bytes),
            // MPI chooses its own algorithm per size; kiln's groups run a ring.
            if kind.starts_with("mpi") {
                "mpi"
            } else {
                "ring"
            },
            t * 1e6,
            algbw / 1e9,
            busbw / 1e9,
            busbw / memcpy
        );
    }
}

fn header(memcpy: f64) {
    println!("memcpy bandwidth of this machine: {:.2} GB/s", memcpy / 1e9);
    println!(
        "{:<6} {:>3} {:>6}  {:<4}  {:>12} {:>10} {:>10} {:>10}",
        "group", "N", "size", "alg", "time (us)", "algbw GB/s", "busbw GB/s", "busbw/mcpy"
    );
}

/// Runs one job of `n` processes of this binary (rank 0 prints its rows), as `kiln launch`
/// would start them, on a free loopback port.
fn processes(n: usize) -> Result<()> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let exe = std::env::current_exe().context("finding this binary")?;
    let args: Vec<String> = std::env::args().skip(1).collect();
    let children: Vec<std::process::Child> = (0..n)
        .map(|rank| {
            std::process::Command::new(&exe)
                .args(&args)
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("WORLD_SIZE", n.to_string())
                .env("LOCAL_WORLD_SIZE", n.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("KILN_COMM_BENCH_CHILD", "1")
                .spawn()
                .context("starting a rank")
        })
        .collect::<Result<_>>()?;
    let mut failed = 0;
    for mut child in children {
        if !child.wait()?.success() {
            failed += 1;
        }
    }
    if failed > 0 {
        bail!("{failed} of {n} ranks failed");
    }
    Ok(())
}

/// One `mpirun` job of `n` ranks of this binary, on the mpi backend.
fn mpi_processes(n: usize) -> Result<()> {
    if !kiln_comm::BACKENDS.contains(&("mpi", true)) {
        bail!("mpi-mp needs a build with `--features mpi`");
    }
    let exe = std::env::current_exe().context("finding this binary")?;
    let status = std::process::Command::new("mpirun")
        // This machine may have fewer cores than ranks, and benchmarks may run as root.
        .args(["--oversubscribe", "-np", &n.to_string()])
        .arg(&exe)
        .args(std::env::args().skip(1))
        .args(["--backend", "mpi"])
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("KILN_COMM_BENCH_CHILD", "1")
        .status()
        .context("starting mpirun (Open MPI's launcher)")?;
    if !status.success() {
        bail!("the mpirun job of {n} ranks failed ({status})");
    }
    Ok(())
}

fn in_process(kind: &str, n: usize, sizes: &[usize], repeat: usize) -> Result<Vec<f64>> {
    let options = GroupOptions::default().with_timeout(Duration::from_secs(600));
    let results: Vec<Result<Vec<f64>>> = match kind {
        "local" => {
            kiln_comm::spawn_ranks_with(n, options, |g: LocalGroup| run_rank(&g, sizes, repeat))
        }
        "tcp" => {
            let server = StoreServer::bind("127.0.0.1:0")?;
            let addr = server.local_addr().to_string();
            std::thread::scope(|s| {
                let handles: Vec<_> = (0..n)
                    .map(|rank| {
                        let (addr, options) = (addr.clone(), options.clone());
                        s.spawn(move || -> Result<Vec<f64>> {
                            let store = Arc::new(StoreClient::connect(&addr, options.timeout)?);
                            let g = TcpGroup::connect(store, rank, n, options)?;
                            run_rank(&g, sizes, repeat)
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().expect("rank thread panicked"))
                    .collect()
            })
        }
        other => bail!("unknown group kind {other:?} (local, tcp, tcp-mp, mpi-mp)"),
    };
    results.into_iter().next().expect("at least one rank")
}

fn main() -> Result<()> {
    let args = Args::parse();
    let sizes = sizes(&args);
    if sizes.is_empty() {
        bail!("no sizes between --min-size and --max-size");
    }
    let memcpy = memcpy_bandwidth(*sizes.last().expect("non-empty"));
    if kiln_comm::LaunchEnv::launched() {
        let env = kiln_comm::LaunchEnv::from_env()?;
        let group = kiln_comm::join(&args.backend, &env, GroupOptions::default())
            .context("joining the launched job")?;
        // A job started by `--groups tcp-mp` shares the parent's table header.
        let child = std::env::var_os("KILN_COMM_BENCH_CHILD").is_some();
        if group.rank() == 0 && !child {
            println!("ranks are processes (kiln launch); message sizes per rank");
            header(memcpy);
        }
        let times = run_rank(group.as_ref(), &sizes, args.repeat)?;
        if group.rank() == 0 {
            let kind = format!("{}-mp", group.backend());
            report(&kind, group.world_size(), &sizes, &times, memcpy);
        }
        return Ok(());
    }
    println!(
        "ranks are threads of this process, or processes for tcp-mp and mpi-mp ({} cores)",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    header(memcpy);
    for kind in &args.groups {
        for &n in &args.ranks {
            if kind == "tcp-mp" {
                processes(n)?;
                continue;
            }
            if kind == "mpi-mp" {
                mpi_processes(n)?;
                continue;
            }
            let times = in_process(kind, n, &sizes, args.repeat)?;
            report(kind, n, &sizes, &times, memcpy);
        }
    }
    Ok(())
}
