//! `kiln train` as a user runs it: processes under `kiln launch` killed and resumed, a crash
//! while a snapshot is written, and every kind of bad input.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::{KILN, TINY, children, latest_step, launch, losses, run_err, run_ok, text};

fn train_args(out: &Path, steps: usize, snapshot_every: usize, extra: &[&str]) -> Vec<String> {
    let mut a = vec!["train".to_string()];
    for s in TINY {
        a.push("--set".into());
        a.push(s.to_string());
    }
    a.extend([
        "--steps".into(),
        steps.to_string(),
        "--snapshot-every".into(),
        snapshot_every.to_string(),
        "--out".into(),
        out.display().to_string(),
    ]);
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

#[test]
fn a_killed_two_process_run_resumes_with_the_same_losses() {
    let dir = tempfile::tempdir().unwrap();
    let (whole, cut) = (dir.path().join("whole"), dir.path().join("cut"));
    let steps = 150;
    let extra = ["--strategy", "zero2"];
    let out = run_ok(launch(2, train_args(&whole, steps, 4, &extra)));
    // The memory table names both ranks (processes) and lands in the metrics too.
    for needle in [
        "memory per rank",
        "rank 0: peak",
        "rank 1: peak",
        "optimizer",
    ] {
        assert!(out.contains(needle), "{needle:?} in:\n{out}");
    }
    let metrics = std::fs::read_to_string(whole.join("metrics.jsonl")).unwrap();
    let memory: serde_json::Value = metrics
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find_map(|v| v.get("memory").cloned())
        .expect("a memory record");
    let rows = memory.as_array().unwrap();
    assert_eq!(rows.len(), 2);
    for (rank, row) in rows.iter().enumerate() {
        assert_eq!(row["rank"], rank);
        // ZeRO-2: whole parameters, gradient and optimizer shards (8 bytes of moments for
        // each 4 of gradient).
        let (grads, optim) = (
            row["grads"].as_u64().unwrap(),
            row["optimizer"].as_u64().unwrap(),
        );
        assert!(
            grads > 0 && optim >= 2 * grads && row["params"].as_u64().unwrap() + 1024 >= 2 * grads
        );
        assert!(row["peak_activations"].as_u64().unwrap() > 0, "{row}");
    }

    let mut job = launch(2, train_args(&cut, steps, 4, &extra))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let end = Instant::now() + Duration::from_secs(300);
    while latest_step(&cut).is_none_or(|s| s < 8) {
        assert!(Instant::now() < end, "no snapshot of step 8 appeared");
        assert!(job.try_wait().unwrap().is_none(), "the run ended early");
        std::thread::sleep(Duration::from_millis(2));
    }
    let ranks = children(job.id());
    assert_eq!(ranks.len(), 2, "{ranks:?}");
    // SIGKILL one rank mid-training: no chance to clean up; the launcher stops the other.
    unsafe { libc::kill(ranks[1], libc::SIGKILL) };
    let status = job.wait().unwrap();
    assert!(!status.success());
    let killed_at = latest_step(&cut).unwrap();
    assert!(killed_at < steps, "the run finished before it was killed");

    // Resumed with activation checkpointing: remat changes what is kept for backward, never
    // the numbers (bitwise equal losses below).
    let resumed = run_ok(launch(
        2,
        train_args(
            &cut,
            steps,
            4,
            &[&extra[..], &["--resume", "--remat", "balanced"]].concat(),
        ),
    ));
    assert!(resumed.contains("resuming from"), "{resumed}");
    assert!(resumed.contains("with remat balanced"), "{resumed}");
    let (a, b) = (losses(&whole), losses(&cut));
    assert_eq!(a.len(), steps);
    assert_eq!(a, b, "losses after resuming from step {killed_at} differ");
}

#[test]
fn a_crash_while_writing_a_snapshot_leaves_the_previous_one() {
    let dir = tempfile::tempdir().unwrap();
    let (whole, cut) = (dir.path().join("whole"), dir.path().join("cut"));
    let args =
        |out: &Path, extra: &[&str]| train_args(out, 12, 4, &[&["--ranks", "2"], extra].concat());
    let mut c = Command::new(KILN);
    c.args(args(&whole, &[]));
    run_ok(c);

    let mut c = Command::new(KILN);
    c.args(args(&cut, &[]))
        .env("KILN_TEST_ABORT_IN_SNAPSHOT", "8");
    run_err(c);
    assert_eq!(latest_step(&cut), Some(4));
    let partial = cut.join("snapshots/.step-00000008.partial");
    assert!(partial.join("rank-00000.safetensors").exists());
    assert!(!partial.join("manifest.json").exists());

    let mut c = Command::new(KILN);
    c.args(args(&cut, &["--resume"]));
    let t = run_ok(c);
    assert!(t.contains("step-00000004 (step 4 of 12"), "{t}");
    assert_eq!(losses(&whole), losses(&cut));
    // The export of the finished run is a Hugging Face directory.
    let hf = dir.path().join("hf");
    let mut c = Command::new(KILN);
    c.args([
        "export",
        &cut.display().to_string(),
        "--out",
        &hf.display().to_string(),
        "--dtype",
        "bf16",
    ]);
    run_ok(c);
    assert!(hf.join("model.safetensors").exists());
    let config = std::fs::read_to_string(hf.join("config.json")).unwrap();
    assert!(config.contains(r#""torch_dtype": "bfloat16""#), "{config}");
}

/// Runs `kiln ARGS`, expecting a prompt failure whose message contains every `needle`.
fn fails_with(args: Vec<String>, needles: &[&str]) {
    let started = Instant::now();
    let out = Command::new(KILN).args(&args).output().unwrap();
    let t = text(&out);
    assert_eq!(out.status.code(), Some(1), "{args:?}: {t}");
    for n in needles {
        assert!(t.contains(n), "{args:?}: expected {n:?} in:\n{t}");
    }
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "{args:?} took too long"
    );
}

/// Runs `kiln ARGS`, expecting a failure on whose stderr every `needle` occurs exactly once: an
/// error's message and each of its causes are printed once.
fn fails_once_with(args: Vec<String>, needles: &[&str]) {
    let out = Command::new(KILN).args(&args).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{args:?}: {}", text(&out));
    for n in needles {
        assert_eq!(err.matches(n).count(), 1, "{args:?}: {n:?} once in:\n{err}");
    }
}

#[test]
fn an_error_and_its_cause_are_printed_once() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    fails_once_with(
        train_args(&run, 2, 0, &["--data", "/no/such/corpus.txt"]),
        &[
            "error:",
            "cannot read the data file /no/such/corpus.txt",
            "/no/such/corpus.txt",
            "No such file or directory",
        ],
    );

    let mut c = Command::new(KILN);
    c.args(train_args(&run, 2, 0, &[]));
    run_ok(c);
    let file = run.join("snapshots/step-00000002/rank-00000.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 0x01;
    std::fs::write(&file, bytes).unwrap();
    fails_once_with(
        train_args(&run, 4, 0, &["--resume"]),
        &[
            "error:",
            &format!("{} is corrupted", file.display()),
            "CRC32",
            "Delete",
        ],
    );
}

#[test]
fn bad_inputs_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let p = |x: &PathBuf| x.display().to_string();

    fails_with(
        train_args(&run, 2, 0, &["--remat", "sometimes"]),
        &[
            r#"train.remat must be "off", "balanced" or "budget=SIZE" (e.g. budget=64MiB), got "sometimes""#,
        ],
    );
    fails_with(
        train_args(&run, 2, 0, &["--precision", "fp8"]),
        &[r#"train.precision must be "f32", "bf16" or "f16", got "fp8""#],
    );
    fails_with(
        train_args(&run, 2, 0, &["--data", "/no/such/corpus.txt"]),
        &["cannot read the data file /no/such/corpus.txt"],
    );
    let recipe = dir.path().join("typo.toml");
    std::fs::write(&recipe, "[train]\nstpes = 3\n").unwrap();
    fails_with(
        vec!["train".into(), "--recipe".into(), p(&recipe)],
        &["unknown field `stpes`", "typo.toml"],
    );
    fails_with(
        vec![
            "train".into(),
            "--recipe".into(),
            "/no/such/recipe.toml".into(),
        ],
        &["cannot read the recipe /no/such/recipe.toml"],
    );
    fails_with(
        train_args(&run, 2, 0, &["--set", "model.layrs=2"]),
        &["layrs"],
    );
    fails_with(
        train_args(&run, 2, 0, &["--ranks", "3"]),
        &["train.batch_size (4) must be a multiple of the world size (3)"],
    );
    fails_with(
        train_args(&run, 2, 0, &["--ranks", "2", "--strategy", "hybrid:3"]),
        &["hybrid:3", "got 2"],
    );
    fails_with(
        train_args(&run, 2, 0, &["--strategy", "zero9"]),
        &["unknown strategy 'zero9'"],
    );
    fails_with(
        train_args(&run, 2, 0, &["--resume"]),
        &["--resume: there is no complete snapshot"],
    );

    // A finished run, then resumes that do not fit it.
    let mut c = Command::new(KILN);
    c.args(train_args(&run, 2, 0, &[]));
    run_ok(c);
    fails_with(
        train_args(&run, 2, 0, &[]),
        &["already holds snapshots", "--resume", "--overwrite"],
    );
    fails_with(
        train_args(&run, 4, 0, &["--resume", "--set", "model.dim=32"]),
        &["is of a different model", "\"n_embd\":16", "\"n_embd\":32"],
    );
    let file = run.join("snapshots/step-00000002/rank-00000.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 0x40;
    std::fs::write(&file, bytes).unwrap();
    fails_with(
        train_args(&run, 4, 0, &["--resume"]),
        &["rank-00000.safetensors is corrupted", "CRC32"],
    );
    fails_with(
        vec![
            "export".into(),
            "/no/such/run".into(),
            "--out".into(),
            p(&dir.path().join("x")),
        ],
        &["no snapshot in /no/such/run"],
    );

    // Under a launcher, the recipe's world size must be the launcher's.
    let t = run_err(launch(
        2,
        train_args(
            &dir.path().join("w"),
            2,
            0,
            &["--set", "parallel.world_size=4"],
        ),
    ));
    assert!(
        t.contains("expects parallel.world_size = 4 but the launcher started 2"),
        "{t}"
    );
}

#[test]
fn mixed_precision_runs_from_the_command_line() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("f16");
    let mut c = Command::new(KILN);
    c.args(train_args(
        &out,
        4,
        0,
        &["--ranks", "2", "--strategy", "zero3", "--precision", "f16"],
    ));
    let t = run_ok(c);
    assert!(t.contains("zero3 in f16 (f32 masters) on 2 rank(s)"), "{t}");
    assert!(
        t.contains("f16 loss scale 65536 at the end; 0 step(s) skipped"),
        "{t}"
    );
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    assert!(metrics.contains(r#""loss_scale":65536.0"#), "{metrics}");
    assert!(metrics.contains(r#""skipped":false"#), "{metrics}");
}

/// `srun kiln train …`: each task finds its rank, the world and the master from SLURM's
/// variables (no RANK), and the job trains exactly as under `kiln launch`.
#[test]
fn srun_variables_train_like_kiln_launch() {
    let dir = tempfile::tempdir().unwrap();
    let (launched, srun) = (dir.path().join("launch"), dir.path().join("srun"));
    let args = |out: &Path| train_args(out, 6, 0, &["--strategy", "zero3"]);
    run_ok(launch(2, args(&launched)));

    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let tasks: Vec<_> = (0..2)
        .map(|rank| {
            Command::new(KILN)
                .args(args(&srun))
                .env("SLURM_JOB_ID", "4242")
                .env("SLURM_STEP_ID", "0")
                .env("SLURM_PROCID", rank.to_string())
                .env("SLURM_LOCALID", rank.to_string())
                .env("SLURM_NTASKS", "2")
                .env("SLURM_NTASKS_PER_NODE", "2")
                .env("SLURM_JOB_NODELIST", "localhost")
                .env("MASTER_PORT", port.to_string())
                .env("KILN_COMM_TIMEOUT", "60")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outputs: Vec<String> = tasks
        .into_iter()
        .map(|task| {
            let out = task.wait_with_output().unwrap();
            assert!(out.status.success(), "{}", text(&out));
            text(&out)
        })
        .collect();
    assert!(outputs[0].contains("on 2 rank(s)"), "{}", outputs[0]);
    let (a, b) = (losses(&srun), losses(&launched));
    assert_eq!(a.len(), 6);
    assert_eq!(a, b);
}
