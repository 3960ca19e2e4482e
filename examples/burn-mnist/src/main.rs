//! Burn's MNIST example on synthetic images, trained by plain burn-train or under kiln.
//!
//! ```sh
//! cargo run --release -p burn-mnist -- plain                    # Autodiff<Flex>, one device
//! cargo run --release -p burn-mnist -- kiln 2 zero3             # Train<Flex>, 2 ranks as threads
//! target/release/kiln launch --nproc-per-node 2 -- target/release/burn-mnist kiln 2 zero3
//! ```
//!
//! Options after those: `epochs=N train=N valid=N batch=N workers=N dir=PATH`.

use burn::backend::{Autodiff, Flex};
use burn::train::{ExecutionStrategy, TrainingStrategy};
use burn_mnist::training::{self, default_config};
use kiln::learner::KilnStrategy;
use kiln::{ParallelPlan, Train};
use std::sync::Arc;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: burn-mnist plain | kiln RANKS STRATEGY, then epochs=N train=N valid=N \
                 batch=N workers=N dir=PATH";
    let mut config = default_config();
    let mut dir = String::from("/tmp/burn-example-mnist");
    let (mode, rest) = match args.first().map(String::as_str) {
        Some("plain") => ("plain", &args[1..]),
        Some("kiln") if args.len() >= 3 => ("kiln", &args[3..]),
        _ => anyhow::bail!("{usage}"),
    };
    for a in rest {
        let (k, v) = a
            .split_once('=')
            .ok_or_else(|| anyhow::anyhow!("{a:?}: {usage}"))?;
        let n = || v.parse::<usize>().map_err(|e| anyhow::anyhow!("{a}: {e}"));
        match k {
            "epochs" => config.num_epochs = n()?,
            "train" => config.train_items = n()?,
            "valid" => config.valid_items = n()?,
            "test" => config.test_items = n()?,
            "batch" => config.batch_size = n()?,
            "workers" => config.num_workers = n()?,
            "dir" => dir = v.to_string(),
            _ => anyhow::bail!("{a:?}: {usage}"),
        }
    }
    if mode == "plain" {
        let strategy = ExecutionStrategy::SingleDevice(Default::default()).into();
        training::run::<Autodiff<Flex>>(Default::default(), config, &dir, strategy);
    } else {
        let ranks: usize = args[1].parse()?;
        let plan = ParallelPlan::new(args[2].parse()?);
        // Under `kiln launch` (or torchrun, SLURM, mpirun) this process is one rank; else
        // `ranks` threads.
        let strategy = KilnStrategy::<Flex>::launched_or_threads(ranks, plan)?;
        let strategy = TrainingStrategy::Custom(Arc::new(strategy));
        training::run::<Train<Flex>>(Default::default(), config, &dir, strategy);
    }
    Ok(())
}
