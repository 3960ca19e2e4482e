//! The `kiln` command.
//!
//! - `kiln launch --nproc-per-node N [--nnodes M --node-rank R --master-addr A --master-port P]
//!   -- PROGRAM ARGS...` starts a job's local ranks.
//! - `kiln train [--recipe FILE] [--ranks N] [--strategy S] [--resume] ...` trains a model (see
//!   `kiln-train`); `kiln export RUN --out DIR` writes a snapshot as a Hugging Face directory.
//! - `kiln comm-check [--backend tcp|nccl]` verifies every collective on the job it runs in
//!   (start it under `kiln launch`, torchrun, srun or mpirun).
//!
//! A command's output goes to stdout, errors and the libraries' `tracing` diagnostics to stderr
//! (filter: `KILN_LOG`, else `RUST_LOG`, else kiln's crates at `info`).

#[cfg(test)]
mod doc_commands;
mod hang;
mod launch;
mod launch_args;
mod plan;
mod progress;
mod recovery;
mod round;
mod rounds;
mod shard_check;
mod train;
mod verify_hf;
mod verify_lora;

use anyhow::Result;
use clap::{Parser, Subcommand};
use kiln_comm::{ReduceOp, selftest};
use std::io::IsTerminal;
use std::time::{Duration, Instant};
use tracing_subscriber::EnvFilter;

#[derive(Debug, Parser)]
#[command(
    name = "kiln",
    version,
    about = "Train Burn models data-parallel, sharded, pipelined"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Train a GPT-2 or Llama model from a recipe (CPU by default; threads or launched ranks).
    Train(Box<train::TrainArgs>),
    /// Fine-tune LoRA adapters of a pretrained base (a Hugging Face directory); the base stays
    /// frozen. Writes PEFT's adapter files, optionally a merged model. Takes `kiln train`'s
    /// options (ranks, strategy, precision, snapshots, --resume).
    Finetune(Box<train::FinetuneArgs>),
    /// What a job needs per rank (memory by kind), its step time and what it costs, before it
    /// starts: kiln's own step run on shapes alone. Takes every option of `kiln train` and
    /// `kiln finetune`.
    Plan(Box<plan::PlanArgs>),
    /// Write a training snapshot as a Hugging Face directory (config.json, model.safetensors).
    Export(train::ExportArgs),
    /// Start the local ranks of a (possibly multi-node) job.
    Launch(launch::LaunchArgs),
    /// Check every collective and element type on this job's process group.
    CommCheck(CommCheckArgs),
    /// Compare a Hugging Face model directory with its PyTorch reference numbers.
    VerifyHf(verify_hf::VerifyHfArgs),
    /// Compare LoRA fine-tuning with PEFT's reference numbers (a lora-tiny-* fixture directory).
    VerifyLora(verify_lora::VerifyLoraArgs),
    /// Train a small model under a sharding strategy on this job and compare it with a single device.
    ShardCheck(shard_check::ShardCheckArgs),
}

#[derive(Debug, clap::Args)]
struct CommCheckArgs {
    /// The process group implementation.
    #[arg(long, default_value = "tcp", value_parser = ["tcp", "nccl", "mpi"])]
    backend: String,
    /// After the check, keep all-reducing for this many seconds (for fault drills).
    #[arg(long, default_value_t = 0.0)]
    soak: f64,
}

fn comm_check(args: &CommCheckArgs) -> Result<()> {
    let env = kiln_comm::LaunchEnv::from_env()?;
    let group = kiln_comm::join(&args.backend, &env, kiln_comm::GroupOptions::default())?;
    let start = Instant::now();
    let report = selftest::run(group.as_ref())?;
    println!(
        "rank {} of {}: {} collective checks passed on {} in {:.2}s",
        group.rank(),
        group.world_size(),
        report.checks,
        group.backend(),
        start.elapsed().as_secs_f64()
    );
    if args.soak > 0.0 {
        println!("soak: all-reducing for {:.0}s", args.soak);
        let end = Instant::now() + Duration::from_secs_f64(args.soak);
        let mut buf = vec![1.0f32; 1 << 16];
        while Instant::now() < end {
            group.all_reduce((&mut buf[..]).into(), ReduceOp::Avg)?;
            std::thread::sleep(Duration::from_millis(10));
        }
        group.barrier()?;
        println!("soak done");
    }
    Ok(())
}

/// The log filter when neither `KILN_LOG` nor `RUST_LOG` is set: kiln's crates at `info`,
/// everything else (Burn, CubeCL) at `warn`.
const DEFAULT_LOG: &str = "warn,kiln=info,kiln_comm=info,kiln_shard=info,kiln_train=info,\
                           kiln_hf=info,kiln_gpt2=info,kiln_llama=info,kiln_zoo=info";

/// Diagnostics (the libraries' `tracing` events) go to stderr, filtered by `KILN_LOG`, else
/// `RUST_LOG` (`kiln_comm=debug`, `warn`, ...), else [`DEFAULT_LOG`]; colours only on a terminal.
/// The commands' own output (progress, summaries, reports) is printed to stdout.
fn init_logging() {
    let directives = std::env::var("KILN_LOG")
        .or_else(|_| std::env::var("RUST_LOG"))
        .unwrap_or_else(|_| DEFAULT_LOG.to_string());
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::builder().parse_lossy(directives))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
}

/// Counts each rank's heap bytes by kind (parameters and optimizer state, activations,
/// backward, gathered parameters, communication buffers), for the memory table of `kiln
/// train`'s summary and `metrics.jsonl`; it forwards to the system allocator.
#[global_allocator]
static ALLOC: kiln_shard::account::RankAlloc = kiln_shard::account::RankAlloc;

fn main() {
    // Die quietly when the reader of our output goes away (`kiln train | head`), as Unix tools
    // do, instead of panicking on a broken pipe.
    // SAFETY: setting a signal's disposition to the default before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    kiln::shard::threads::keep_freed_memory();
    let cli = Cli::parse();
    init_logging();
    let code = match &cli.command {
        Command::Train(args) if args.plan_only() => {
            match args.recipe().and_then(|r| plan::plan_only(&r)) {
                Ok(()) => 0,
                Err(e) => {
                    eprintln!("kiln train: error: {e:#}");
                    1
                }
            }
        }
        Command::Finetune(args) if args.plan_only() => {
            match train::finetune_recipe(args).and_then(|r| plan::plan_only(&r)) {
                Ok(()) => 0,
                Err(e) => {
                    eprintln!("kiln finetune: error: {e:#}");
                    1
                }
            }
        }
        Command::Train(args) => match train::train(args) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("kiln train: error: {e:#}");
                1
            }
        },
        Command::Finetune(args) => match train::finetune(args) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("kiln finetune: error: {e:#}");
                1
            }
        },
        Command::Plan(args) => match plan::plan(args) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("kiln plan: error: {e:#}");
                1
            }
        },
        Command::Export(args) => match train::export(args) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("kiln export: error: {e:#}");
                1
            }
        },
        Command::Launch(args) => match launch::launch(args) {
            Ok(code) => code,
            Err(e) => {
                eprintln!("kiln launch: error: {e:#}");
                2
            }
        },
        Command::CommCheck(args) => match comm_check(args) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("kiln comm-check: error: {e:#}");
                1
            }
        },
        Command::ShardCheck(args) => match shard_check::shard_check(args) {
            Ok(true) => 0,
            Ok(false) => 1,
            Err(e) => {
                eprintln!("kiln shard-check: error: {e:#}");
                1
            }
        },
        Command::VerifyLora(args) => match verify_lora::verify_lora(args) {
            Ok(code) => code,
            Err(e) => {
                eprintln!("kiln verify-lora: error: {e:#}");
                2
            }
        },
        Command::VerifyHf(args) => match verify_hf::verify_hf(args) {
            Ok(code) => code,
            Err(e) => {
                eprintln!("kiln verify-hf: error: {e:#}");
                2
            }
        },
    };
    #[cfg(feature = "mpi")]
    if code != 0 {
        kiln_comm::mpi::failing();
    }
    std::process::exit(code);
}
