//! Across a node boundary: two network namespaces joined by a veth pair, each a "node" with its
//! own address and loopback, one `kiln launch` in each, as on two machines. `kiln train` across
//! them equals the same job on one machine; a link taken down mid-run fails every rank within
//! the timeout, naming the collective, and both launchers exit non-zero; a node killed, the job
//! resumes from its last snapshot on the surviving node's ranks.
//!
//! Needs root and iproute2's `ip` (CI runs as root). Where namespaces cannot be made, each test
//! prints why and returns: it says so, never silently.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::{KILN, TINY, text, val_loss};

/// Two namespaces `<tag>-0` and `<tag>-1`, linked by veth `<dev>0` / `<dev>1` with addresses
/// 10.<x>.<y>.1 and .2; removed when dropped.
struct Nodes {
    ns: [String; 2],
    dev: String,
    addr: [String; 2],
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("cannot run `ip` (iproute2): {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl Nodes {
    fn new(test: u8) -> Result<Nodes, String> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err("not root: network namespaces need CAP_NET_ADMIN".into());
        }
        let pid = std::process::id();
        let tag = format!("kiln{pid}t{test}");
        let dev = format!("kv{}{test}", pid % 100_000);
        let subnet = format!("10.{}.{}", 100 + pid % 100, test);
        let nodes = Nodes {
            ns: [format!("{tag}-0"), format!("{tag}-1")],
            dev: dev.clone(),
            addr: [format!("{subnet}.1"), format!("{subnet}.2")],
        };
        for ns in &nodes.ns {
            ip(&["netns", "add", ns])?;
        }
        let (d0, d1) = (format!("{dev}0"), format!("{dev}1"));
        ip(&[
            "link",
            "add",
            &d0,
            "netns",
            &nodes.ns[0],
            "type",
            "veth",
            "peer",
            "name",
            &d1,
            "netns",
            &nodes.ns[1],
        ])?;
        for (i, d) in [&d0, &d1].into_iter().enumerate() {
            let ns = nodes.ns[i].as_str();
            ip(&[
                "-n",
                ns,
                "addr",
                "add",
                &format!("{}/24", nodes.addr[i]),
                "dev",
                d,
            ])?;
            ip(&["-n", ns, "link", "set", d, "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
            // `ip netns exec` also mounts /sys, which some containers forbid even to root.
            ip(&["netns", "exec", ns, "true"])?;
        }
        Ok(nodes)
    }

    /// `kiln launch` as node `node` of two, `nproc` ranks, rendezvous at node 0.
    fn launch(&self, node: usize, nproc: usize, port: u16, args: &[String]) -> Child {
        Command::new("ip")
            .args(["netns", "exec", &self.ns[node], KILN, "launch"])
            .args(["--nnodes", "2", "--node-rank", &node.to_string()])
            .args(["--nproc-per-node", &nproc.to_string()])
            .args([
                "--master-addr",
                &self.addr[0],
                "--master-port",
                &port.to_string(),
            ])
            .args(["--", KILN])
            .args(args)
            .env("KILN_JOB_TOKEN", "two-nodes")
            .env("KILN_COMM_TIMEOUT", "10")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("ip netns exec runs")
    }

    /// Takes node 0's end of the link down.
    fn cut(&self) {
        ip(&[
            "-n",
            &self.ns[0],
            "link",
            "set",
            &format!("{}0", self.dev),
            "down",
        ])
        .unwrap();
    }
}

impl Drop for Nodes {
    fn drop(&mut self) {
        for ns in &self.ns {
            let _ = ip(&["netns", "del", ns]);
        }
    }
}

fn nodes_or_skip(test: u8) -> Option<Nodes> {
    match Nodes::new(test) {
        Ok(n) => Some(n),
        Err(why) => {
            eprintln!("SKIPPED (no network namespaces): {why}");
            None
        }
    }
}

fn train_args(out: &Path, strategy: &str, steps: usize) -> Vec<String> {
    train_args_snapshots(out, strategy, steps, 0)
}

fn train_args_snapshots(out: &Path, strategy: &str, steps: usize, every: usize) -> Vec<String> {
    let mut a = vec!["train".to_string()];
    for s in TINY {
        a.extend(["--set".to_string(), s.to_string()]);
    }
    a.extend(
        [
            "--strategy",
            strategy,
            "--steps",
            &steps.to_string(),
            "--snapshot-every",
            &every.to_string(),
            "--out",
            &out.display().to_string(),
            "--overwrite",
        ]
        .map(String::from),
    );
    a
}

/// A port on node 0 (namespaces have their own ports: any high one is free there).
fn port(test: u8) -> u16 {
    29_400 + u16::from(test)
}

#[test]
fn training_across_two_nodes_equals_one_machine() {
    let Some(nodes) = nodes_or_skip(1) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    // Two ranks per node; hybrid:2 shards inside each node and replicates across them.
    for (strategy, per_node) in [("ddp", 2), ("zero3", 2), ("hybrid:2", 2)] {
        let name = strategy.replace(':', "-");
        let across = tmp.path().join(format!("{name}-nodes"));
        let args = train_args(&across, strategy, 8);
        let runs = [0, 1].map(|n| nodes.launch(n, per_node, port(1), &args));
        for (n, run) in runs.into_iter().enumerate() {
            let out = run.wait_with_output().unwrap();
            assert!(
                out.status.success(),
                "node {n}, {strategy}:\n{}",
                text(&out)
            );
        }
        let here = tmp.path().join(format!("{name}-here"));
        let mut one = Command::new(KILN);
        one.args(train_args(&here, strategy, 8))
            .args(["--ranks", &(2 * per_node).to_string()]);
        let out = one.output().unwrap();
        assert!(out.status.success(), "{}", text(&out));
        let (a, b) = (val_loss(&across), val_loss(&here));
        assert!(
            (a - b).abs() <= 1e-5 * b,
            "{strategy}: two nodes {a} vs one machine {b}"
        );
        eprintln!("{strategy}: two nodes {a}, one machine {b}");
    }
}

#[test]
fn a_link_cut_mid_run_fails_every_rank_within_the_timeout() {
    let Some(nodes) = nodes_or_skip(2) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let args = train_args(&tmp.path().join("run"), "zero3", 100_000);
    let runs = [0, 1].map(|n| nodes.launch(n, 1, port(2), &args));
    // Let the job form and train a little, then cut the link.
    let metrics = tmp.path().join("run/metrics.jsonl");
    let start = Instant::now();
    while std::fs::read_to_string(&metrics).map_or(0, |m| m.lines().count()) < 3 {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "the job never trained"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let cut = Instant::now();
    nodes.cut();
    for (n, run) in runs.into_iter().enumerate() {
        let out = run.wait_with_output().unwrap();
        let t = text(&out);
        assert!(!out.status.success(), "node {n} did not fail:\n{t}");
        // A 10 s timeout, the launcher's grace, and the rest of the step.
        assert!(
            cut.elapsed() < Duration::from_secs(60),
            "node {n} took {:?}",
            cut.elapsed()
        );
        assert!(
            t.contains("timed out") || t.contains("lost rank"),
            "node {n} does not say why:\n{t}"
        );
        assert!(
            t.contains(" on group '"),
            "node {n} names no collective:\n{t}"
        );
        let why: Vec<&str> = t.lines().filter(|l| l.contains(" on group '")).collect();
        eprintln!("node {n} after {:?}: {}", cut.elapsed(), why.join(" | "));
    }
}

/// Every descendant of `pid`, from /proc (a launcher's ranks run in their own process groups).
fn descendants(pid: i32) -> Vec<i32> {
    let parent_of = |p: i32| -> Option<i32> {
        let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).ok()?;
        // "pid (comm) state ppid ...": comm may hold spaces, so split after the last ')'.
        stat.rsplit(')')
            .next()?
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()
    };
    let all: Vec<i32> = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect();
    let mut found = vec![pid];
    let mut i = 0;
    while i < found.len() {
        let p = found[i];
        found.extend(all.iter().copied().filter(|&c| parent_of(c) == Some(p)));
        i += 1;
    }
    found
}

#[test]
fn a_killed_node_resumes_from_its_last_snapshot_on_fewer_ranks() {
    let Some(nodes) = nodes_or_skip(3) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let (steps, every) = (120, 4);
    let args = train_args_snapshots(&out, "zero3", steps, every);
    let runs = [0, 1].map(|n| nodes.launch(n, 2, port(3), &args));
    // A snapshot of the four ranks, then node 1 dies: its launcher and ranks, at once.
    let latest = |out: &Path| -> usize {
        std::fs::read_to_string(out.join("snapshots/latest"))
            .ok()
            .and_then(|n| n.trim().strip_prefix("step-")?.parse().ok())
            .unwrap_or(0)
    };
    let start = Instant::now();
    while latest(&out) < every {
        assert!(start.elapsed() < Duration::from_secs(120), "no snapshot");
        std::thread::sleep(Duration::from_millis(20));
    }
    let [node0, node1] = runs;
    for p in descendants(node1.id() as i32) {
        // SAFETY: kill has no memory-safety preconditions.
        unsafe { libc::kill(p, libc::SIGKILL) };
    }
    let _ = node1.wait_with_output();
    let out0 = node0.wait_with_output().unwrap();
    assert!(!out0.status.success(), "node 0 went on:\n{}", text(&out0));
    let killed_at = latest(&out);
    assert!(killed_at < steps, "the run ended before the kill");
    // The surviving node resumes alone, two ranks instead of four.
    let mut args: Vec<String> = args.into_iter().filter(|a| a != "--overwrite").collect();
    args.push("--resume".into());
    let resumed = Command::new("ip")
        .args([
            "netns",
            "exec",
            &nodes.ns[0],
            KILN,
            "launch",
            "--nproc-per-node",
            "2",
        ])
        .args(["--master-port", "0", "--", KILN])
        .args(&args)
        .env("KILN_COMM_TIMEOUT", "10")
        .output()
        .unwrap();
    let t = text(&resumed);
    assert!(resumed.status.success(), "{t}");
    assert!(
        t.contains("resuming from ") && t.contains("written by 4 rank(s)"),
        "{t}"
    );
    assert_eq!(latest(&out), steps, "{t}");
    eprintln!("killed after snapshot {killed_at}; resumed on 2 ranks to step {steps}");
}
