//! Recovery without a person (`kiln launch --max-restarts`, `--hang-timeout`, elastic
//! `--nnodes MIN:MAX`): a handful of induced failures of each kind, each job run to its last
//! step with no one stepping in, and ending where the uninterrupted job ends.
//!
//! - a rank killed (SIGKILL) and a rank stopped (SIGSTOP: a hang) on one node: restarted from
//!   the latest snapshot, at most a snapshot interval recomputed per failure, the final
//!   validation loss bitwise that of the uninterrupted job;
//! - a crash while the first snapshot is written: restarted from step 0;
//! - with snapshots in memory every k steps (`--memory-snapshot-every`): a rank killed long
//!   before the first disk snapshot is restarted from memory, at most 2k steps recomputed,
//!   bitwise equal to the uninterrupted job;
//! - restarts that run out: the launcher exits with the failure;
//! - across two network namespaces (root and `ip` needed; SKIPPED otherwise, saying why): a
//!   link taken down and up again (both nodes restart, bitwise equal), and a node lost for
//!   good under `--nnodes 1:2` (the job finishes on the other node, within 1e-5), also with
//!   memory snapshots on each node (the lost node's pieces come from the copy it kept on the
//!   other: at most 2k steps recomputed).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::{KILN, Nodes, children, latest_step, run_err, text, train_args, val_loss};

/// `kiln launch` of `n` ranks on a free port, with restarts.
fn launch_with_restarts(n: usize, summary: &Path, args: &[String]) -> Command {
    let mut c = Command::new(KILN);
    c.args(["launch", "--nproc-per-node", &n.to_string()])
        .args(["--master-port", "0", "--max-restarts", "4"])
        .args(["--hang-timeout", "3", "--restart-backoff", "0.2"])
        .arg("--summary")
        .arg(summary)
        .args(["--", KILN])
        .args(args)
        .env("KILN_COMM_TIMEOUT", "60");
    c
}

fn wait_until(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn signal(pid: i32, sig: i32) {
    // SAFETY: kill(2) has no memory-safety preconditions.
    unsafe { libc::kill(pid, sig) };
}

/// The launcher's recovery summary (`--summary`).
fn summary(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// Asserts every restart of `s` recovered, recomputing at most two snapshot intervals: one,
/// unless the failure came while a snapshot was still being written (asynchronously: the one
/// before is then `latest`; a rank's next save waits for its previous write, so never more);
/// returns how many restarts were hangs.
fn check_restarts(s: &serde_json::Value, restarts: usize, every: u64) -> usize {
    let list = s["restarts"].as_array().unwrap();
    assert_eq!(list.len(), restarts, "{s:#}");
    for r in list {
        let recomputed = r["recomputed"]
            .as_u64()
            .unwrap_or_else(|| panic!("steps recomputed unknown: {s:#}"));
        assert!(
            recomputed <= 2 * every,
            "{recomputed} steps recomputed: {s:#}"
        );
        assert!(r["recover_s"].as_f64().is_some(), "{s:#}");
    }
    list.iter().filter(|r| r["hang"] == true).count()
}

#[test]
fn a_killed_and_a_stopped_rank_restart_the_job_which_ends_as_if_uninterrupted() {
    let tmp = tempfile::tempdir().unwrap();
    let (steps, every) = (400, 5);
    let reference = tmp.path().join("reference");
    common::run_ok(common::launch(
        2,
        train_args(&reference, "zero3", steps, every),
    ));

    let run = tmp.path().join("run");
    let sum = tmp.path().join("summary.json");
    let launcher = launch_with_restarts(2, &sum, &train_args(&run, "zero3", steps, every))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = launcher.id();
    let limit = Duration::from_secs(60);
    // A rank killed after the job has a snapshot...
    wait_until("a snapshot", limit, || latest_step(&run) >= Some(2 * every));
    let first = children(pid);
    assert_eq!(first.len(), 2);
    signal(first[1], libc::SIGKILL);
    // ...and, once the restarted job has written a snapshot of its own, a rank stopped.
    let killed_at = latest_step(&run).unwrap();
    wait_until("the restarted job", limit, || {
        let now = children(pid);
        now.len() == 2 && !now.contains(&first[0]) && latest_step(&run) > Some(killed_at + every)
    });
    let second = children(pid);
    signal(second[0], libc::SIGSTOP);
    let out = output_within(launcher, Duration::from_secs(90));
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(t.contains("rank 1 was killed by signal 9"), "{t}");
    assert!(t.contains("hangs: it is stopped"), "{t}");
    assert!(t.contains("restart after round 1 recovered"), "{t}");
    let s = summary(&sum);
    assert_eq!(check_restarts(&s, 2, every as u64), 1, "{s:#}");
    ends_as_uninterrupted(&run, &reference, steps);
}

#[test]
fn a_crash_restarts_from_the_snapshot_in_memory_recomputing_at_most_its_interval() {
    let tmp = tempfile::tempdir().unwrap();
    // Disk snapshots every 200 steps, memory ones every 3.
    let (steps, every, in_memory) = (400, 200, 3);
    let reference = tmp.path().join("reference");
    common::run_ok(common::launch(
        2,
        train_args(&reference, "zero3", steps, every),
    ));
    let run = tmp.path().join("run");
    let memory = tmp.path().join("memory");
    let memory_step = || {
        let name = std::fs::read_to_string(memory.join("latest")).ok()?;
        name.trim().strip_prefix("step-")?.parse::<usize>().ok()
    };
    let sum = tmp.path().join("summary.json");
    let mut args = train_args(&run, "zero3", steps, every);
    args.extend(["--memory-snapshot-every".into(), in_memory.to_string()]);
    let launcher = launch_with_restarts(2, &sum, &args)
        .env("KILN_MEMORY_SNAPSHOTS", &memory)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = launcher.id();
    wait_until("a snapshot in memory", Duration::from_secs(60), || {
        memory_step().is_some_and(|s| s >= 2 * in_memory)
    });
    let ranks = children(pid);
    assert_eq!(ranks.len(), 2);
    signal(ranks[1], libc::SIGKILL);
    let on_disk = latest_step(&run);
    let out = output_within(launcher, Duration::from_secs(90));
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(t.contains("rank 1 was killed by signal 9"), "{t}");
    for line in t.lines().filter(|l| l.starts_with("[kiln launch]")) {
        println!("{line}");
    }
    println!("on disk when killed: {on_disk:?}");
    let s = summary(&sum);
    check_restarts(&s, 1, in_memory as u64);
    let resumed = s["restarts"][0]["resumed_from"].as_u64().unwrap();
    // Nothing was on disk when the rank died (the first disk snapshot is at step 200): the
    // restart came from memory.
    assert_eq!(on_disk, None, "{s:#}");
    assert!(
        resumed > 0,
        "resumed from step 0 with snapshots in memory: {s:#}"
    );
    ends_as_uninterrupted(&run, &reference, steps);
    // A finished run gives the memory back.
    assert!(!memory.exists(), "{} is still there", memory.display());
}

/// Asserts the restarted run reached its last step with the uninterrupted run's final
/// validation loss, bitwise (the same world size).
fn ends_as_uninterrupted(run: &Path, reference: &Path, steps: usize) {
    assert_eq!(latest_step(run), Some(steps));
    assert_eq!(
        val_loss(run).to_bits(),
        val_loss(reference).to_bits(),
        "restarted {} vs uninterrupted {}",
        val_loss(run),
        val_loss(reference)
    );
}

/// Asserts the run that shrank to one node reached its last step within 1e-5 of the
/// uninterrupted run's final validation loss; both losses.
fn ends_within(run: &Path, reference: &Path, steps: usize) -> (f64, f64) {
    assert_eq!(latest_step(run), Some(steps));
    let (a, b) = (val_loss(run), val_loss(reference));
    assert!(
        (a - b).abs() <= 1e-5 * b,
        "shrunk to one node {a} vs uninterrupted {b}"
    );
    (a, b)
}

/// Waits for `child` to end, with its output; kills it after `limit` (a hang is a failure).
fn output_within(child: Child, limit: Duration) -> std::process::Output {
    let pid = child.id() as i32;
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let seen = done.clone();
    std::thread::spawn(move || {
        let start = Instant::now();
        while !seen.load(std::sync::atomic::Ordering::Acquire) {
            if start.elapsed() > limit {
                signal(pid, libc::SIGKILL);
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    });
    let out = child.wait_with_output().unwrap();
    done.store(true, std::sync::atomic::Ordering::Release);
    out
}

#[test]
fn a_crash_while_the_first_snapshot_is_written_restarts_from_step_0() {
    let tmp = tempfile::tempdir().unwrap();
    let (steps, every) = (30, 10);
    let reference = tmp.path().join("reference");
    common::run_ok(common::launch(
        2,
        train_args(&reference, "ddp", steps, every),
    ));
    let run = tmp.path().join("run");
    let sum = tmp.path().join("summary.json");
    let mut c = launch_with_restarts(2, &sum, &train_args(&run, "ddp", steps, every));
    // Rank 0 aborts half-way through its file of the first snapshot (in the first start only).
    c.env("KILN_TEST_ABORT_IN_SNAPSHOT", every.to_string());
    let t = common::run_ok(c);
    assert!(t.contains("KILN_TEST_ABORT_IN_SNAPSHOT"), "{t}");
    assert!(!t.contains("resuming from"), "{t}");
    let s = summary(&sum);
    let restarts = s["restarts"].as_array().unwrap();
    assert_eq!(restarts.len(), 1, "{s:#}");
    assert_eq!(restarts[0]["resumed_from"], 0, "{s:#}");
    assert_eq!(
        val_loss(&run).to_bits(),
        val_loss(&reference).to_bits(),
        "{t}"
    );
}

#[test]
fn restarts_that_run_out_end_the_launcher_with_the_failure() {
    let out = Command::new(KILN)
        .args(["launch", "--nproc-per-node", "2", "--master-port", "0"])
        .args(["--max-restarts", "2", "--restart-backoff", "0.05"])
        .args(["--", "sh", "-c", "exit 3"])
        .output()
        .unwrap();
    let t = text(&out);
    assert_eq!(out.status.code(), Some(3), "{t}");
    assert!(
        t.contains("restart 1 of 2") && t.contains("restart 2 of 2"),
        "{t}"
    );
    assert!(
        t.contains("gave up after 2 restart(s) (--max-restarts 2)"),
        "{t}"
    );
}

#[test]
fn bad_recovery_flags_are_named() {
    let bad = |flags: &[&str], says: &str| {
        let mut c = Command::new(KILN);
        c.args(["launch", "--nproc-per-node", "1", "--master-port", "0"])
            .args(flags)
            .args(["--", "true"]);
        let t = run_err(c);
        assert!(t.contains(says), "{flags:?}: {t}");
    };
    bad(&["--nnodes", "3:2"], "MIN (3) above MAX (2)");
    bad(&["--nnodes", "0"], "'0' is not a node count");
    bad(&["--nnodes", "two"], "'two' is not a node count");
    bad(
        &["--hang-timeout=-1"],
        "--hang-timeout must be a number of seconds",
    );
    bad(
        &["--rdzv-timeout", "nan"],
        "--rdzv-timeout must be a number of seconds",
    );
    bad(
        &["--nnodes", "1:2", "--node-rank", "2"],
        "--node-rank 2 is out of range",
    );
}

/// `kiln launch` as node `node` of `nnodes`, two ranks, restarts on; the launchers wait
/// `rdzv` seconds for each other at a restart.
fn launch(
    nodes: &Nodes,
    node: usize,
    nnodes: &str,
    rdzv: &str,
    summary: &Path,
    args: &[String],
) -> Child {
    launch_command(nodes, node, nnodes, rdzv, summary, args)
        .spawn()
        .expect("ip netns exec runs")
}

/// [`launch`]'s command, not started.
fn launch_command(
    nodes: &Nodes,
    node: usize,
    nnodes: &str,
    rdzv: &str,
    summary: &Path,
    args: &[String],
) -> Command {
    let mut c = nodes.kiln_launch(node);
    c.args(["--nnodes", nnodes, "--node-rank", &node.to_string()])
        .args(["--nproc-per-node", "2", "--master-addr", &nodes.addr[0]])
        .args(["--master-port", "29700", "--max-restarts", "3"])
        .args(["--restart-backoff", "0.2", "--rdzv-timeout", rdzv])
        .arg("--summary")
        .arg(summary)
        .args(["--", KILN])
        .args(args)
        .env("KILN_JOB_TOKEN", "recovery-nodes")
        .env("KILN_COMM_TIMEOUT", "5")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

/// Runs a two-node job of `args` to its end, both launchers; their outputs.
fn both(nodes: &Nodes, nnodes: &str, dir: &Path, args: &[String]) -> [String; 2] {
    let runs = [0, 1].map(|n| launch(nodes, n, nnodes, "8", &dir.join(format!("s{n}.json")), args));
    runs.map(|r| {
        let out = r.wait_with_output().unwrap();
        let t = text(&out);
        assert!(out.status.success(), "{t}");
        t
    })
}

#[test]
fn a_link_down_and_up_again_restarts_both_nodes_and_the_job_ends_as_if_uninterrupted() {
    let Some(nodes) = Nodes::or_skip(11) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let (steps, every) = (400, 10);
    let reference = tmp.path().join("reference");
    let refdir = tmp.path().join("ref-summaries");
    std::fs::create_dir_all(&refdir).unwrap();
    both(
        &nodes,
        "2",
        &refdir,
        &train_args(&reference, "zero3", steps, every),
    );

    let run = tmp.path().join("run");
    let args = train_args(&run, "zero3", steps, every);
    let runs = [0, 1].map(|n| {
        launch(
            &nodes,
            n,
            "2",
            "20",
            &tmp.path().join(format!("s{n}.json")),
            &args,
        )
    });
    wait_until("a snapshot", Duration::from_secs(60), || {
        latest_step(&run) >= Some(every)
    });
    // Down for longer than the collective timeout (5 s): every rank fails; node 1 cannot reach
    // the launchers' rendezvous until the link is back, then joins the restart.
    nodes.link("down");
    std::thread::sleep(Duration::from_secs(7));
    nodes.link("up");
    for r in runs {
        let out = r.wait_with_output().unwrap();
        assert!(out.status.success(), "{}", text(&out));
    }
    let s = summary(&tmp.path().join("s0.json"));
    assert!(!s["restarts"].as_array().unwrap().is_empty(), "{s:#}");
    assert_eq!(
        s["rounds"].as_array().unwrap().last().unwrap(),
        &serde_json::json!([0, 1])
    );
    assert_eq!(
        val_loss(&run).to_bits(),
        val_loss(&reference).to_bits(),
        "{s:#}"
    );
}

/// Every descendant of `pid` (a launcher under `ip netns exec`, its ranks).
fn descendants(pid: i32) -> Vec<i32> {
    let mut found = vec![pid];
    let mut i = 0;
    while i < found.len() {
        let more = children(found[i] as u32);
        found.extend(more);
        i += 1;
    }
    found
}

#[test]
fn a_node_lost_for_good_leaves_an_elastic_job_to_finish_on_the_other() {
    let Some(nodes) = Nodes::or_skip(12) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let (steps, every) = (400, 10);
    // The uninterrupted job: four ranks (threads) on one machine, as two nodes of two.
    let reference: PathBuf = tmp.path().join("reference");
    let mut one = Command::new(KILN);
    one.args(train_args(&reference, "zero3", steps, every))
        .args(["--ranks", "4"]);
    common::run_ok(one);

    let run = tmp.path().join("run");
    let args = train_args(&run, "zero3", steps, every);
    let [node0, node1] = [0, 1].map(|n| {
        launch(
            &nodes,
            n,
            "1:2",
            "8",
            &tmp.path().join(format!("s{n}.json")),
            &args,
        )
    });
    wait_until("a snapshot", Duration::from_secs(60), || {
        latest_step(&run) >= Some(every)
    });
    for p in descendants(node1.id() as i32) {
        signal(p, libc::SIGKILL);
    }
    let _ = node1.wait_with_output();
    let out = node0.wait_with_output().unwrap();
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(t.contains("node(s) [1] did not come within 8s"), "{t}");
    assert!(t.contains("written by 4 rank(s)"), "{t}");
    let (a, b) = ends_within(&run, &reference, steps);
    eprintln!("one node after the loss: {a}; uninterrupted: {b}");
}

#[test]
fn a_node_lost_for_good_restarts_from_the_memory_copy_on_the_other_node() {
    let Some(nodes) = Nodes::or_skip(13) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    // Disk snapshots every 200 steps; memory ones every 3, each node's own (as machines'
    // memories are), with a copy of the other node's ranks' pieces.
    let (steps, every, in_memory) = (400, 200, 3);
    let reference: PathBuf = tmp.path().join("reference");
    let mut one = Command::new(KILN);
    one.args(train_args(&reference, "zero3", steps, every))
        .args(["--ranks", "4"]);
    common::run_ok(one);

    let run = tmp.path().join("run");
    let mut args = train_args(&run, "zero3", steps, every);
    args.extend(["--memory-snapshot-every".into(), in_memory.to_string()]);
    let memory = [0, 1].map(|n| tmp.path().join(format!("memory-{n}")));
    let [node0, node1] = [0, 1].map(|n| {
        launch_command(
            &nodes,
            n,
            "1:2",
            "8",
            &tmp.path().join(format!("s{n}.json")),
            &args,
        )
        .env("KILN_MEMORY_SNAPSHOTS", &memory[n])
        .spawn()
        .expect("ip netns exec runs")
    });
    // Node 0 holds steps of its own ranks and copies of node 1's.
    let newest = |dir: &Path| {
        std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().to_string_lossy().to_string();
                name.strip_prefix(".step-")?
                    .strip_suffix(".partial")?
                    .parse::<usize>()
                    .ok()
            })
            .max()
    };
    wait_until("memory snapshots", Duration::from_secs(60), || {
        newest(&memory[0]).is_some_and(|s| s >= 2 * in_memory)
    });
    let on_disk = latest_step(&run);
    for p in descendants(node1.id() as i32) {
        signal(p, libc::SIGKILL);
    }
    let _ = node1.wait_with_output();
    let out = node0.wait_with_output().unwrap();
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    for line in t.lines().filter(|l| l.starts_with("[kiln launch]")) {
        println!("{line}");
    }
    let s = summary(&tmp.path().join("s0.json"));
    check_restarts(&s, 1, in_memory as u64);
    let resumed = s["restarts"][0]["resumed_from"].as_u64().unwrap();
    println!("on disk when node 1 was lost: {on_disk:?}; resumed at {resumed}");
    assert_eq!(on_disk, None, "{s:#}");
    assert!(resumed > 0, "resumed from step 0 with memory copies: {s:#}");
    let (a, b) = ends_within(&run, &reference, steps);
    println!("one node after the loss: {a}; uninterrupted: {b}");
}
