//! Burn's AG News text classification (upstream `examples/ag-news-train.rs`) on synthetic
//! headlines, trained by plain burn-train or under kiln.
//!
//! ```sh
//! cargo run --release -p burn-text-classification -- plain
//! cargo run --release -p burn-text-classification -- kiln 2 zero3
//! target/release/kiln launch --nproc-per-node 2 -- target/release/burn-text-classification kiln 2 zero3
//! ```
//!
//! Options: `epochs=N train=N test=N batch=N d_model=N layers=N heads=N seq=N dropout=X
//! resume=EPOCH full_precision=BOOL dir=PATH`
//! (upstream's model: d_model 256, 4 layers, 8 heads, sequences of 256, dropout 0.1).

use burn::backend::{Autodiff, Flex};
use burn::nn::attention::SeqLengthOption;
use burn::nn::transformer::TransformerEncoderConfig;
use burn::optim::{AdamConfig, decay::WeightDecayConfig};
use burn::train::{ExecutionStrategy, TrainingStrategy};
use kiln::learner::KilnStrategy;
use kiln::{ParallelPlan, Train};
use std::sync::Arc;
use text_classification::{AgNewsDataset, training::ExperimentConfig};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: burn-text-classification plain | kiln RANKS STRATEGY, then epochs=N \
                 train=N test=N batch=N d_model=N layers=N heads=N seq=N dropout=X resume=EPOCH full_precision=BOOL dir=PATH";
    let (mode, rest) = match args.first().map(String::as_str) {
        Some("plain") => ("plain", &args[1..]),
        Some("kiln") if args.len() >= 3 => ("kiln", &args[3..]),
        _ => anyhow::bail!("{usage}"),
    };
    let (mut d_model, mut layers, mut heads, mut dropout) = (256, 4, 8, 0.1);
    let mut dir = String::from("/tmp/text-classification-ag-news");
    let mut config = ExperimentConfig::new(
        TransformerEncoderConfig::new(256, 1024, 8, 4),
        AdamConfig::new().with_weight_decay(Some(WeightDecayConfig::new(5e-5))),
    );
    for a in rest {
        let (k, v) = a
            .split_once('=')
            .ok_or_else(|| anyhow::anyhow!("{a:?}: {usage}"))?;
        let n = || v.parse::<usize>().map_err(|e| anyhow::anyhow!("{a}: {e}"));
        match k {
            "epochs" => config.num_epochs = n()?,
            "train" => config.train_items = n()?,
            "test" => config.test_items = n()?,
            "batch" => config.batch_size = n()?,
            "seq" => config.seq_length = SeqLengthOption::Fixed(n()?),
            "d_model" => d_model = n()?,
            "layers" => layers = n()?,
            "heads" => heads = n()?,
            "dropout" => dropout = v.parse()?,
            "resume" => config.resume = Some(n()?),
            "full_precision" => config.full_precision_checkpoints = v.parse()?,
            "dir" => dir = v.to_string(),
            _ => anyhow::bail!("{a:?}: {usage}"),
        }
    }
    config.transformer = TransformerEncoderConfig::new(d_model, 4 * d_model, heads, layers)
        .with_norm_first(true)
        .with_quiet_softmax(true)
        .with_dropout(dropout);
    let (train, test) = (AgNewsDataset::train(), AgNewsDataset::test());
    // kiln: the backend seeded (upstream's is not), so that runs (and the processes of one job)
    // start from the same weights and can be compared.
    <Flex as burn::tensor::backend::Backend>::seed(&Default::default(), config.seed);
    if mode == "plain" {
        let strategy = ExecutionStrategy::SingleDevice(Default::default()).into();
        text_classification::training::train::<Autodiff<Flex>, _>(
            strategy, train, test, config, &dir,
        );
    } else {
        let ranks: usize = args[1].parse()?;
        let plan = ParallelPlan::new(args[2].parse()?);
        let kiln = Arc::new(KilnStrategy::<Flex>::launched_or_threads(ranks, plan)?);
        let strategy = TrainingStrategy::Custom(kiln.clone());
        text_classification::training::train::<Train<Flex>, _>(strategy, train, test, config, &dir);
        // What each rank of this process held (under ZeRO-3: about 1/N of one device's).
        for f in kiln.figures() {
            eprintln!(
                "kiln: rank {} of {}: parameters {} B, optimizer state {} B, {} steps",
                f.rank,
                kiln.world_size(),
                f.param_bytes,
                f.optim_bytes,
                f.steps
            );
        }
    }
    Ok(())
}
