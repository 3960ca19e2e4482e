//! kiln inside burn-train: a small burn-train program (an MLP classifier, a shuffled loader, an
//! uneven last batch, accuracy and loss metrics, a file checkpointer) trained by burn-train's
//! own single-device strategy on plain `Autodiff<Flex>` and by `kiln::learner::KilnStrategy`
//! on `Train<Flex>`: one rank equals plain burn-train, N ranks under every strategy equal one
//! rank, the logs are written once, ZeRO-3 halves what a rank holds, and a run resumes from
//! the Learner's checkpoint at another world size with the same next losses.
//!
//! Ranks as processes: the test runs itself again as 2 processes with a launcher's environment
//! (what `kiln launch` sets); `scripts/learner-demo.sh` runs the same under `kiln launch`.

use burn::backend::{Autodiff, Flex};
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderBuilder};
use burn::data::dataset::InMemDataset;
use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig, Relu};
use burn::optim::AdamWConfig;
use burn::prelude::*;
use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder};
use burn::tensor::backend::AutodiffBackend;
use burn::train::metric::{AccuracyMetric, LossMetric};
use burn::train::{
    ClassificationOutput, InferenceStep, Learner, SupervisedTraining, TrainOutput, TrainStep,
    TrainingStrategy,
};
use kiln::learner::{KilnStrategy, Share, Split};
use kiln::shard::{BufferPolicy, Strategy};
use kiln::{ParallelPlan, Train};
use std::path::{Path, PathBuf};
use std::sync::Arc;

// ---- the program (what a burn-train user writes) ----

#[derive(Module, Debug)]
struct Mlp<B: Backend> {
    up: Linear<B>,
    /// In the SyncBatchNorm check only.
    norm: Option<BatchNorm<B>>,
    act: Relu,
    down: Linear<B>,
}

#[derive(Clone, Debug)]
struct Batch<B: Backend> {
    x: Tensor<B, 2>,
    y: Tensor<B, 1, Int>,
}

// The one addition to the program's data code.
impl<B: Backend> Split for Batch<B> {
    fn rows(&self) -> usize {
        self.y.dims()[0]
    }
    fn split(&self, share: &Share) -> Self {
        Batch {
            x: share.rows_of(&self.x),
            y: share.rows_of(&self.y),
        }
    }
}

impl<B: Backend> Mlp<B> {
    fn new(device: &B::Device, norm: bool) -> Self {
        Mlp {
            // No bias before a BatchNorm: it cancels, and AdamW would step on its gradient's
            // rounding noise.
            up: LinearConfig::new(4, 16).with_bias(!norm).init(device),
            norm: norm.then(|| BatchNormConfig::new(16).init(device)),
            act: Relu,
            down: LinearConfig::new(16, 3).init(device),
        }
    }
    fn forward(&self, b: Batch<B>) -> ClassificationOutput<B> {
        let h = self.up.forward(b.x);
        let h = match &self.norm {
            Some(norm) => norm.forward(h),
            None => h,
        };
        let output = self.down.forward(self.act.forward(h));
        let loss = CrossEntropyLossConfig::new()
            .init(&output.device())
            .forward(output.clone(), b.y.clone());
        ClassificationOutput {
            loss,
            output,
            targets: b.y,
        }
    }
}

impl<B: AutodiffBackend> TrainStep for Mlp<B> {
    type Input = Batch<B>;
    type Output = ClassificationOutput<B>;
    fn step(&self, b: Batch<B>) -> TrainOutput<ClassificationOutput<B>> {
        let item = self.forward(b);
        TrainOutput::new(self, item.loss.backward(), item)
    }
}

impl<B: Backend> InferenceStep for Mlp<B> {
    type Input = Batch<B>;
    type Output = ClassificationOutput<B>;
    fn step(&self, b: Batch<B>) -> ClassificationOutput<B> {
        self.forward(b)
    }
}

#[derive(Clone, Debug)]
struct Item {
    x: [f32; 4],
    y: i64,
}

#[derive(Clone)]
struct Rows;

impl<B: Backend> Batcher<B, Item, Batch<B>> for Rows {
    fn batch(&self, items: Vec<Item>, device: &B::Device) -> Batch<B> {
        let n = items.len();
        let x: Vec<f32> = items.iter().flat_map(|i| i.x).collect();
        let y: Vec<i64> = items.iter().map(|i| i.y).collect();
        Batch {
            x: Tensor::from_data(TensorData::new(x, [n, 4]), device),
            y: Tensor::from_data(TensorData::new(y, [n]), device),
        }
    }
}

fn items(n: usize, salt: usize) -> Vec<Item> {
    (0..n)
        .map(|i| {
            let k = i * 7 + salt;
            let x = [0, 1, 2, 3].map(|j| (((k * (j + 3)) % 11) as f32 - 5.0) / 5.0);
            let y = ((x[0] + 2.0 * x[1] - x[2] + 3.0) as i64).rem_euclid(3);
            Item { x, y }
        })
        .collect()
}

/// The program, generic over its backend; `strategy` is the one thing kiln's runs pass.
fn program<B: AutodiffBackend>(
    dir: &Path,
    epochs: usize,
    resume: Option<usize>,
    strategy: Option<TrainingStrategy<Components<B>>>,
) -> Mlp<B::InnerBackend>
where
    Batch<B>: Send,
{
    // 10 items in batches of 5: split 3 + 2 by 2 ranks, 2 + 1 + 1 + 1 by 4.
    program_with(dir, epochs, resume, strategy, 5)
}

/// The program with validation batches of `valid_batch` items.
fn program_with<B: AutodiffBackend>(
    dir: &Path,
    epochs: usize,
    resume: Option<usize>,
    strategy: Option<TrainingStrategy<Components<B>>>,
    valid_batch: usize,
) -> Mlp<B::InnerBackend>
where
    Batch<B>: Send,
{
    program_norm(dir, epochs, resume, strategy, valid_batch, false)
}

/// The program, with a BatchNorm after the first layer when `norm`.
fn program_norm<B: AutodiffBackend>(
    dir: &Path,
    epochs: usize,
    resume: Option<usize>,
    strategy: Option<TrainingStrategy<Components<B>>>,
    valid_batch: usize,
    norm: bool,
) -> Mlp<B::InnerBackend>
where
    Batch<B>: Send,
{
    let device = B::Device::default();
    B::seed(&device, 7);
    // 23 items in batches of 8: a last batch of 7, which 2 ranks split 4 + 3.
    let train: Arc<dyn DataLoader<B, Batch<B>>> = DataLoaderBuilder::new(Rows)
        .batch_size(8)
        .shuffle(11)
        .build(InMemDataset::new(items(23, 0)));
    let valid: Arc<dyn DataLoader<B::InnerBackend, Batch<B::InnerBackend>>> =
        DataLoaderBuilder::<B::InnerBackend, _, _>::new(Rows)
            .batch_size(valid_batch)
            .build(InMemDataset::new(items(10, 3)));
    let mut training = SupervisedTraining::new(dir, train, valid)
        .metrics((AccuracyMetric::new(), LossMetric::new()))
        .with_file_checkpointer(NamedMpkFileRecorder::<FullPrecisionSettings>::new())
        .with_application_logger(None)
        .num_epochs(epochs);
    if let Some(epoch) = resume {
        training = training.checkpoint(epoch);
    }
    if let Some(strategy) = strategy {
        training = training.with_training_strategy(strategy);
    }
    let model = Mlp::<B>::new(&device, norm);
    let optim = AdamWConfig::new().with_weight_decay(1e-2).init();
    training.launch(Learner::new(model, optim, 1e-2)).model
}

type Components<B> = burn::train::LearningComponentsMarker<
    B,
    f64,
    Mlp<B>,
    burn::optim::adaptor::OptimizerAdaptor<burn::optim::AdamW, Mlp<B>, B>,
>;

// ---- the checks ----

type K = Train<Flex>;

fn kiln(ranks: usize, strategy: Strategy) -> TrainingStrategy<Components<K>> {
    TrainingStrategy::Custom(Arc::new(
        KilnStrategy::<Flex>::threads(ranks, ParallelPlan::new(strategy)).expect("a valid plan"),
    ))
}

fn fresh(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-learner-{}-{name}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    dir
}

/// Every parameter's values, in module order.
fn values<B: Backend, M: Module<B>>(m: &M) -> Vec<f32> {
    struct V(Vec<f32>);
    impl<B: Backend> ModuleVisitor<B> for V {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
            self.0
                .extend(p.val().into_data().convert::<f32>().iter::<f32>());
        }
    }
    let mut v = V(Vec::new());
    m.visit(&mut v);
    v.0
}

/// The per-batch losses burn-train's file logger wrote for `split` and `epoch`.
fn logged(dir: &Path, split: &str, epoch: usize) -> Vec<f64> {
    let file = dir
        .join(split)
        .join(format!("epoch-{epoch}"))
        .join("Loss.log");
    std::fs::read_to_string(&file)
        .unwrap_or_else(|e| panic!("{}: {e}", file.display()))
        .lines()
        .map(|l| l.split(',').next().unwrap().parse().unwrap())
        .collect()
}

fn assert_close(what: &str, a: &[f64], b: &[f64], tol: f64) {
    assert_eq!(a.len(), b.len(), "{what}: {a:?} vs {b:?}");
    let worst = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max);
    assert!(worst <= tol, "{what}: differ by {worst:e}: {a:?} vs {b:?}");
    println!("{what}: {} values, largest difference {worst:.2e}", a.len());
}

/// The train and valid losses of both epochs of the run in `dir` equal those in `one` within
/// 1e-5 (written once: one line per batch).
fn same_losses(what: &str, dir: &Path, one: &Path) {
    for epoch in 1..=2 {
        for split in ["train", "valid"] {
            assert_close(
                &format!("{what}, {split} losses, epoch {epoch}"),
                &logged(dir, split, epoch),
                &logged(one, split, epoch),
                1e-5,
            );
        }
    }
}

fn weights<B: Backend>(m: &Mlp<B>) -> Vec<f64> {
    values::<B, _>(m).into_iter().map(f64::from).collect()
}

#[test]
fn one_rank_equals_plain_burn_train() {
    let (plain, one) = (fresh("plain"), fresh("one"));
    let p = program::<Autodiff<Flex>>(&plain, 2, None, None);
    let k = program::<K>(&one, 2, None, Some(kiln(1, Strategy::Ddp)));
    for epoch in 1..=2 {
        for split in ["train", "valid"] {
            assert_close(
                &format!("1 rank vs plain burn-train, {split} losses, epoch {epoch}"),
                &logged(&one, split, epoch),
                &logged(&plain, split, epoch),
                1e-5,
            );
        }
    }
    assert_close(
        "1 rank vs plain burn-train, weights",
        &weights(&k),
        &weights(&p),
        1e-5,
    );
}

#[test]
fn ranks_as_threads_equal_one_rank_under_every_strategy() {
    let one = fresh("ref");
    let reference = program::<K>(&one, 2, None, Some(kiln(1, Strategy::Ddp)));
    for (ranks, strategy) in [
        (2, Strategy::Ddp),
        (2, Strategy::Zero1),
        (2, Strategy::Zero2),
        (2, Strategy::Zero3),
        (4, Strategy::Hybrid { shard_size: 2 }),
    ] {
        let dir = fresh(&format!("{strategy:?}-{ranks}"));
        let model = program::<K>(&dir, 2, None, Some(kiln(ranks, strategy)));
        let what = format!("{strategy:?} x{ranks} vs 1 rank");
        same_losses(&what, &dir, &one);
        assert_close(
            &format!("{what}, weights"),
            &weights(&model),
            &weights(&reference),
            1e-5,
        );
        std::fs::remove_dir_all(&dir).ok();
    }
}

#[test]
fn sync_batch_norm_ranks_equal_one_rank_also_with_uneven_batches() {
    // A BatchNorm after the first layer; 23 items in batches of 8 (the last, 7, splits 4 + 3
    // over 2 ranks and 2 + 2 + 2 + 1 over 4): with BufferPolicy::Sync the ranks' statistics,
    // gradients and running statistics are one device's.
    let one = fresh("sync-ref");
    let reference = program_norm::<K>(&one, 2, None, Some(kiln(1, Strategy::Ddp)), 5, true);
    for (ranks, strategy) in [
        (2, Strategy::Zero3),
        (4, Strategy::Hybrid { shard_size: 2 }),
    ] {
        let dir = fresh(&format!("sync-{strategy:?}-{ranks}"));
        let mut plan = ParallelPlan::new(strategy);
        plan.shard = plan.shard.with_buffers(BufferPolicy::Sync);
        let sync = TrainingStrategy::Custom(Arc::new(
            KilnStrategy::<Flex>::threads(ranks, plan).expect("a valid plan"),
        ));
        let model = program_norm::<K>(&dir, 2, None, Some(sync), 5, true);
        let what = format!("sync BatchNorm, {strategy:?} x{ranks} vs 1 rank");
        same_losses(&what, &dir, &one);
        // Parameters and running statistics.
        assert_close(
            &format!("{what}, weights"),
            &weights(&model),
            &weights(&reference),
            1e-5,
        );
        std::fs::remove_dir_all(&dir).ok();
    }
}

#[test]
fn zero3_ranks_hold_half_of_one_device() {
    let measure = |ranks, strategy| {
        let s = Arc::new(
            KilnStrategy::<Flex>::threads(ranks, ParallelPlan::new(strategy)).expect("a plan"),
        );
        let dir = fresh(&format!("mem-{ranks}"));
        program::<K>(&dir, 1, None, Some(TrainingStrategy::Custom(s.clone())));
        std::fs::remove_dir_all(&dir).ok();
        s.figures()
    };
    let one = measure(1, Strategy::Ddp);
    let two = measure(2, Strategy::Zero3);
    assert_eq!(two.len(), 2);
    for f in &two {
        let (p, o) = (
            f.param_bytes as f64 / one[0].param_bytes as f64,
            f.optim_bytes as f64 / one[0].optim_bytes as f64,
        );
        println!(
            "ZeRO-3 x2 rank {}: parameters {} B ({p:.3} of one device's {} B), optimizer state \
             {} B ({o:.3} of {} B)",
            f.rank, f.param_bytes, one[0].param_bytes, f.optim_bytes, one[0].optim_bytes
        );
        assert!((0.45..=0.56).contains(&p), "parameters: {p}");
        assert!((0.45..=0.6).contains(&o), "optimizer state: {o}");
    }
}

#[test]
fn a_run_resumes_from_the_learners_checkpoint_at_another_world_size() {
    // The run that is not interrupted, 3 epochs.
    let whole = fresh("uninterrupted");
    program::<K>(&whole, 3, None, Some(kiln(2, Strategy::Zero3)));
    // A run that stops after epoch 2 (scripts/learner-demo.sh kills one with SIGKILL).
    let first = fresh("first");
    program::<K>(&first, 2, None, Some(kiln(2, Strategy::Zero3)));
    for (ranks, strategy) in [(2, Strategy::Zero3), (1, Strategy::Ddp), (2, Strategy::Ddp)] {
        let dir = fresh(&format!("resumed-{ranks}-{strategy:?}"));
        copy_dir(&first.join("checkpoint"), &dir.join("checkpoint"));
        program::<K>(&dir, 3, Some(2), Some(kiln(ranks, strategy)));
        assert_close(
            &format!("resumed at epoch 3 on {strategy:?} x{ranks} vs uninterrupted, losses"),
            // burn-train's loggers number a resumed run's epochs from 1, as plain burn-train's.
            &logged(&dir, "train", 1),
            &logged(&whole, "train", 3),
            1e-5,
        );
        std::fs::remove_dir_all(&dir).ok();
    }
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

#[test]
fn what_cannot_work_is_refused_by_name() {
    use kiln::pipe::{PipelineConfig, ScheduleKind};
    let mut plan = ParallelPlan::new(Strategy::Zero3);
    plan.pipeline = Some(PipelineConfig {
        stages: 2,
        microbatches: 2,
        schedule: ScheduleKind::OneFOneB,
        split: Default::default(),
    });
    let e = KilnStrategy::<Flex>::threads(2, plan)
        .unwrap_err()
        .to_string();
    assert!(e.contains("pipeline stages"), "{e}");
    let mut plan = ParallelPlan::new(Strategy::Ddp);
    plan.loss_scale = Some(Default::default());
    let e = KilnStrategy::<Flex>::threads(2, plan)
        .unwrap_err()
        .to_string();
    assert!(e.contains("loss scaling"), "{e}");
    let mut plan = ParallelPlan::new(Strategy::Ddp);
    plan.remat = kiln::Remat::Budget(1 << 20);
    let e = KilnStrategy::<Flex>::threads(2, plan)
        .unwrap_err()
        .to_string();
    assert!(e.contains("remat budget"), "{e}");
    let e = KilnStrategy::<Flex>::threads(3, ParallelPlan::new(Strategy::Hybrid { shard_size: 2 }))
        .unwrap_err()
        .to_string();
    assert!(e.contains("hybrid"), "{e}");
    let e = KilnStrategy::<Flex>::threads(0, ParallelPlan::new(Strategy::Ddp))
        .unwrap_err()
        .to_string();
    assert!(e.contains("at least one rank"), "{e}");
    // A batch smaller than the world (10 validation items in batches of 4: a last batch of 2
    // for 4 ranks) stops the job with its name, not deep in a tensor op.
    let dir = fresh("small-batch");
    let run = std::panic::catch_unwind(|| {
        program_with::<K>(&dir, 1, None, Some(kiln(4, Strategy::Ddp)), 4)
    });
    let e = run.expect_err("a batch of 2 over 4 ranks is refused");
    let e = e
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default();
    assert!(
        e.contains("a batch of 2 items cannot be split over 4 ranks"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

// ---- ranks as processes ----

const CHILD: &str = "KILN_LEARNER_TEST_CHILD";

/// One rank of the process job (run by the test below with a launcher's environment).
#[test]
fn process_rank() {
    let Ok(dir) = std::env::var(CHILD) else {
        return; // only as a child of `ranks_as_processes_equal_one_rank`
    };
    let strategy = KilnStrategy::<Flex>::launched("tcp", ParallelPlan::new(Strategy::Zero3))
        .expect("joined the job");
    let model = program::<K>(
        Path::new(&dir),
        2,
        None,
        Some(TrainingStrategy::Custom(Arc::new(strategy))),
    );
    // Every rank returns the whole model; each writes it for the parent to compare.
    let rank = std::env::var("RANK").unwrap();
    let w: Vec<String> = weights(&model).iter().map(f64::to_string).collect();
    std::fs::write(
        Path::new(&dir).join(format!("weights-{rank}")),
        w.join("\n"),
    )
    .unwrap();
}

#[test]
fn ranks_as_processes_equal_one_rank() {
    if std::env::var(CHILD).is_ok() {
        return;
    }
    let one = fresh("proc-ref");
    let reference = program::<K>(&one, 2, None, Some(kiln(1, Strategy::Ddp)));
    let dir = fresh("proc");
    std::fs::create_dir_all(&dir).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..2)
        .map(|rank| {
            std::process::Command::new(&exe)
                .args(["--exact", "process_rank", "--nocapture", "--test-threads=1"])
                .env(CHILD, &dir)
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", "2")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("RAYON_NUM_THREADS", "1")
                .spawn()
                .unwrap()
        })
        .collect();
    for mut c in children {
        assert!(c.wait().unwrap().success(), "a rank failed");
    }
    for epoch in 1..=2 {
        assert_close(
            &format!("ZeRO-3 x2 as processes vs 1 rank, train losses, epoch {epoch}"),
            &logged(&dir, "train", epoch),
            &logged(&one, "train", epoch),
            1e-5,
        );
    }
    for rank in 0..2 {
        let w: Vec<f64> = std::fs::read_to_string(dir.join(format!("weights-{rank}")))
            .unwrap()
            .lines()
            .map(|l| l.parse().unwrap())
            .collect();
        assert_close(
            &format!("ZeRO-3 x2 as processes (rank {rank}'s model) vs 1 rank, weights"),
            &w,
            &weights(&reference),
            1e-5,
        );
    }
    // The dashboard's logs and the checkpoints are rank 0's alone: one line per batch.
    assert_eq!(logged(&dir, "train", 1).len(), 3);
    std::fs::remove_dir_all(&dir).ok();
    std::fs::remove_dir_all(&one).ok();
}
