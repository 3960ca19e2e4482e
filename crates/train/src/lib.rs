//! `kiln train`: one command trains a GPT-2 or Llama model on the CPU or GPUs, on one rank or
//! many (threads of one process, or processes under `kiln launch`), under any of kiln's
//! strategies, with snapshots that survive crashes and reshard to another world size or strategy.
//!
//! - [`Recipe`]: the run's settings (TOML plus `key=value` overrides; unknown keys are errors).
//! - [`data`]: byte-level corpora, including a synthetic one whose best achievable loss is known.
//! - [`train_rank`]: one rank's run, through [`kiln::parallelize`] and a `Trainer` whose loop
//!   reads in one screen (`trainer.rs`); [`train_threads`] runs N ranks as threads.
//! - [`report`]: what a run tells the person watching it, as events; the library prints nothing
//!   (it logs through `tracing`), the `kiln` command draws them as a bar or lines.
//! - [`snapshot`]: per-rank pieces and a manifest, written atomically, read at any layout.
//! - [`export()`]: a snapshot as one Hugging Face directory (`config.json`, `model.safetensors`).
//!
//! ```no_run
//! use kiln_train::{Recipe, RunOptions, train_threads};
//!
//! let recipe = Recipe::load(None, &["train.steps=50".into(), "parallel.strategy=zero3".into()])?;
//! let summary = train_threads::<burn::backend::Flex>(&recipe, 2, RunOptions::default())?;
//! println!("validation loss {:?}", summary.val_loss);
//! # Ok::<(), kiln_train::TrainError>(())
//! ```
#![warn(missing_docs)]

pub mod data;
mod error;
mod eval;
mod export;
pub mod init;
pub mod memory;
pub mod metrics;
mod pipelined;
mod recipe;
pub mod report;
pub mod shared_dir;
pub mod snapshot;
mod state;
mod summary;
mod trained;
mod trainer;

pub use error::{Result, TrainError};
pub use eval::validation_batches;
pub use export::{export, export_as};
pub use recipe::{
    DEFAULT_TOML, DataRecipe, DataSource, GroupBackend, LoraRecipe, ModelRecipe, OutputRecipe,
    ParallelRecipe, Recipe, TokenizerSource, TrainRecipe,
};
pub use summary::{RankMemory, RunOptions, Summary};
pub use trainer::{lr_at, parallel_plan, train_rank, train_rank_with};

/// The training backend (kiln's one alias): `Autodiff<Kiln<B>, C>`.
pub use kiln_shard::Train;

use kiln_comm::LocalGroup;
use std::sync::Arc;

/// Runs the recipe on `ranks` threads of this process (a [`LocalGroup`]) on `B`'s default
/// device and returns rank 0's summary.
///
/// # Errors
/// The first rank's error, in rank order.
pub fn train_threads<B: burn::tensor::backend::Backend>(
    recipe: &Recipe,
    ranks: usize,
    options: RunOptions,
) -> Result<Summary> {
    if ranks == 0 {
        return Err(TrainError::World("--ranks must be at least 1".into()));
    }
    // Check before any thread starts, so that a bad world size is one clear error.
    recipe.check_world(ranks, false)?;
    let results = kiln_shard::threads::spawn_ranks(ranks, |g: LocalGroup| {
        train_rank::<B>(recipe, Arc::new(g), false, options, &Default::default())
    })?;
    rank_zero_or_root_cause(results)
}

/// Rank 0's result when every rank succeeded; otherwise the error of the first rank that failed
/// for a reason of its own, rather than a peer's that only saw it leave (a lost-peer or timeout
/// error of the process group).
///
/// # Errors
/// As described.
pub fn rank_zero_or_root_cause<T>(results: Vec<Result<T>>) -> Result<T> {
    if let Some(i) = results
        .iter()
        .position(|r| r.as_ref().is_err_and(|e| !e.is_peer_failure()))
        .or_else(|| results.iter().position(Result::is_err))
    {
        return match results.into_iter().nth(i).expect("found") {
            Err(e) => Err(TrainError::Rank {
                rank: i,
                source: Box::new(e),
            }),
            Ok(_) => unreachable!("position of an error"),
        };
    }
    results.into_iter().next().expect("at least one rank")
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_comm::{CommError, OpContext, OpKind};

    /// The error and its sources, as anyhow's `{:#}` prints them.
    fn chain(e: &dyn std::error::Error) -> String {
        let mut parts = vec![e.to_string()];
        let mut next = e.source();
        while let Some(s) = next {
            parts.push(s.to_string());
            next = s.source();
        }
        parts.join(": ")
    }

    #[test]
    fn each_cause_is_named_once_in_the_chain() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
        let e = TrainError::Rank {
            rank: 0,
            source: Box::new(TrainError::Io {
                what: "cannot read the data file /x".into(),
                source: io,
            }),
        };
        assert_eq!(
            chain(&e),
            "rank 0 failed: cannot read the data file /x: no such file"
        );
    }

    #[test]
    fn the_root_cause_wins_over_a_peer_that_saw_it_leave() {
        let lost = || -> Result<()> {
            Err(TrainError::Comm(CommError::PeerLost {
                op: OpContext {
                    kind: OpKind::AllReduce,
                    seq: 3,
                    group: "world".into(),
                    rank: 0,
                    world_size: 2,
                },
                peer: 1,
                reason: "connection closed".into(),
            }))
        };
        let full = || Err(TrainError::Snapshot("disk full".into()));
        let e = rank_zero_or_root_cause(vec![lost(), full()]).unwrap_err();
        assert_eq!(chain(&e), "rank 1 failed: disk full");
        let e = rank_zero_or_root_cause(vec![Ok(()), lost()]).unwrap_err();
        assert!(e.is_peer_failure());
        assert!(chain(&e).starts_with("rank 1 failed: all_reduce #3"), "{e}");
        assert!(rank_zero_or_root_cause(vec![Ok(1), Ok(2)]).unwrap() == 1);
    }
}
