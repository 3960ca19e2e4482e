//! `MpiGroup` under Open MPI's `mpirun` (feature `mpi`; CI installs Open MPI from Debian).
//!
//! Each test starts `mpirun -np N` on this test binary, running one of the `#[ignore]`d rank
//! functions below in every process, and checks what the job printed and how it ended.
#![cfg(feature = "mpi")]

use kiln_comm::{
    CommError, GroupOptions, MpiGroup, OpKind, ProcessGroup, ReduceOp, selftest, shard_range,
};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// `mpirun -np n` on this binary's test `rank_fn`, with extra environment.
fn mpirun(n: usize, rank_fn: &str, env: &[(&str, &str)]) -> (Output, Duration) {
    let mut c = Command::new("mpirun");
    // CI runs as root; the machine has fewer cores than ranks.
    c.args([
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        &n.to_string(),
    ])
    .arg(std::env::current_exe().unwrap())
    .args([
        "--exact",
        rank_fn,
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ]);
    for (k, v) in env {
        c.env(k, v);
    }
    let start = Instant::now();
    let out = c.output().unwrap_or_else(|e| {
        panic!(
            "cannot run mpirun ({e}): the mpi feature's tests need Open MPI (Debian: openmpi-bin)"
        )
    });
    (out, start.elapsed())
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn world() -> MpiGroup {
    MpiGroup::world(GroupOptions::default()).unwrap()
}

#[test]
fn every_collective_and_dtype_at_2_3_and_4_ranks() {
    for n in [2, 3, 4] {
        let (out, _) = mpirun(n, "conformance_rank", &[]);
        let t = text(&out);
        assert!(out.status.success(), "{n} ranks:\n{t}");
        for rank in 0..n {
            assert!(
                t.contains(&format!("rank {rank} of {n}: conformance ok")),
                "{n} ranks, rank {rank} missing:\n{t}"
            );
        }
    }
}

/// One rank of the conformance job.
#[test]
#[ignore = "a rank of an mpirun job (started by every_collective_and_dtype_at_2_3_and_4_ranks)"]
fn conformance_rank() {
    let g = world();
    let (rank, n) = (g.rank(), g.world_size());
    assert_eq!(g.backend(), "mpi");

    // Every collective, element type and reduce operation, and a split (the shared check).
    let report = selftest::run(&g).unwrap_or_else(|e| panic!("rank {rank}: {e}"));
    assert!(report.checks > 300, "{report:?}");

    // Floating-point sums that round: every rank must hold bitwise the same result, or
    // data-parallel replicas drift apart.
    let len = 100_003;
    let mut v: Vec<f32> = (0..len)
        .map(|i| ((i * 7919 + rank * 104_729) % 1000) as f32 * 1.37e-3 + 0.1 / (rank + 1) as f32)
        .collect();
    g.all_reduce((&mut v[..]).into(), ReduceOp::Sum).unwrap();
    let mut all = vec![0f32; len * n];
    let mine = shard_range(len * n, n, rank);
    assert_eq!(mine.len(), len);
    g.all_gather((&v[..]).into(), (&mut all[..]).into())
        .unwrap();
    for r in 1..n {
        assert!(
            all[..len] == all[r * len..(r + 1) * len],
            "rank {r}'s all-reduce result differs from rank 0's"
        );
    }

    // Sends do not wait for the receiver: every rank sends 4 MiB to its right neighbour before
    // receiving from its left (with sends that wait, this ring would deadlock).
    let big: Vec<f32> = (0..1 << 20).map(|i| (i + rank) as f32).collect();
    let (right, left) = ((rank + 1) % n, (rank + n - 1) % n);
    g.send((&big[..]).into(), right).unwrap();
    let mut got = vec![0f32; 1 << 20];
    g.recv((&mut got[..]).into(), left).unwrap();
    assert!(got.iter().enumerate().all(|(i, &x)| x == (i + left) as f32));

    // The counters see an all-reduce move 2 (N-1)/N of its buffer.
    let before = g.stats().get(OpKind::AllReduce);
    let mut w = vec![1i64; 6000];
    g.all_reduce((&mut w[..]).into(), ReduceOp::Sum).unwrap();
    assert!(w.iter().all(|&x| x == n as i64));
    let after = g.stats().get(OpKind::AllReduce);
    assert_eq!(after.calls, before.calls + 1);
    assert_eq!(
        after.bytes_sent - before.bytes_sent,
        (2 * (n - 1) * 6000 * 8 / n) as u64
    );

    // Misuse is named on a sub-group of all ranks (an error makes a group unusable).
    let every: Vec<usize> = (0..n).collect();
    let bad = g.split(&every, "mismatch").unwrap();
    let mut x = vec![0f32; if rank == 0 { 5 } else { 6 }];
    match bad.all_reduce((&mut x[..]).into(), ReduceOp::Sum) {
        Err(CommError::Mismatch {
            expected, found, ..
        }) => {
            let (mine, theirs) = if rank == 0 { ("5", "6") } else { ("6", "5") };
            assert!(expected.contains(&format!("{mine} elements")), "{expected}");
            assert!(found.contains(&format!("{theirs} elements")), "{found}");
        }
        other => panic!("rank {rank}: expected a mismatch, got {other:?}"),
    }
    assert!(matches!(bad.barrier(), Err(CommError::Poisoned { .. })));
    // A message received as another type.
    let p2p = g.split(&every, "p2p").unwrap();
    if rank == 0 {
        p2p.send((&[1f32, 2.0, 3.0, 4.0][..]).into(), 1).unwrap();
    } else if rank == 1 {
        let mut as_bf16 = [kiln_comm::bf16::ZERO; 8];
        let err = p2p
            .recv((&mut as_bf16[..]).into(), 0)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("this rank called recv of 8 bf16 but rank 0 called send of 4 f32"),
            "{err}"
        );
    }
    // Out-of-range arguments.
    let err = g.broadcast((&mut w[..]).into(), n).unwrap_err().to_string();
    assert!(
        err.contains(&format!("root {n} is not in this {n}-rank group")),
        "{err}"
    );
    g.barrier().unwrap();
    println!("rank {rank} of {n}: conformance ok");
}

#[test]
fn a_rank_that_never_comes_is_a_named_timeout_and_mpirun_fails() {
    // Rank 1 skips the all-reduce and lingers; rank 0 must fail after its 2 s timeout, naming
    // the collective, and the job must end then (rank 0 exits without MPI_Finalize, so
    // mpirun stops rank 1), not when rank 1 would have finished.
    let (out, took) = mpirun(2, "timeout_rank", &[("KILN_COMM_TIMEOUT", "2")]);
    let t = text(&out);
    assert!(!out.status.success(), "{t}");
    assert!(
        t.contains(
            "all_reduce #1 on group 'world' (rank 0 of 2): timed out after 2s waiting for a peer"
        ),
        "{t}"
    );
    assert!(took < Duration::from_secs(40), "took {took:?}:\n{t}");
}

#[test]
#[ignore = "a rank of an mpirun job (started by a_rank_that_never_comes_is_a_named_timeout_and_mpirun_fails)"]
fn timeout_rank() {
    let g = world();
    g.barrier().unwrap();
    if g.rank() == 1 {
        std::thread::sleep(Duration::from_secs(60));
        return;
    }
    let mut v = vec![1f32; 1000];
    let err = g
        .all_reduce((&mut v[..]).into(), ReduceOp::Sum)
        .unwrap_err();
    // The panic (as a kiln command's failing exit would) skips MPI_Finalize, which would wait
    // for the lingering rank.
    panic!("{err}");
}

#[test]
fn a_rank_that_dies_ends_the_job() {
    let (out, took) = mpirun(3, "dying_rank", &[("KILN_COMM_TIMEOUT", "120")]);
    let t = text(&out);
    assert!(!out.status.success(), "{t}");
    assert!(took < Duration::from_secs(40), "took {took:?}:\n{t}");
}

#[test]
#[ignore = "a rank of an mpirun job (started by a_rank_that_dies_ends_the_job)"]
fn dying_rank() {
    let g = world();
    g.barrier().unwrap();
    if g.rank() == 2 {
        // Killed: no destructors, no exit handlers.
        std::process::abort();
    }
    let mut v = vec![1f32; 1000];
    let _ = g.all_reduce((&mut v[..]).into(), ReduceOp::Sum);
    std::thread::sleep(Duration::from_secs(120));
}
