//! What the CLI tests share: the tiny recipe and a finished process's output.

use std::process::Output;

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
