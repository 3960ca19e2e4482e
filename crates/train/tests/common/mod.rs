//! What the snapshot and precision tests share: a tiny recipe and a run of it.

use burn::backend::Flex;
use kiln_train::{Recipe, RunOptions, Summary, train_threads};
use std::path::Path;

/// A model and corpus small enough for debug builds: a step takes milliseconds.
pub fn recipe(out: &Path, strategy: &str, extra: &[&str]) -> Recipe {
    let mut o: Vec<String> = [
        "model.layers=1",
        "model.heads=2",
        "model.dim=16",
        "model.context=16",
        "train.seq_len=16",
        "train.batch_size=4",
        "train.steps=6",
        "train.warmup_steps=2",
        "train.eval_every=0",
        "train.eval_batches=2",
        "train.sample_chars=0",
        "data.synthetic_chars=20000",
        "output.snapshot_every=0",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    o.push(format!("parallel.strategy={strategy}"));
    o.push(format!("output.dir={:?}", out.display().to_string()));
    o.extend(extra.iter().map(|s| s.to_string()));
    Recipe::load(None, &o).unwrap()
}

pub fn run(r: &Recipe, ranks: usize, resume: bool, stop_after: Option<usize>) -> Summary {
    let options = RunOptions {
        resume,
        overwrite: !resume,
        stop_after,
        restart: false,
        steps_only: false,
    };
    train_threads::<Flex>(r, ranks, options).unwrap()
}

/// The error and its sources, as `kiln` prints them.
#[allow(dead_code)] // not every test file reads errors
pub fn chain(e: kiln_train::TrainError) -> String {
    let mut s = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(c) = source {
        s += &format!(": {c}");
        source = c.source();
    }
    s
}
