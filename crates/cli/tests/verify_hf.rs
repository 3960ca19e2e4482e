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

#[test]
fn verify_hf_rejects_sharded_for_now() {
    let dir = fixture("tiny-llama");
    let out = kiln(&[
        "verify-hf",
        dir.to_str().expect("utf-8 path"),
        "--strategy",
        "fsdp",
        "--ranks",
        "2",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("arrives with the decorator"), "{stderr}");
}

#[test]
fn verify_hf_fails_on_a_missing_dir() {
    let out = kiln(&["verify-hf", "/nonexistent/kiln-model"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("config.json is missing"), "{stderr}");
}
