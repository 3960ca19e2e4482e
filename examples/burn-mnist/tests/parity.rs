//! Burn's MNIST example, small: one rank of kiln equals plain burn-train; 2 ranks train, log
//! once, and differ from one device only by the model's BatchNorm and dropout (see
//! docs/learner.md), which this test prints.

use burn::backend::{Autodiff, Flex};
use burn::module::{Module, ModuleVisitor, Param};
use burn::prelude::*;
use burn::train::{ExecutionStrategy, TrainingStrategy};
use burn_mnist::training::{MnistTrainingConfig, default_config, run};
use kiln::learner::KilnStrategy;
use kiln::shard::Strategy;
use kiln::{ParallelPlan, Train};
use std::path::Path;
use std::sync::Arc;

fn config() -> MnistTrainingConfig {
    let mut c = default_config();
    c.num_epochs = 1;
    c.train_items = 48;
    c.valid_items = 16;
    c.test_items = 16;
    c.batch_size = 16;
    c.num_workers = 1; // one worker: the dataset's order (more workers race)
    c
}

fn dir(name: &str) -> String {
    let d = std::env::temp_dir().join(format!("kiln-mnist-{}-{name}", std::process::id()));
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

fn losses(dir: &str, split: &str) -> Vec<f64> {
    let f = Path::new(dir).join(split).join("epoch-1").join("Loss.log");
    std::fs::read_to_string(&f)
        .unwrap_or_else(|e| panic!("{}: {e}", f.display()))
        .lines()
        .map(|l| l.split(',').next().unwrap().parse().unwrap())
        .collect()
}

fn largest(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

fn kiln(
    ranks: usize,
    strategy: Strategy,
) -> TrainingStrategy<burn_mnist::training::Components<Train<Flex>>> {
    TrainingStrategy::Custom(Arc::new(
        KilnStrategy::<Flex>::threads(ranks, ParallelPlan::new(strategy)).unwrap(),
    ))
}

#[test]
fn mnist_one_rank_equals_plain_burn_train_and_two_ranks_log_once() {
    let (p, k1) = (dir("plain"), dir("kiln1"));
    let plain = run::<Autodiff<Flex>>(
        Default::default(),
        config(),
        &p,
        ExecutionStrategy::SingleDevice(Default::default()).into(),
    );
    let one = run::<Train<Flex>>(Default::default(), config(), &k1, kiln(1, Strategy::Ddp));
    for split in ["train", "valid"] {
        let d = largest(&losses(&k1, split), &losses(&p, split));
        println!("MNIST, 1 rank vs plain burn-train, {split} losses: largest difference {d:.2e}");
        assert!(d <= 1e-5, "{split}: {d}");
    }
    let d = largest(&weights(&one), &weights(&plain));
    println!("MNIST, 1 rank vs plain burn-train, weights: largest difference {d:.2e}");
    assert!(d <= 1e-5, "weights: {d}");

    for strategy in [Strategy::Ddp, Strategy::Zero3] {
        let k2 = dir(&format!("{strategy:?}"));
        run::<Train<Flex>>(Default::default(), config(), &k2, kiln(2, strategy));
        let (l2, l1) = (losses(&k2, "train"), losses(&k1, "train"));
        // Written once: one line per batch.
        assert_eq!(l2.len(), 48 / 16);
        assert!(l2.iter().all(|l| l.is_finite()));
        println!(
            "MNIST, {strategy:?} x2 vs 1 rank, train losses: largest difference {:.2e} \
             (BatchNorm normalises each rank's rows, dropout draws per rank)",
            largest(&l2, &l1)
        );
        std::fs::remove_dir_all(&k2).ok();
    }
    std::fs::remove_dir_all(&p).ok();
    std::fs::remove_dir_all(&k1).ok();
}
