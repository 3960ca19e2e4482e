//! The benchmark binaries run to the end on small sizes (their figures are for release builds;
//! this only keeps them working: zero-bench's baseline once tripped the optimizer's check).

use std::process::Command;

fn run(bin: &str, args: &[&str]) -> String {
    let out = Command::new(bin)
        .args(args)
        .output()
        .expect("the benchmark runs");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{bin} {args:?}:\n{text}");
    text
}

#[test]
fn zero_bench_runs() {
    let text = run(
        env!("CARGO_BIN_EXE_zero-bench"),
        &[
            "--width",
            "32",
            "--layers",
            "2",
            "--ranks",
            "1,2",
            "--timed-steps",
            "2",
        ],
    );
    assert!(text.contains("zero3   2"), "{text}");
    assert!(text.contains("training step at world size 1"), "{text}");
}

#[test]
fn comm_bench_runs() {
    let text = run(
        env!("CARGO_BIN_EXE_comm-bench"),
        &["--ranks", "2", "--min-size", "1K", "--max-size", "4K"],
    );
    // A measured row for each group kind at each size.
    for row in [
        "local    2     1K",
        "local    2     4K",
        "tcp      2     1K",
        "tcp      2     4K",
    ] {
        assert!(text.contains(row), "no '{row}' row:\n{text}");
    }
}
