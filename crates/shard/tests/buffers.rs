//! Buffers under sharding: a small ResNet-style CNN with Burn's `BatchNorm` (which kiln did not
//! write) trains under DDP, ZeRO-2, ZeRO-3 and hybrid; after training every rank holds the same
//! running statistics, and they are what the buffer policy says: rank 0's (`Broadcast`, the
//! default) or the ranks' mean (`Mean`: for the running mean, the statistic of the whole
//! batch, as one device computes it). ZeRO-3 keeps the statistics whole on every rank. With
//! `Sync` (SyncBatchNorm), the batch statistics are the whole batch's in every forward, and the
//! whole trained model equals one device's on the whole batch.

use burn::backend::Flex;
use burn::module::{AutodiffModule, Module, ModuleVisitor, Param};
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig, PaddingConfig2d, Relu};
use burn::optim::AdamWConfig;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use kiln_comm::{LocalGroup, ProcessGroup, spawn_ranks};
use kiln_shard::Train;
use kiln_shard::{
    BufferPolicy, InitSync, ShardConfig, ShardTensor, ShardedOptimizer, StepConfig, Strategy,
    buffer_paths, gather_model, shard, step,
};
use std::sync::Arc;

type B = Train<Flex>;

/// conv -> BN -> relu -> (conv -> BN) + skip -> relu -> mean over pixels -> linear.
#[derive(Module, Debug)]
struct Net<B: Backend> {
    stem: Conv2d<B>,
    norm1: BatchNorm<B>,
    conv: Conv2d<B>,
    norm2: BatchNorm<B>,
    head: Linear<B>,
    act: Relu,
}

impl<B: Backend> Net<B> {
    fn new(device: &B::Device) -> Self {
        let pad = PaddingConfig2d::Explicit(1, 1, 1, 1);
        let net = Net {
            // No bias before a BatchNorm (as ResNets): it cancels, its gradient is rounding
            // noise, and AdamW would turn that noise into steps of the learning rate.
            stem: Conv2dConfig::new([2, 6], [3, 3])
                .with_padding(pad.clone())
                .with_bias(false)
                .init(device),
            norm1: BatchNormConfig::new(6).init(device),
            conv: Conv2dConfig::new([6, 6], [3, 3])
                .with_padding(pad)
                .with_bias(false)
                .init(device),
            norm2: BatchNormConfig::new(6).init(device),
            head: LinearConfig::new(6, 3).init(device),
            act: Relu,
        };
        // Deterministic weights: every run starts from the same model.
        let mut salt = 0;
        net.map(&mut Fill(&mut salt))
    }

    fn loss(&self, x: Tensor<B, 4>, y: Tensor<B, 2>) -> Tensor<B, 1> {
        let h = self.act.forward(self.norm1.forward(self.stem.forward(x)));
        let h = self
            .act
            .forward(self.norm2.forward(self.conv.forward(h.clone())) + h);
        let [n, c, _, _] = h.dims();
        let pooled = h.mean_dim(3).mean_dim(2).reshape([n, c]);
        (self.head.forward(pooled) - y).powi_scalar(2).mean()
    }
}

/// Weights from a formula (every rank, every run alike).
struct Fill<'a>(&'a mut usize);

impl<B: Backend> burn::module::ModuleMapper<B> for Fill<'_> {
    fn map_float<const D: usize>(
        &mut self,
        p: burn::module::Param<Tensor<B, D>>,
    ) -> burn::module::Param<Tensor<B, D>> {
        let (id, t, mapper) = p.consume();
        if !t.is_require_grad() {
            return burn::module::Param::from_mapped_value(id, t, mapper);
        }
        *self.0 += 1;
        let salt = *self.0;
        let shape = t.shape();
        let n = shape.num_elements();
        let v: Vec<f32> = (0..n)
            .map(|i| ((((i * 7919 + salt * 104_729) % 1000) as f32 / 500.0) - 1.0) * 0.3)
            .collect();
        let out = Tensor::<B, D>::from_data(TensorData::new(v, shape), &t.device()).require_grad();
        burn::module::Param::from_mapped_value(id, out, mapper)
    }
}

const ROWS: usize = 8;

/// Rows `range` of the global batch of step `step`: images [rows, 2, 5, 5], targets [rows, 3].
fn batch(range: std::ops::Range<usize>, step: usize) -> (Tensor<B, 4>, Tensor<B, 2>) {
    let device = Default::default();
    let px = 2 * 5 * 5;
    let x: Vec<f32> = range
        .clone()
        .flat_map(|r| {
            (0..px).map(move |i| {
                (((r * 31 + i * 17 + step * 7) % 23) as f32 / 11.0) - 1.0 + r as f32 * 0.1
            })
        })
        .collect();
    let y: Vec<f32> = range
        .clone()
        .flat_map(|r| (0..3).map(move |j| ((r + j + step) % 5) as f32 / 4.0))
        .collect();
    let rows = range.len();
    (
        Tensor::from_data(TensorData::new(x, [rows, 2, 5, 5]), &device),
        Tensor::from_data(TensorData::new(y, [rows, 3]), &device),
    )
}

/// The running statistics (norm1 mean, var, norm2 mean, var), concatenated.
fn statistics(net: &Net<B>) -> Vec<f32> {
    let net = net.valid();
    [
        net.norm1.running_mean.value(),
        net.norm1.running_var.value(),
        net.norm2.running_mean.value(),
        net.norm2.running_var.value(),
    ]
    .into_iter()
    .flat_map(|t| t.into_data().to_vec::<f32>().unwrap())
    .collect()
}

/// Every float of the model (parameters and buffers), in visiting order.
fn everything(net: &Net<B>) -> Vec<f32> {
    struct Collect(Vec<f32>);
    impl<B: Backend> ModuleVisitor<B> for Collect {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
            self.0.extend(
                p.val()
                    .into_data()
                    .convert::<f32>()
                    .to_vec::<f32>()
                    .unwrap(),
            );
        }
    }
    let mut c = Collect(Vec::new());
    net.valid().visit(&mut c);
    c.0
}

/// Trains `steps` steps on `world` ranks (each its rows of the global batch): every rank's final
/// statistics, and whether the statistics were whole tensors on the rank.
fn train(
    world: usize,
    strategy: Strategy,
    policy: BufferPolicy,
    steps: usize,
) -> Vec<(Vec<f32>, bool)> {
    train_model(world, strategy, policy, steps, StepConfig::default())
        .into_iter()
        .map(|(stats, whole, _)| (stats, whole))
        .collect()
}

/// [`train`], with every rank's whole trained model ([`everything`], gathered).
fn train_model(
    world: usize,
    strategy: Strategy,
    policy: BufferPolicy,
    steps: usize,
    options: StepConfig,
) -> Vec<(Vec<f32>, bool, Vec<f32>)> {
    spawn_ranks(world, |g: LocalGroup| {
        let group: Arc<dyn ProcessGroup> = Arc::new(g);
        let rank = group.rank();
        let net = Net::<B>::new(&Default::default());
        let config = ShardConfig::new(strategy)
            .with_init(InitSync::Verify)
            .with_buffers(policy);
        let mut net = shard(net, group, config).unwrap();
        let whole = {
            let mut whole = true;
            let inner = net.norm1.running_mean.value();
            if matches!(
                inner.inner().into_primitive().tensor(),
                ShardTensor::Sharded(_)
            ) {
                whole = false;
            }
            whole
        };
        let mut optim = ShardedOptimizer::<_, Flex>::new(AdamWConfig::new().init::<B, Net<B>>());
        let local = ROWS / world;
        for s in 0..steps {
            let (x, y) = batch(rank * local..(rank + 1) * local, s);
            let (stepped, _) = step(net, &mut optim, 1e-2, &options, |m, _| {
                m.loss(x.clone(), y.clone())
            })
            .unwrap();
            net = stepped;
        }
        let model = everything(&gather_model(net.clone()));
        (statistics(&net), whole, model)
    })
}

/// Every strategy, on 2 ranks (hybrid: 2 groups of 2).
const LAYOUTS: [(Strategy, usize); 4] = [
    (Strategy::Ddp, 2),
    (Strategy::Zero2, 2),
    (Strategy::Zero3, 2),
    (Strategy::Hybrid { shard_size: 2 }, 4),
];

fn close(a: &[f32], b: &[f32], tol: f32) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| (x - y).abs() <= tol * (1.0 + y.abs()))
}

#[test]
fn batch_norm_statistics_are_buffers() {
    let net = Net::<B>::new(&Default::default());
    let paths = buffer_paths::<B, _>(&net, &[]);
    let want = [
        "norm1.running_mean",
        "norm1.running_var",
        "norm2.running_mean",
        "norm2.running_var",
    ];
    assert_eq!(paths.into_iter().collect::<Vec<_>>(), want);
}

#[test]
fn every_strategy_ends_with_equal_statistics_by_policy() {
    // Local: each rank's own statistics (rank 0's are what Broadcast gives everyone).
    let local = train(2, Strategy::Ddp, BufferPolicy::Local, 3);
    assert!(
        !close(&local[0].0, &local[1].0, 1e-6),
        "the ranks' own statistics should differ (different rows)"
    );
    let rank0 = &local[0].0;
    let mean: Vec<f32> = local[0]
        .0
        .iter()
        .zip(&local[1].0)
        .map(|(a, b)| (a + b) / 2.0)
        .collect();
    for (strategy, world) in LAYOUTS {
        let runs = train(world, strategy, BufferPolicy::Broadcast, 3);
        for (rank, (stats, whole)) in runs.iter().enumerate() {
            assert!(
                whole,
                "{strategy}: rank {rank} holds its statistics sharded"
            );
            assert_eq!(
                stats, &runs[0].0,
                "{strategy}: rank {rank} differs from rank 0"
            );
        }
        if world == 2 {
            assert!(
                close(&runs[0].0, rank0, 1e-6),
                "{strategy}: broadcast statistics are not rank 0's"
            );
            let means = train(world, strategy, BufferPolicy::Mean, 3);
            for (rank, (stats, _)) in means.iter().enumerate() {
                assert_eq!(stats, &means[0].0, "{strategy} mean: rank {rank} differs");
            }
            // Each step's update is linear in the batch statistics, and every rank starts a
            // step from the same values: the mean policy's statistics are the mean of what the
            // ranks would each compute.
            assert!(
                close(&means[0].0, &mean, 1e-5),
                "{strategy}: mean statistics {:?} vs the ranks' mean {mean:?}",
                means[0].0
            );
        }
    }
}

#[test]
fn the_mean_policys_running_mean_is_the_whole_batchs() {
    // One device on the whole batch, one step: the first BatchNorm sees the same rows as one
    // device does (split over the ranks), so its running mean, the mean of the ranks' batch
    // means, is the whole batch's. (The later ones see rows normalised by each rank's own batch
    // statistics, which differ from one device's: that is what SyncBatchNorm would change.)
    let one = train(1, Strategy::Ddp, BufferPolicy::Mean, 1);
    let two = train(2, Strategy::Zero3, BufferPolicy::Mean, 1);
    let means = |s: &[f32]| s[0..6].to_vec();
    assert!(
        close(&means(&two[0].0), &means(&one[0].0), 1e-5),
        "{:?} vs {:?}",
        means(&two[0].0),
        means(&one[0].0)
    );
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn sync_batch_norm_trains_the_model_one_device_trains_on_the_whole_batch() {
    // One device, 8 rows a step, 3 steps: the reference (Sync on one rank changes nothing).
    let one = train_model(
        1,
        Strategy::Ddp,
        BufferPolicy::Sync,
        3,
        StepConfig::default(),
    );
    let (one_stats, one_model) = (&one[0].0, &one[0].2);
    // Without Sync, each rank normalises by its own rows: the model differs from one device's
    // (so the comparison below can fail).
    let mean = train_model(
        2,
        Strategy::Ddp,
        BufferPolicy::Mean,
        3,
        StepConfig::default(),
    );
    let apart = max_diff(&mean[0].2, one_model);
    assert!(
        apart > 1e-4,
        "per-rank statistics should differ from one device's ({apart})"
    );
    eprintln!("mean policy x2: model {apart:.2e} from one device");
    for (strategy, world) in LAYOUTS {
        let runs = train_model(
            world,
            strategy,
            BufferPolicy::Sync,
            3,
            StepConfig::default(),
        );
        for (rank, (stats, whole, model)) in runs.iter().enumerate() {
            assert!(
                whole,
                "{strategy}: rank {rank} holds its statistics sharded"
            );
            let d = max_diff(stats, one_stats);
            assert!(
                close(stats, one_stats, 1e-5),
                "{strategy} x{world}: rank {rank}'s running statistics differ from one device's by {d}"
            );
            let d = max_diff(model, one_model);
            assert!(
                close(model, one_model, 1e-5),
                "{strategy} x{world}: rank {rank}'s model differs from one device's by {d}"
            );
            eprintln!(
                "{strategy} x{world} rank {rank}: statistics {:.2e}, model {d:.2e} from one device",
                max_diff(stats, one_stats)
            );
        }
    }
}

#[test]
fn sync_batch_norm_under_remat_and_bf16() {
    // With a remat budget (activations recomputed in backward): ZeRO-3 x2 trains one device's
    // model.
    let budget = StepConfig {
        remat_budget: Some(2048),
        ..StepConfig::default()
    };
    let one = train_model(1, Strategy::Ddp, BufferPolicy::Sync, 3, budget);
    let two = train_model(2, Strategy::Zero3, BufferPolicy::Sync, 3, budget);
    for (rank, (_, _, model)) in two.iter().enumerate() {
        let d = max_diff(model, &one[0].2);
        assert!(
            close(model, &one[0].2, 1e-5),
            "remat budget: zero3 x2 rank {rank} differs from one device by {d}"
        );
        eprintln!("remat budget 2 KiB: zero3 x2 rank {rank}: model {d:.2e} from one device");
    }
    // Under bf16 the convolutions round their inputs to bf16, so a last-bit difference in a
    // statistic can move a value by bf16's step, and AdamW's first step (the gradient's sign)
    // flips on gradients near zero: the trained models are not comparable closely. The
    // statistics of one step are: the convolutions' outputs are bf16 (autocast keeps them in
    // the compute dtype), so each statistic is a bf16 value, and under Sync it is one device's
    // within two bf16 steps (one is 1.2e-4 at these magnitudes; measured 1.22e-4); without Sync
    // it is more than 20 steps away (measured 2.75e-3).
    let bf16 = StepConfig {
        precision: kiln_shard::Precision::BF16,
        ..StepConfig::default()
    };
    let one = train_model(1, Strategy::Ddp, BufferPolicy::Sync, 1, bf16);
    let sync = train_model(2, Strategy::Zero3, BufferPolicy::Sync, 1, bf16);
    let mean = train_model(2, Strategy::Zero3, BufferPolicy::Mean, 1, bf16);
    let (d_sync, d_mean) = (
        max_diff(&sync[0].0, &one[0].0),
        max_diff(&mean[0].0, &one[0].0),
    );
    eprintln!(
        "bf16, one step: statistics {d_sync:.2e} (sync), {d_mean:.2e} (mean) from one device"
    );
    assert!(close(&sync[0].0, &one[0].0, 2.5e-4), "bf16 sync: {d_sync}");
    assert!(d_mean > 1e-3, "bf16 mean: {d_mean}");
}
