//! Real processes on loopback: `kiln launch`, the TCP group across processes, and faults.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::{KILN, assert_shard_check_passed, launch, run_ok, shard_check_args, text};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A rank started by hand (not by the launcher), as a test of the group itself.
fn rank(rank: usize, world: usize, port: u16, timeout_s: &str, args: &[&str]) -> Child {
    Command::new(KILN)
        .arg("comm-check")
        .args(args)
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("KILN_COMM_TIMEOUT", timeout_s)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Waits for a line containing `needle` on the child's stdout.
fn wait_for_line(child: &mut Child, needle: &str) {
    let out = child.stdout.take().unwrap();
    let mut lines = BufReader::new(out).lines();
    for line in lines.by_ref() {
        if line.unwrap().contains(needle) {
            // Keep draining in the background so the child never blocks on a full pipe.
            std::thread::spawn(move || lines.for_each(drop));
            return;
        }
    }
    panic!("child ended before printing {needle:?}");
}

fn wait_timeout(child: &mut Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if let Some(s) = child.try_wait().unwrap() {
            return Some(s);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

fn stderr_of(child: Child) -> String {
    let out = child.wait_with_output().unwrap();
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn launch_runs_the_collective_suite_on_2_and_4_processes() {
    for n in [2, 4] {
        let out = launch(n, ["comm-check"]).output().unwrap();
        let t = text(&out);
        assert!(out.status.success(), "{t}");
        for r in 0..n {
            assert!(
                t.contains(&format!("[rank {r}] rank {r} of {n}: ")) && t.contains("passed on tcp"),
                "{t}"
            );
        }
    }
}

#[test]
fn two_nodes_on_loopback_form_one_job() {
    let port = free_port().to_string();
    let node = |node_rank: &str| {
        Command::new(KILN)
            .env("KILN_JOB_TOKEN", "our-job")
            .args([
                "launch",
                "--nproc-per-node",
                "2",
                "--nnodes",
                "2",
                "--node-rank",
                node_rank,
            ])
            .args(["--master-addr", "127.0.0.1", "--master-port", &port, "--"])
            .args([KILN, "comm-check"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (a, b) = (node("0"), node("1"));
    let (a, b) = (a.wait_with_output().unwrap(), b.wait_with_output().unwrap());
    assert!(a.status.success(), "{}", text(&a));
    assert!(b.status.success(), "{}", text(&b));
    assert!(text(&b).contains("[rank 3] rank 3 of 4"), "{}", text(&b));
}

/// A node started with another job's token is refused by the store (and the refusal logged
/// there); the job's own node gives up after its timeout; both launchers fail.
#[test]
fn a_node_with_another_jobs_token_is_refused() {
    let port = free_port().to_string();
    let node = |node_rank: &str, token: &str| {
        Command::new(KILN)
            .env("KILN_JOB_TOKEN", token)
            .env("KILN_COMM_TIMEOUT", "4")
            .args(["launch", "--nproc-per-node", "1", "--nnodes", "2"])
            .args(["--node-rank", node_rank, "--master-addr", "127.0.0.1"])
            .args(["--master-port", &port, "--", KILN, "comm-check"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let ours = node("0", "our-job");
    std::thread::sleep(std::time::Duration::from_millis(300));
    let theirs = node("1", "another-job");
    let (a, b) = (
        ours.wait_with_output().unwrap(),
        theirs.wait_with_output().unwrap(),
    );
    assert!(!a.status.success() && !b.status.success());
    let (a, b) = (text(&a), text(&b));
    assert!(
        b.contains("the rendezvous store refused this process: it presented another job's token"),
        "{b}"
    );
    assert!(a.contains("refused a connection from 127.0.0.1:"), "{a}");
}

#[test]
fn a_killed_process_fails_the_survivors_promptly() {
    let port = free_port();
    // A 60 s timeout: the survivors must notice the death itself, not wait it out.
    let mut ranks: Vec<Child> = (0..3)
        .map(|r| rank(r, 3, port, "60", &["--soak", "60"]))
        .collect();
    for c in ranks.iter_mut() {
        wait_for_line(c, "soak: all-reducing");
    }
    let start = Instant::now();
    let mut victim = ranks.remove(1);
    victim.kill().unwrap(); // SIGKILL
    victim.wait().unwrap();
    for (i, mut c) in ranks.into_iter().enumerate() {
        let status = wait_timeout(&mut c, Duration::from_secs(20))
            .unwrap_or_else(|| panic!("survivor {i} still running 20 s after the kill"));
        assert!(!status.success());
        let err = stderr_of(c);
        assert!(err.contains("all_reduce #"), "{err}");
        assert!(err.contains("on group 'world'"), "{err}");
        assert!(err.contains("lost rank"), "{err}");
    }
    assert!(start.elapsed() < Duration::from_secs(20));
}

#[test]
fn a_hung_process_makes_the_survivors_time_out() {
    let port = free_port();
    let mut ranks: Vec<Child> = (0..2)
        .map(|r| rank(r, 2, port, "2", &["--soak", "60"]))
        .collect();
    for c in ranks.iter_mut() {
        wait_for_line(c, "soak: all-reducing");
    }
    let mut hung = ranks.pop().unwrap();
    // SAFETY: signalling our own child.
    unsafe { libc_kill(hung.id() as i32, 19) }; // SIGSTOP: alive but silent
    let mut survivor = ranks.pop().unwrap();
    let status = wait_timeout(&mut survivor, Duration::from_secs(15)).expect("survivor hung");
    assert!(!status.success());
    let err = stderr_of(survivor);
    assert!(
        err.contains("timed out after 2s waiting for rank 1"),
        "{err}"
    );
    assert!(err.contains("all_reduce #"), "{err}");
    hung.kill().unwrap();
    hung.wait().unwrap();
}

unsafe extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, sig: i32) -> i32;
}

#[test]
fn the_launcher_stops_the_other_ranks_and_returns_the_failing_code() {
    let start = Instant::now();
    let out = Command::new(KILN)
        .args([
            "launch",
            "--nproc-per-node",
            "3",
            "--master-port",
            "0",
            "--grace",
            "1",
            "--",
        ])
        .args([
            "sh",
            "-c",
            "if [ \"$RANK\" = 1 ]; then echo bye >&2; exit 7; fi; sleep 60",
        ])
        .output()
        .unwrap();
    let t = text(&out);
    assert_eq!(out.status.code(), Some(7), "{t}");
    assert!(t.contains("[rank 1] bye"), "{t}");
    assert!(
        t.contains("rank 1 exited with code 7; stopping the 2 other running rank(s)"),
        "{t}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "the sleepers were not stopped"
    );
}

#[test]
fn the_launcher_sets_the_variables() {
    let out = Command::new(KILN)
        .args([
            "launch",
            "--nproc-per-node",
            "2",
            "--nnodes",
            "3",
            "--node-rank",
            "2",
        ])
        .args(["--master-addr", "10.1.2.3", "--master-port", "1234", "--"])
        .args([
            "sh",
            "-c",
            "echo $RANK/$WORLD_SIZE/$LOCAL_RANK/$LOCAL_WORLD_SIZE/$MASTER_ADDR:$MASTER_PORT",
        ])
        .output()
        .unwrap();
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(t.contains("[rank 4] 4/6/0/2/10.1.2.3:1234"), "{t}");
    assert!(t.contains("[rank 5] 5/6/1/2/10.1.2.3:1234"), "{t}");
}

#[test]
fn bad_launches_are_clear_errors() {
    let out = Command::new(KILN)
        .arg("comm-check")
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        text(&out).contains("no launcher variables found"),
        "{}",
        text(&out)
    );

    let out = Command::new(KILN)
        .args([
            "launch",
            "--nproc-per-node",
            "2",
            "--nnodes",
            "2",
            "--node-rank",
            "2",
            "--",
            "true",
        ])
        .output()
        .unwrap();
    assert!(
        text(&out).contains("--node-rank 2 is out of range for --nnodes 2"),
        "{}",
        text(&out)
    );

    let out = Command::new(KILN)
        .args([
            "launch",
            "--nproc-per-node",
            "1",
            "--master-port",
            "0",
            "--",
            "/no/such/program",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        text(&out).contains("cannot start rank 0 (/no/such/program)"),
        "{}",
        text(&out)
    );
}

#[test]
fn a_relative_program_path_is_the_launchers() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("bin")).unwrap();
    std::os::unix::fs::symlink(KILN, dir.path().join("bin/kiln")).unwrap();
    let launch = |program: &str| {
        Command::new(KILN)
            .current_dir(dir.path())
            .args([
                "launch",
                "--nproc-per-node",
                "2",
                "--master-port",
                "0",
                "--",
            ])
            .args([program, "--version"])
            .output()
            .unwrap()
    };
    let out = launch("bin/kiln");
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(
        t.contains("[rank 0] kiln ") && t.contains("[rank 1] kiln "),
        "{t}"
    );
    // A bare name is looked up on PATH; a file of that name here is pointed out.
    std::os::unix::fs::symlink(KILN, dir.path().join("kiln-here")).unwrap();
    let out = launch("kiln-here");
    assert!(!out.status.success());
    assert!(
        text(&out).contains(
            "'kiln-here' is not on PATH; for the file in this directory, write ./kiln-here"
        ),
        "{}",
        text(&out)
    );
    let out = launch("./kiln-here");
    assert!(out.status.success(), "{}", text(&out));
}

#[test]
fn world_size_mismatch_is_named() {
    let port = free_port();
    let r0 = rank(0, 2, port, "3", &[]);
    let r1 = rank(1, 3, port, "3", &[]);
    let err1 = stderr_of(r1);
    assert!(
        err1.contains("world size mismatch: this rank was started with WORLD_SIZE=3 but rank 0 with WORLD_SIZE=2"),
        "{err1}"
    );
    // Rank 0 waits for a rank 1 of its own world, which never comes: a timeout, not a hang.
    let err0 = stderr_of(r0);
    assert!(err0.contains("timed out"), "{err0}");
}

#[test]
fn a_port_in_use_is_named() {
    let taken = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let err = stderr_of(rank(0, 2, port, "3", &[]));
    assert!(err.contains("already in use"), "{err}");
    assert!(err.contains(&port.to_string()), "{err}");
}

/// The decorator across real processes over TCP equals single-device training, every strategy,
/// on a model each rank initialises with Burn's random initialisers from its own seed
/// (`shard` makes the weights rank 0's; the reference starts from them).
#[test]
fn shard_check_over_processes() {
    for (strategy, n) in [
        ("ddp", 2),
        ("zero1", 2),
        ("zero2", 3),
        ("zero3", 3),
        ("hybrid:2", 4),
    ] {
        let t = run_ok(launch(n, shard_check_args("tcp", strategy)));
        assert_shard_check_passed(&t, strategy, n);
    }
}
