//! `kiln train --pp`: a pipelined run trains as one rank does, a killed pipelined run of two
//! processes resumes with the same losses, snapshots move between pipelined and plain layouts,
//! and bad pipeline settings are named.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::{KILN, TINY, children, latest_step, losses, run_ok, text};

fn train(out: &Path, steps: usize, extra: &[&str]) -> Command {
    let mut c = Command::new(KILN);
    c.arg("train");
    for s in TINY {
        c.args(["--set", s]);
    }
    c.args(["--steps", &steps.to_string(), "--snapshot-every", "4"])
        .arg("--out")
        .arg(out)
        .args(extra)
        .env("KILN_COMM_TIMEOUT", "60");
    c
}

/// `train(out, steps, extra)` on `nproc` launched ranks.
fn launch(nproc: usize, out: &Path, steps: usize, extra: &[&str]) -> Command {
    common::launch(nproc, train(out, steps, extra).get_args())
}

/// The largest relative difference of `a`'s losses from `b`'s at the steps both have.
fn loss_error(a: &[(u64, f64)], b: &[(u64, f64)]) -> f64 {
    a.iter()
        .filter_map(|(s, x)| {
            let y = b.iter().find(|(t, _)| t == s)?.1;
            Some((x - y).abs() / y.abs())
        })
        .fold(0.0, f64::max)
}

#[test]
fn a_pipelined_run_trains_as_one_rank_and_its_snapshots_move_between_layouts() {
    let dir = tempfile::tempdir().unwrap();
    let path = |name: &str| dir.path().join(name);
    let steps = 8;
    let one_out = run_ok(train(&path("one"), steps, &[]));
    let out = run_ok(train(
        &path("pp"),
        steps,
        &["--ranks", "4", "--pp", "2", "--microbatches", "2"],
    ));
    for needle in [
        "pipeline: 2 stages x 2 data-parallel ranks, 2 micro-batches per step, 1f1b",
        "stage 0: embed (",
        "stage 1: h.0..head",
        "rank 3: peak",
        "pipeline bubble: ",
        "for stages of equal cost",
        "per step, stage 0 computes ",
    ] {
        assert!(out.contains(needle), "{needle:?} in:\n{out}");
    }
    // The sample is drawn through the stages: the same text as one rank's.
    let sample = |out: &str| {
        let at = out.find("sample (prompt|generated):").expect("a sample");
        out[at..].lines().nth(1).unwrap_or_default().to_string()
    };
    assert_eq!(sample(&out), sample(&one_out));
    let (one, pp) = (losses(&path("one")), losses(&path("pp")));
    assert_eq!(pp.len(), steps);
    let err = loss_error(&pp, &one);
    println!("pp 2 x dp 2 vs one rank: losses within {err:.1e}");
    assert!(err <= 1e-5, "{pp:?} vs {one:?}");
    // ZeRO-3 on the data-parallel axis, the ranks threads of one process (kiln builds
    // burn-autodiff with the fix that makes this safe; kiln_pipe::SHARDED_STAGE_THREADS).
    run_ok(train(
        &path("pp-zero3"),
        steps,
        &[
            "--ranks",
            "4",
            "--pp",
            "2",
            "--microbatches",
            "2",
            "--strategy",
            "zero3",
        ],
    ));
    let err = loss_error(&losses(&path("pp-zero3")), &one);
    println!("pp 2 x dp 2 (ZeRO-3, threads) vs one rank: losses within {err:.1e}");
    assert!(err <= 1e-5, "{:?} vs {one:?}", losses(&path("pp-zero3")));

    // The pipelined run's step-4 snapshot, resumed on one rank; and the one rank's, resumed as
    // a 2-stage GPipe pipeline.
    for (from, to, extra) in [
        ("pp", "pp-then-one", &[][..]),
        (
            "one",
            "one-then-pp",
            &[
                "--ranks",
                "2",
                "--pp",
                "2",
                "--microbatches",
                "2",
                "--schedule",
                "gpipe",
            ][..],
        ),
    ] {
        std::fs::create_dir_all(path(to).join("snapshots")).unwrap();
        let src = path(from).join("snapshots/step-00000004");
        let dst = path(to).join("snapshots/step-00000004");
        assert!(
            Command::new("cp")
                .arg("-r")
                .arg(&src)
                .arg(&dst)
                .status()
                .unwrap()
                .success()
        );
        std::fs::write(path(to).join("snapshots/latest"), "step-00000004").unwrap();
        let out = run_ok(train(
            &path(to),
            steps,
            &[&["--resume"][..], extra].concat(),
        ));
        assert!(out.contains("resuming from"), "{out}");
        let err = loss_error(&losses(&path(to)), &losses(&path(from)));
        println!("{from} -> {to}: losses of steps 5..8 within {err:.1e}");
        assert!(err <= 1e-5, "{to}: {:?}", losses(&path(to)));
    }
}

#[test]
fn a_pipeline_starts_from_a_pretrained_directory() {
    let dir = tempfile::tempdir().unwrap();
    let path = |name: &str| dir.path().join(name);
    run_ok(train(&path("base"), 4, &[]));
    let out = Command::new(KILN)
        .arg("export")
        .arg(path("base"))
        .arg("--out")
        .arg(path("hf"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    // Each stage loads only the weights it holds (the others are placeholders).
    let from = format!("model.from=\"{}\"", path("hf").display());
    run_ok(train(&path("one"), 4, &["--set", &from]));
    run_ok(train(
        &path("pp"),
        4,
        &[
            "--set",
            &from,
            "--ranks",
            "2",
            "--pp",
            "2",
            "--microbatches",
            "2",
        ],
    ));
    let err = loss_error(&losses(&path("pp")), &losses(&path("one")));
    println!("from a pretrained directory, pp 2 vs one rank: losses within {err:.1e}");
    assert!(err <= 1e-5, "{:?}", losses(&path("pp")));
}

#[test]
fn a_split_by_measured_time_trains_as_one_rank() {
    let dir = tempfile::tempdir().unwrap();
    let path = |name: &str| dir.path().join(name);
    run_ok(train(&path("one"), 4, &[]));
    let out = run_ok(train(
        &path("pp"),
        4,
        &[
            "--ranks",
            "2",
            "--pp",
            "2",
            "--microbatches",
            "2",
            "--pp-split",
            "measured",
        ],
    ));
    assert!(out.contains("% of the measured compute time"), "{out}");
    let err = loss_error(&losses(&path("pp")), &losses(&path("one")));
    assert!(err <= 1e-5, "{:?}", losses(&path("pp")));
}

#[test]
fn a_killed_pipelined_run_of_two_processes_resumes_with_the_same_losses() {
    let dir = tempfile::tempdir().unwrap();
    let (whole, cut) = (dir.path().join("whole"), dir.path().join("cut"));
    let steps = 100;
    let extra = ["--pp", "2", "--microbatches", "4"];
    run_ok(launch(2, &whole, steps, &extra));
    let mut job = launch(2, &cut, steps, &extra)
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
    // SIGKILL the launcher's second rank (the last stage): the launcher stops the other.
    let ranks = children(job.id());
    assert_eq!(ranks.len(), 2, "{ranks:?}");
    unsafe { libc::kill(*ranks.iter().max().unwrap(), libc::SIGKILL) };
    assert!(!job.wait().unwrap().success());
    let killed_at = latest_step(&cut).unwrap();
    assert!(killed_at < steps, "the run finished before it was killed");
    let resumed = run_ok(launch(
        2,
        &cut,
        steps,
        &[&extra[..], &["--resume"]].concat(),
    ));
    assert!(resumed.contains("resuming from"), "{resumed}");
    assert_eq!(
        losses(&whole),
        losses(&cut),
        "losses after resuming from step {killed_at} differ"
    );
}

#[test]
fn bad_pipelines_are_named() {
    let dir = tempfile::tempdir().unwrap();
    for (extra, needle) in [
        (
            &["--ranks", "2", "--pp", "3"][..],
            "parallel.pp (3) must divide the world size (2)",
        ),
        (
            &["--ranks", "2", "--pp", "2", "--microbatches", "3"][..],
            "parallel.microbatches (3) must divide each data-parallel rank's 4 rows",
        ),
        (
            &["--ranks", "2", "--pp", "2", "--schedule", "2f2b"][..],
            "unknown schedule \"2f2b\"",
        ),
        (
            &["--ranks", "2", "--pp", "2", "--pp-split", "h.7"][..],
            "split point \"h.7\" is not a unit of the model (embed, h.0, head)",
        ),
        (
            &["--ranks", "4", "--pp", "4"][..],
            "4 stages x 1 chunks need 4 groups of parameters, but the model has 3 units",
        ),
        (
            &[
                "--ranks",
                "2",
                "--pp",
                "2",
                "--microbatches",
                "2",
                "--schedule",
                "interleaved:2",
            ][..],
            "need 4 groups of parameters, but the model has 3 units",
        ),
    ] {
        let out = train(&dir.path().join("bad"), 2, extra).output().unwrap();
        let t = text(&out);
        assert!(!out.status.success(), "{extra:?} succeeded:\n{t}");
        assert!(t.contains(needle), "{extra:?}: {needle:?} in:\n{t}");
    }
}
