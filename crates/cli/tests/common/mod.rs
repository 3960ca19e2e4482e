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

/// `kiln train` of the tiny recipe with `strategy` for `steps`, a snapshot every `every` steps
/// (0: only at the end), into `out`.
#[allow(dead_code)]
pub fn train_args(out: &Path, strategy: &str, steps: usize, every: usize) -> Vec<String> {
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

/// Two network namespaces `kiln<pid>t<test>-0` and `-1`, each a "node" with its own address
/// and loopback, joined by the veth pair `<dev>0` / `<dev>1` (10.x.<test>.1 and .2); removed
/// when dropped. `test` tells apart the pairs of one test binary (and of the binaries that use
/// it: give each test a number of its own).
#[allow(dead_code)]
pub struct Nodes {
    pub ns: [String; 2],
    pub dev: String,
    pub addr: [String; 2],
}

#[allow(dead_code)]
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

#[allow(dead_code)]
impl Nodes {
    /// The pair, or why it cannot be made here (not root, no `ip`, a container that forbids it).
    pub fn new(test: u8) -> Result<Nodes, String> {
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
        let (n0, n1) = (nodes.ns[0].as_str(), nodes.ns[1].as_str());
        ip(&[
            "link", "add", &d0, "netns", n0, "type", "veth", "peer", "name", &d1, "netns", n1,
        ])?;
        for (i, d) in [&d0, &d1].into_iter().enumerate() {
            let ns = nodes.ns[i].as_str();
            let addr = format!("{}/24", nodes.addr[i]);
            ip(&["-n", ns, "addr", "add", &addr, "dev", d])?;
            ip(&["-n", ns, "link", "set", d, "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
            // `ip netns exec` also mounts /sys, which some containers forbid even to root.
            ip(&["netns", "exec", ns, "true"])?;
        }
        Ok(nodes)
    }

    /// The pair, or `None` after saying on stderr why the test skips.
    pub fn or_skip(test: u8) -> Option<Nodes> {
        match Nodes::new(test) {
            Ok(n) => Some(n),
            Err(why) => {
                eprintln!("SKIPPED (no network namespaces): {why}");
                None
            }
        }
    }

    /// `kiln launch` run inside node `node`'s namespace (its flags to be added).
    pub fn kiln_launch(&self, node: usize) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.ns[node], KILN, "launch"]);
        c
    }

    /// Node 0's end of the link set `"up"` or `"down"`.
    pub fn link(&self, state: &str) {
        let dev = format!("{}0", self.dev);
        ip(&["-n", &self.ns[0], "link", "set", &dev, state]).unwrap();
    }
}

impl Drop for Nodes {
    fn drop(&mut self) {
        for ns in &self.ns {
            let _ = ip(&["netns", "del", ns]);
        }
    }
}
