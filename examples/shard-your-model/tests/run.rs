//! The example runs as its doc comment says, and its own checks hold: the single-device run
//! learns and the sharded run matches it within 1e-4 (the program exits non-zero otherwise).

use std::process::Command;

fn run(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_shard-your-model"))
        .args(args)
        .output()
        .expect("the example runs");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

#[test]
fn zero3_and_hybrid_match_one_device() {
    for strategy in ["zero3", "hybrid:2"] {
        let (ok, text) = run(&["--ranks", "4", "--strategy", strategy, "--steps", "20"]);
        assert!(ok, "{strategy}: {text}");
        assert!(text.contains("largest relative difference"), "{text}");
    }
}

#[test]
fn bad_arguments_are_named() {
    let (ok, text) = run(&["--ranks", "2", "--global-batch", "3"]);
    assert!(!ok);
    assert!(
        text.contains("a global batch of 3 rows does not split over 2 ranks"),
        "{text}"
    );
    let (ok, text) = run(&["--ranks", "4", "--strategy", "hybrid:3"]);
    assert!(!ok);
    assert!(
        text.contains("hybrid shard size 3 does not divide the world size 4"),
        "{text}"
    );
}
