//! Burn's text-classification example, small (d_model 16, one layer, no dropout): one rank of
//! kiln equals plain burn-train, and DDP x2, ZeRO-3 x2 and tensor parallelism x2 by a plan on
//! burn-nn's module paths (ranks as threads) equal one rank, within 1e-5, over every training
//! and validation batch.

use burn::backend::{Autodiff, Flex};
use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::attention::SeqLengthOption;
use burn::nn::transformer::TransformerEncoderConfig;
use burn::optim::AdamConfig;
use burn::prelude::*;
use burn::train::{ExecutionStrategy, TrainingStrategy};
use kiln::learner::KilnStrategy;
use kiln::shard::{Strategy, TpPlan, TpStyle};
use kiln::{ParallelPlan, Train};
use std::path::Path;
use std::sync::Arc;
use text_classification::AgNewsDataset;
use text_classification::training::{Components, ExperimentConfig, train};

fn config() -> ExperimentConfig {
    let mut c = ExperimentConfig::new(
        TransformerEncoderConfig::new(16, 32, 2, 1)
            .with_norm_first(true)
            .with_quiet_softmax(true)
            .with_dropout(0.0),
        AdamConfig::new(),
    );
    c.seq_length = SeqLengthOption::Fixed(16);
    c.batch_size = 8;
    c.num_epochs = 2;
    c.train_items = 36; // 4 batches of 8 and one of 4
    c.test_items = 16;
    c
}

fn dir(name: &str) -> String {
    let d = std::env::temp_dir().join(format!("kiln-agnews-{}-{name}", std::process::id()));
    d.to_string_lossy().into_owned()
}

fn weights<B: Backend, M: Module<B>>(m: &M) -> Vec<f64> {
    struct V(Vec<f64>);
    impl<B: Backend> ModuleVisitor<B> for V {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
            self.0
                .extend(p.val().into_data().convert::<f64>().iter::<f64>());
        }
    }
    let mut v = V(Vec::new());
    m.visit(&mut v);
    v.0
}

fn losses(dir: &str, split: &str, epoch: usize) -> Vec<f64> {
    let f = Path::new(dir)
        .join(split)
        .join(format!("epoch-{epoch}"))
        .join("Loss.log");
    std::fs::read_to_string(&f)
        .unwrap_or_else(|e| panic!("{}: {e}", f.display()))
        .lines()
        .map(|l| l.split(',').next().unwrap().parse().unwrap())
        .collect()
}

fn check(what: &str, a: &[f64], b: &[f64]) {
    assert_eq!(a.len(), b.len(), "{what}");
    let d = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max);
    println!("{what}: {} values, largest difference {d:.2e}", a.len());
    assert!(d <= 1e-5, "{what}: {d}");
}

fn kiln(ranks: usize, strategy: Strategy) -> TrainingStrategy<Components<Train<Flex>>> {
    TrainingStrategy::Custom(Arc::new(
        KilnStrategy::<Flex>::threads(ranks, ParallelPlan::new(strategy)).unwrap(),
    ))
}

#[test]
fn text_classification_under_kiln_equals_plain_burn_train() {
    let (p, k1) = (dir("plain"), dir("kiln1"));
    // The example does not seed its backend (upstream's neither): each run here starts from
    // the same initial weights.
    let seed = || Flex::seed(&Default::default(), 0);
    seed();
    let plain = train::<Autodiff<Flex>, _>(
        ExecutionStrategy::SingleDevice(Default::default()).into(),
        AgNewsDataset::train(),
        AgNewsDataset::test(),
        config(),
        &p,
    );
    seed();
    let one = train::<Train<Flex>, _>(
        kiln(1, Strategy::Ddp),
        AgNewsDataset::train(),
        AgNewsDataset::test(),
        config(),
        &k1,
    );
    for epoch in 1..=2 {
        for split in ["train", "valid"] {
            check(
                &format!("AG News, 1 rank vs plain burn-train, {split} losses, epoch {epoch}"),
                &losses(&k1, split, epoch),
                &losses(&p, split, epoch),
            );
        }
    }
    check(
        "AG News, 1 rank vs plain burn-train, weights",
        &weights(&one),
        &weights(&plain),
    );
    for strategy in [Strategy::Ddp, Strategy::Zero3] {
        let k2 = dir(&format!("{strategy:?}"));
        seed();
        let two = train::<Train<Flex>, _>(
            kiln(2, strategy),
            AgNewsDataset::train(),
            AgNewsDataset::test(),
            config(),
            &k2,
        );
        for epoch in 1..=2 {
            for split in ["train", "valid"] {
                check(
                    &format!("AG News, {strategy:?} x2 vs 1 rank, {split} losses, epoch {epoch}"),
                    &losses(&k2, split, epoch),
                    &losses(&k1, split, epoch),
                );
            }
        }
        check(
            &format!("AG News, {strategy:?} x2 vs 1 rank, weights"),
            &weights(&two),
            &weights(&one),
        );
        std::fs::remove_dir_all(&k2).ok();
    }
    // Tensor parallelism over 2 ranks by a plan on burn-nn's module paths (Megatron's split of
    // the attention's projections and the feed-forward), the model's code unchanged.
    let col = TpStyle::Colwise { blocks: 1 };
    let mut plan = ParallelPlan::new(Strategy::Ddp);
    plan.tp = 2;
    plan.tp_plan = TpPlan::from_pairs(&[
        ("query", col),
        ("key", col),
        ("value", col),
        ("output", TpStyle::Rowwise),
        ("linear_inner", col),
        ("linear_outer", TpStyle::Rowwise),
    ]);
    let kt = dir("tp2");
    seed();
    let tp = train::<Train<Flex>, _>(
        TrainingStrategy::Custom(Arc::new(KilnStrategy::<Flex>::threads(2, plan).unwrap())),
        AgNewsDataset::train(),
        AgNewsDataset::test(),
        config(),
        &kt,
    );
    for epoch in 1..=2 {
        for split in ["train", "valid"] {
            check(
                &format!("AG News, tp 2 vs 1 rank, {split} losses, epoch {epoch}"),
                &losses(&kt, split, epoch),
                &losses(&k1, split, epoch),
            );
        }
    }
    check(
        "AG News, tp 2 vs 1 rank, weights",
        &weights(&tp),
        &weights(&one),
    );
    std::fs::remove_dir_all(&kt).ok();
    std::fs::remove_dir_all(&p).ok();
    std::fs::remove_dir_all(&k1).ok();
}
