//! kiln's NCCL code across processes on a machine without a GPU: `kiln` built with the `nccl`
//! feature, its ranks loading kiln's CUDA driver and NCCL emulators (`crates/comm/emu`)
//! instead of the real libraries. The collective suite passes; every sharding strategy equals
//! one device; training, and pipelines whose stages exchange activations and gradients through
//! NCCL's point-to-point calls, equal the same job on one machine; NCCL's failures (two ranks
//! on one GPU, a rank killed mid-run, NCCL installed under its versioned name only) are named
//! errors, not hangs.
//!
//! What this cannot show is anything of a GPU: device kernels, Burn's CUDA backend, the
//! decorator's collectives on Burn's CUDA tensors, speed. The inner backend here is the CPU, so the
//! group's host path runs (`scripts/gpu-check.sh` covers the rest on GPUs).
//!
//!     cargo test -p kiln-cli --features nccl --test nccl_emulated -- --test-threads=1
#![cfg(feature = "nccl")]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

mod common;
use common::{
    KILN, TINY, assert_shard_check_passed, run_err, run_ok, shard_check_args, text, val_loss,
};

/// The emulators, built once per test run into this target's scratch directory.
fn emulator() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("nccl-emu");
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../comm/emu/build.sh");
        let out = Command::new("bash")
            .arg(&script)
            .arg(&dir)
            .output()
            .expect("bash runs");
        assert!(
            out.status.success(),
            "building the NCCL emulator (a C compiler is needed):\n{}",
            text(&out)
        );
        dir
    })
}

/// `c` with the emulated libraries first on its library path.
fn on_emulator(mut c: Command) -> Command {
    let mut path = emulator().display().to_string();
    if let Ok(old) = std::env::var("LD_LIBRARY_PATH") {
        path = format!("{path}:{old}");
    }
    c.env("LD_LIBRARY_PATH", path)
        .env("KILN_COMM_TIMEOUT", "60")
        .env_remove("CUDA_VISIBLE_DEVICES");
    c
}

/// `kiln` on the emulator.
fn kiln() -> Command {
    on_emulator(Command::new(KILN))
}

/// `kiln launch` of `n` local ranks running `kiln ARGS`, on the emulator.
fn launch(n: usize, args: &[&str]) -> Command {
    on_emulator(common::launch(n, args))
}

fn train_args(out: &Path, extra: &[&str]) -> Vec<String> {
    let mut a = vec!["train".to_string()];
    for s in TINY {
        a.extend(["--set".to_string(), s.to_string()]);
    }
    a.extend(
        ["--steps", "8", "--overwrite", "--out"]
            .iter()
            .map(|s| s.to_string()),
    );
    a.push(out.display().to_string());
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

#[test]
fn comm_check_passes_on_emulated_nccl() {
    let t = run_ok(launch(3, &["comm-check", "--backend", "nccl"]));
    for rank in 0..3 {
        assert!(
            t.contains(&format!("rank {rank} of 3: ")),
            "rank {rank}:\n{t}"
        );
    }
    assert_eq!(
        t.matches("collective checks passed on nccl").count(),
        3,
        "{t}"
    );
}

#[test]
fn every_strategy_equals_one_device_on_emulated_nccl() {
    for (strategy, n) in [
        ("ddp", 2),
        ("zero1", 2),
        ("zero2", 3),
        ("zero3", 2),
        ("hybrid:2", 4),
    ] {
        let t = run_ok(launch(n, &shard_check_args("nccl", strategy)));
        assert_shard_check_passed(&t, strategy, n);
    }
}

#[test]
fn training_and_pipelines_on_emulated_nccl_equal_one_machine() {
    let tmp = tempfile::tempdir().unwrap();
    // (name, ranks, the job's flags, the one-machine job's flags)
    let two_layers: &[&str] = &["--set", "model.layers=2"];
    let cases: [(&str, usize, &[&str], &[&str]); 6] = [
        (
            "zero3",
            2,
            &["--strategy", "zero3"],
            &["--strategy", "zero3", "--ranks", "2"],
        ),
        // Two stages: activations forward and gradients back through ncclSend/ncclRecv.
        (
            "pp2-1f1b",
            2,
            &[
                "--pp",
                "2",
                "--microbatches",
                "4",
                "--set",
                "model.layers=2",
            ],
            two_layers,
        ),
        (
            "pp2-interleaved",
            2,
            &[
                "--pp",
                "2",
                "--microbatches",
                "2",
                "--schedule",
                "interleaved:2",
                "--set",
                "model.layers=2",
            ],
            two_layers,
        ),
        // 2 stages x 2 data-parallel ranks under ZeRO-3: the stage groups' point-to-point and
        // the data-parallel groups' collectives on communicators of their own.
        (
            "pp2-dp2-zero3",
            4,
            &[
                "--pp",
                "2",
                "--microbatches",
                "2",
                "--strategy",
                "zero3",
                "--set",
                "model.layers=2",
            ],
            two_layers,
        ),
        // Tensor parallelism: the tp group's all-reduces, and with sequence parallelism its
        // all-gathers and reduce-scatters, on a communicator of its own beside the
        // data-parallel one.
        ("tp2-dp2", 4, &["--tp", "2"], &[]),
        ("tp2-sp", 2, &["--tp", "2", "--sequence-parallel"], &[]),
    ];
    for (name, ranks, job, reference) in cases {
        let under = tmp.path().join(format!("{name}-nccl"));
        let mut args = train_args(&under, job);
        args.extend(["--set", "parallel.backend=\"nccl\""].map(String::from));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let t = run_ok(launch(ranks, &args));
        assert!(t.contains(&format!("on {ranks} rank(s)")), "{name}:\n{t}");
        if name.starts_with("pp") {
            assert!(t.contains("pipeline bubble: "), "{name}:\n{t}");
        }
        if name.starts_with("tp") {
            assert!(
                t.contains("0 split tensors formed whole") || t.contains("embedding_backward"),
                "{name}:\n{t}"
            );
        }

        let here = tmp.path().join(format!("{name}-here"));
        let mut c = kiln();
        c.args(train_args(&here, reference));
        run_ok(c);
        let (a, b) = (val_loss(&under), val_loss(&here));
        eprintln!("{name}: emulated NCCL {a}, one machine {b}");
        assert!(
            (a - b).abs() <= 1e-5 * b,
            "{name}: emulated NCCL {a} vs one machine {b}"
        );
    }
}

#[test]
fn two_ranks_on_one_gpu_are_refused_by_name() {
    // Each rank told it owns "GPU 0" (a scheduler binding both tasks to one device): NCCL
    // refuses the pair; kiln says so and why.
    let mut c = launch(2, &["comm-check", "--backend", "nccl"]);
    c.env("CUDA_VISIBLE_DEVICES", "0");
    let t = run_err(c);
    assert!(t.contains("Duplicate GPU detected"), "{t}");
    assert!(t.contains("two ranks on one GPU"), "{t}");
}

/// A rank started by hand, as a test of the group itself.
fn rank(rank: usize, world: usize, port: u16, pools: bool) -> Child {
    let mut c = kiln();
    c.args(["comm-check", "--backend", "nccl", "--soak", "60"])
        .env("RANK", rank.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("LOCAL_WORLD_SIZE", world.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if !pools {
        c.env("KILN_CUDA_EMU_NO_POOLS", "1");
    }
    c.spawn().unwrap()
}

#[test]
fn a_killed_rank_fails_the_survivors_through_ncclcommgetasyncerror() {
    // Without memory pools cudarc frees a buffer by synchronising its stream, which the
    // operation stuck on the dead peer blocks until kiln aborts the communicator.
    for pools in [true, false] {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        // The timeout is 60 s: the survivors must learn of the death from NCCL's asynchronous
        // error, not wait the timeout out.
        let mut ranks: Vec<Child> = (0..3).map(|r| rank(r, 3, port, pools)).collect();
        for c in ranks.iter_mut() {
            let out = c.stdout.take().unwrap();
            let mut lines = BufReader::new(out).lines();
            assert!(
                lines
                    .by_ref()
                    .any(|l| l.unwrap().contains("soak: all-reducing")),
                "a rank ended before its soak"
            );
            std::thread::spawn(move || lines.for_each(drop));
        }
        let start = Instant::now();
        let mut victim = ranks.remove(1);
        victim.kill().unwrap(); // SIGKILL
        victim.wait().unwrap();
        for (i, mut c) in ranks.into_iter().enumerate() {
            let status = loop {
                if let Some(s) = c.try_wait().unwrap() {
                    break s;
                }
                if start.elapsed() > Duration::from_secs(30) {
                    c.kill().unwrap();
                    panic!("pools {pools}: survivor {i} still running 30 s after the kill");
                }
                std::thread::sleep(Duration::from_millis(20));
            };
            assert!(!status.success());
            let err = String::from_utf8_lossy(&c.wait_with_output().unwrap().stderr).into_owned();
            assert!(err.contains("all_reduce #"), "{err}");
            assert!(err.contains("ncclRemoteError"), "{err}");
            // The dead rank, or a survivor that gave up first and aborted.
            assert!(err.contains("closed its connection"), "{err}");
        }
    }
}

#[test]
fn an_nccl_installed_as_libnccl_so_2_is_named_and_linked_by_the_launcher() {
    // Debian's libnccl2 and pip's nvidia-nccl-cu12 install `libnccl.so.2` only; cudarc loads
    // `libnccl.so`. A rank started by hand says what to do; `kiln launch` makes the link.
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(emulator().join("libcuda.so"), dir.path().join("libcuda.so")).unwrap();
    std::fs::copy(
        emulator().join("libnccl.so"),
        dir.path().join("libnccl.so.2"),
    )
    .unwrap();
    let with_path = |c: &mut Command| {
        c.env("LD_LIBRARY_PATH", dir.path());
    };
    let mut alone = kiln();
    with_path(&mut alone);
    alone
        .args(["comm-check", "--backend", "nccl"])
        .env("RANK", "0")
        .env("WORLD_SIZE", "1")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", "1");
    let t = run_err(alone);
    assert!(
        t.contains("libnccl.so.2 is installed but cudarc loads NCCL by the name libnccl.so"),
        "{t}"
    );
    let mut launched = launch(2, &["comm-check", "--backend", "nccl"]);
    with_path(&mut launched);
    let t = run_ok(launched);
    assert_eq!(
        t.matches("collective checks passed on nccl").count(),
        2,
        "{t}"
    );
}
