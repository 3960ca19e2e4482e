//! What the CLI tests share: the binary, a launched job, the tiny recipe and a finished
//! process's output.

use std::ffi::OsStr;
use std::path::Path;
use std::process::{Command, Output};

/// The `kiln` binary under test.
pub const KILN: &str = env!("CARGO_BIN_EXE_kiln");

/// `kiln launch` of `n` local ranks on a free port, each running `kiln ARGS`, with a 60 s
/// collective timeout (a stuck job fails in a minute, not the default five).
#[allow(dead_code)]
pub fn launch<S: AsRef<OsStr>>(n: usize, args: impl IntoIterator<Item = S>) -> Command {
    let mut c = Command::new(KILN);
    c.args(["launch", "--nproc-per-node", &n.to_string()])
        .args(["--master-port", "0", "--", KILN])
        .args(args)
        .env("KILN_COMM_TIMEOUT", "60");
    c
}

/// A model and corpus small enough for a debug build.
#[allow(dead_code)] // not every test file trains
pub const TINY: &[&str] = &[
    "model.layers=1",
    "model.heads=2",
    "model.dim=16",
    "model.context=16",
    "train.seq_len=16",
    "train.batch_size=4",
    "train.warmup_steps=2",
    "train.eval_every=0",
    "train.eval_batches=1",
    "train.sample_chars=8",
    "data.synthetic_chars=20000",
    "output.progress_lines=4",
];

/// Its standard output, then its standard error.
pub fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Runs `c` and returns its output, asserting it succeeded.
#[allow(dead_code)]
pub fn run_ok(mut c: Command) -> String {
    let out = c.output().unwrap();
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    t
}

/// Runs `c` and returns its output, asserting it failed.
#[allow(dead_code)]
pub fn run_err(mut c: Command) -> String {
    let out = c.output().unwrap();
    let t = text(&out);
    assert!(!out.status.success(), "it succeeded:\n{t}");
    t
}

/// The training loss of every step in a run's metrics log.
#[allow(dead_code)]
pub fn losses(run: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            Some((v["step"].as_u64()?, v.get("loss")?.as_f64()?))
        })
        .collect()
}

/// The run's last validation loss, from its metrics log.
#[allow(dead_code)]
pub fn val_loss(run: &Path) -> f64 {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()?["val_loss"].as_f64())
        .expect("a validation loss")
}

/// The step of a run's newest snapshot.
#[allow(dead_code)]
pub fn latest_step(run: &Path) -> Option<usize> {
    let name = std::fs::read_to_string(run.join("snapshots/latest")).ok()?;
    name.trim().strip_prefix("step-")?.parse().ok()
}

/// Direct children of `pid` (a launcher's ranks), from /proc.
#[allow(dead_code)]
pub fn children(pid: u32) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| {
            let child: i32 = e.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
            // "pid (comm) state ppid ...": comm may hold spaces, so split after the last ')'.
            let ppid: u32 = stat
                .rsplit(')')
                .next()?
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()?;
            (ppid == pid).then_some(child)
        })
        .collect()
}

/// `kiln shard-check`'s arguments: 20 AdamW steps of `strategy` over the job's `backend`
/// against one device, from rank-seeded random weights (which sharding must make rank 0's).
#[allow(dead_code)]
pub fn shard_check_args<'a>(backend: &'a str, strategy: &'a str) -> [&'a str; 9] {
    [
        "shard-check",
        "--backend",
        backend,
        "--strategy",
        strategy,
        "--steps",
        "20",
        "--init",
        "burn",
    ]
}

/// Asserts that a shard-check job of `n` ranks reported `strategy` equal to one device.
#[allow(dead_code)]
pub fn assert_shard_check_passed(out: &str, strategy: &str, n: usize) {
    let shown = strategy.replace("hybrid:2", "hybrid(shard 2)");
    assert!(
        out.contains(&format!("rank 0 of {n}: {shown}, 20 steps")),
        "{out}"
    );
    assert!(!out.contains("FAIL"), "{out}");
}
