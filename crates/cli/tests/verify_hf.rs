//! `kiln verify-hf` on the parity fixtures, through the real binary.

use std::path::PathBuf;
use std::process::Command;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/hf/tests/fixtures")
        .join(name)
}

fn kiln(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .output()
        .expect("kiln runs")
}

#[test]
fn verify_hf_passes_on_a_fixture() {
    let dir = fixture("tiny-gpt2");
    let out = kiln(&["verify-hf", dir.to_str().expect("utf-8 path")]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "exit {:?}\nstdout:\n{stdout}\nstderr:\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stderr)
    );
    for line in [
        "logits",
        "loss_init",
        "grad_norm.transformer.wte.weight",
        "train_loss[9]",
    ] {
        assert!(stdout.contains(line), "no '{line}' line in:\n{stdout}");
    }
    assert!(!stdout.contains("FAIL"), "{stdout}");
}

/// ZeRO-3 at 2 and 4 ranks and DDP at 2 reach PyTorch's numbers on both fixtures.
#[test]
fn verify_hf_passes_sharded() {
    for name in ["tiny-gpt2", "tiny-llama"] {
        let dir = fixture(name);
        for (strategy, ranks) in [("zero3", "2"), ("zero3", "4"), ("ddp", "2")] {
            let out = kiln(&[
                "verify-hf",
                dir.to_str().expect("utf-8 path"),
                "--strategy",
                strategy,
                "--ranks",
                ranks,
            ]);
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success(),
                "{name} {strategy} x{ranks}: exit {:?}\n{stdout}\n{}",
                out.status.code(),
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(
                stdout.contains(&format!("{strategy} on {ranks} rank(s)")),
                "{stdout}"
            );
            assert!(
                stdout.contains("train_loss[9]") && !stdout.contains("FAIL"),
                "{stdout}"
            );
        }
    }
}

#[test]
fn verify_hf_names_what_it_cannot_run() {
    let dir = fixture("tiny-llama");
    let dir = dir.to_str().expect("utf-8 path");
    let out = kiln(&["verify-hf", dir, "--strategy", "zero1", "--ranks", "2"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("kiln shard-check --strategy zero1"),
        "{stderr}"
    );
    let out = kiln(&["verify-hf", dir, "--strategy", "zerro3", "--ranks", "2"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("unknown strategy 'zerro3'"), "{stderr}");
}

#[test]
fn verify_hf_fails_on_a_missing_dir() {
    let out = kiln(&["verify-hf", "/nonexistent/kiln-model"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("config.json is missing"), "{stderr}");
}
