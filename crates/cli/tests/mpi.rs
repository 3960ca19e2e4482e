//! `kiln` under Open MPI's `mpirun` with `parallel.backend = "mpi"` (feature `mpi`; CI
//! installs Open MPI from Debian): `shard-check` of every strategy at 2 to 4 ranks, training
//! under every sharding strategy, and pipelines with ZeRO-3 or hybrid sharding on the
//! data-parallel axis, equal the same job on one device or machine, `kiln comm-check` passes, and a job that MPI did not start is
//! refused with the reason.
#![cfg(feature = "mpi")]

use std::path::Path;
use std::process::Command;

mod common;
use common::{KILN, TINY, assert_shard_check_passed, run_err, run_ok, shard_check_args, val_loss};

fn mpirun(n: usize) -> Command {
    let mut c = Command::new("mpirun");
    // CI runs as root; the machine has fewer cores than ranks.
    c.args([
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        &n.to_string(),
        KILN,
    ]);
    c
}

fn train(c: &mut Command, out: &Path, extra: &[&str]) {
    c.arg("train");
    for s in TINY {
        c.args(["--set", s]);
    }
    c.args([
        "--steps",
        "8",
        "--out",
        &out.display().to_string(),
        "--overwrite",
    ])
    .args(extra);
}

#[test]
fn training_under_mpirun_equals_one_machine() {
    let tmp = tempfile::tempdir().unwrap();
    // (name, ranks, the job's flags, the one-machine job's flags)
    let cases: [(&str, usize, &[&str], &[&str]); 5] = [
        (
            "ddp",
            4,
            &["--strategy", "ddp"],
            &["--strategy", "ddp", "--ranks", "4"],
        ),
        (
            "zero3",
            4,
            &["--strategy", "zero3"],
            &["--strategy", "zero3", "--ranks", "4"],
        ),
        (
            "hybrid-2",
            4,
            &["--strategy", "hybrid:2"],
            &["--strategy", "hybrid:2", "--ranks", "4"],
        ),
        // Stages exchange activations and gradients point to point, with ZeRO-3 across each
        // stage's pair; ZeRO-3 under stages as threads is refused, so the reference is one rank.
        (
            "pp2-zero3",
            4,
            &[
                "--strategy",
                "zero3",
                "--pp",
                "2",
                "--microbatches",
                "2",
                "--set",
                "model.layers=2",
            ],
            &["--set", "model.layers=2"],
        ),
        // 2 stages x 4 data-parallel ranks, hybrid: sharded in pairs, replicated across them.
        (
            "pp2-hybrid-2",
            8,
            &[
                "--strategy",
                "hybrid:2",
                "--pp",
                "2",
                "--microbatches",
                "2",
                "--set",
                "model.layers=2",
                "--set",
                "train.batch_size=8",
            ],
            &["--set", "model.layers=2", "--set", "train.batch_size=8"],
        ),
    ];
    for (name, ranks, job, reference) in cases {
        let under = tmp.path().join(format!("{name}-mpi"));
        let mut c = mpirun(ranks);
        train(&mut c, &under, job);
        c.args(["--set", "parallel.backend=\"mpi\""]);
        let t = run_ok(c);
        assert!(t.contains(&format!("on {ranks} rank(s)")), "{name}:\n{t}");

        let here = tmp.path().join(format!("{name}-here"));
        let mut c = Command::new(KILN);
        train(&mut c, &here, reference);
        run_ok(c);
        let (a, b) = (val_loss(&under), val_loss(&here));
        assert!(
            (a - b).abs() <= 1e-5 * b,
            "{name}: mpirun {a} vs one machine {b}"
        );
        eprintln!("{name}: mpirun {a}, one machine {b}");
    }
}

#[test]
fn every_strategy_equals_one_device_under_mpirun() {
    for (strategy, n) in [
        ("ddp", 2),
        ("zero1", 2),
        ("zero2", 3),
        ("zero3", 2),
        ("zero3", 3),
        ("hybrid:2", 4),
    ] {
        let mut c = mpirun(n);
        c.args(shard_check_args("mpi", strategy));
        assert_shard_check_passed(&run_ok(c), strategy, n);
    }
}

#[test]
fn comm_check_passes_under_mpirun() {
    let mut c = mpirun(3);
    c.args(["comm-check", "--backend", "mpi"]);
    let t = run_ok(c);
    for rank in 0..3 {
        assert!(
            t.contains(&format!("rank {rank} of 3: "))
                && t.contains("collective checks passed on mpi"),
            "{t}"
        );
    }
}

#[test]
fn a_job_mpi_did_not_start_is_refused_with_the_reason() {
    // `kiln launch` starts its ranks for the tcp and nccl backends; MPI sees each as a job of
    // its own.
    let tmp = tempfile::tempdir().unwrap();
    let mut c = Command::new(KILN);
    c.args(["launch", "--nproc-per-node", "2", "--", KILN]);
    train(
        &mut c,
        &tmp.path().join("run"),
        &["--set", "parallel.backend=\"mpi\""],
    );
    let t = run_err(c);
    assert!(
        t.contains("MPI sees rank 0 of 1 but the launcher's variables"),
        "{t}"
    );
    assert!(t.contains("mpirun"), "{t}");
}
