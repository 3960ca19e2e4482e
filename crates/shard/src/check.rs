//! Parity between N-rank and single-device training: the harness behind the parity tests and
//! `kiln shard-check` (which runs it on real processes or GPUs).
//!
//! A model trains for a few AdamW steps on a deterministic global batch, once on each rank
//! under a strategy (each rank taking its rows of the batch) and once as a single-device
//! reference on the whole batch with no sharding (the decorator then only forwards). The losses
//! and final parameters must agree to float tolerance.

use crate::{ShardConfig, ShardError, ShardedOptimizer, Strategy, gather_model, shard};
use burn::module::{AutodiffModule, Module, ModuleVisitor, Param};
use burn::nn::{Linear, Relu};
use burn::optim::AdamWConfig;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use kiln_comm::{ProcessGroup, ReduceOp};
use std::sync::Arc;

pub use crate::Train;

/// A model the harness can train: a loss on `(x, y)` rows.
pub trait ParityModel<B: Backend>: AutodiffModule<Train<B>> + Clone + Send + 'static {
    /// Mean loss of the rows.
    fn loss(&self, x: Tensor<Train<B>, 2>, y: Tensor<Train<B>, 2>) -> Tensor<Train<B>, 1>;
    /// Features per input row.
    fn input_width(&self) -> usize;
}

/// Targets per row.
pub const OUTPUTS: usize = 5;

/// A two-layer perceptron whose sizes (7 -> 13 -> 5) divide by no world size above 1, so
/// shards are uneven.
#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    a: Linear<B>,
    b: Linear<B>,
    act: Relu,
}

fn deterministic<B: Backend, const D: usize>(
    shape: [usize; D],
    salt: usize,
    device: &B::Device,
) -> Param<Tensor<B, D>> {
    let n: usize = shape.iter().product();
    let scale = 1.0 / (shape[0] as f32).sqrt();
    let v: Vec<f32> = (0..n)
        .map(|i| ((((i * 7919 + salt * 104_729) % 1000) as f32 / 500.0) - 1.0) * scale)
        .collect();
    Param::from_tensor(Tensor::from_data(TensorData::new(v, shape), device))
}

impl<B: Backend> Mlp<B> {
    /// Weights drawn by Burn's own initialisers (lazily, on first use) from the backend's
    /// random generator: different on every rank unless `shard` makes them equal.
    pub fn random(device: &B::Device) -> Self {
        use burn::nn::LinearConfig;
        Mlp {
            a: LinearConfig::new(7, 13).init(device),
            b: LinearConfig::new(13, OUTPUTS).init(device),
            act: Relu::new(),
        }
    }

    /// The outputs for input rows `x`.
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.b.forward(self.act.forward(self.a.forward(x)))
    }

    /// The same weights on every rank and in every process (no random numbers).
    pub fn new(device: &B::Device) -> Self {
        let linear = |i: usize, o: usize, salt: usize| Linear {
            weight: deterministic([i, o], salt, device),
            bias: Some(deterministic([o], salt + 1, device)),
        };
        Mlp {
            a: linear(7, 13, 1),
            b: linear(13, OUTPUTS, 3),
            act: Relu::new(),
        }
    }
}

impl<B: Backend> ParityModel<B> for Mlp<Train<B>> {
    fn loss(&self, x: Tensor<Train<B>, 2>, y: Tensor<Train<B>, 2>) -> Tensor<Train<B>, 1> {
        (self.forward(x) - y).powf_scalar(2.0).mean()
    }
    fn input_width(&self) -> usize {
        7
    }
}

/// Row `i` of step `step`'s global batch, for rows `rows`.
pub fn data<B: Backend>(
    width: usize,
    rows: std::ops::Range<usize>,
    step: usize,
    device: &B::Device,
) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let n = rows.len();
    let x: Vec<f32> = rows
        .clone()
        .flat_map(|i| {
            (0..width).map(move |j| (((i * 31 + j * 7 + step * 13) % 17) as f32 / 8.0) - 1.0)
        })
        .collect();
    let y: Vec<f32> = rows
        .flat_map(|i| {
            (0..OUTPUTS).map(move |j| (((i * 5 + j * 11 + step * 3) % 7) as f32 / 3.0) - 1.0)
        })
        .collect();
    (
        Tensor::from_data(TensorData::new(x, [n, width]), device),
        Tensor::from_data(TensorData::new(y, [n, OUTPUTS]), device),
    )
}

/// How to train.
#[derive(Clone, Copy, Debug)]
pub struct Options {
    /// Rows of the global batch (divided evenly among the ranks).
    pub global_batch: usize,
    /// AdamW steps.
    pub steps: usize,
    /// Global gradient-norm clipping.
    pub clip: Option<f64>,
    /// Micro-batches accumulated per step.
    pub accumulate: usize,
    /// Accumulate micro-batches under [`no_sync`](crate::no_sync) and reduce once per step.
    pub no_sync: bool,
    /// [`ShardConfig::overlap`]: communication on its own thread, ZeRO-3 prefetch.
    pub overlap: bool,
    /// [`StepConfig::remat_budget`](crate::StepConfig::remat_budget).
    pub remat_budget: Option<usize>,
    /// [`StepConfig::precision`](crate::StepConfig::precision).
    pub precision: crate::Precision,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            global_batch: 24,
            steps: 20,
            clip: None,
            accumulate: 1,
            no_sync: false,
            overlap: true,
            remat_budget: None,
            precision: crate::Precision::F32,
        }
    }
}

/// What one training run produced.
#[derive(Debug, Clone)]
pub struct Run {
    /// The global loss before each step.
    pub losses: Vec<f64>,
    /// Every parameter after the last step, flattened, in module order.
    pub params: Vec<Vec<f32>>,
    /// Every parameter before the first step (after `shard`: rank 0's weights).
    pub initial: Vec<Vec<f32>>,
    /// What this rank sent on sharding's groups during the steps (`account::comm_stats`;
    /// the harness's own loss all-reduce included, on the group it was given).
    pub traffic: kiln_comm::CommStats,
    /// Parameter gathers, and how many were prefetched (ZeRO-3 / hybrid with overlap).
    pub prefetch: crate::PrefetchStats,
}

/// `model` with every float parameter replaced by `values` (whole tensors, module order), for a
/// reference that starts from a sharded run's initial weights.
///
/// # Panics
/// If the number of parameters or a length differs.
pub fn with_values<B: Backend, M: AutodiffModule<Train<B>>>(model: M, values: &[Vec<f32>]) -> M {
    let mut next = values.iter();
    let model = crate::pieces::map_params::<B, Train<B>, M>(model, |path, _| {
        next.next()
            .unwrap_or_else(|| panic!("no value for parameter {path}"))
            .clone()
    });
    assert!(next.next().is_none(), "more values than parameters");
    model
}

/// Every parameter's values (gathers shards: all ranks must call it).
pub fn params<B: Backend, M: Module<Train<B>>>(model: &M) -> Vec<Vec<f32>> {
    struct Collect(Vec<Vec<f32>>);
    impl<AB: Backend> ModuleVisitor<AB> for Collect {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<AB, D>>) {
            let data = p.val().into_data().convert::<f32>();
            self.0
                .push(data.to_vec::<f32>().expect("f32 after convert"));
        }
    }
    let mut c = Collect(Vec::new());
    model.visit(&mut c);
    c.0
}

/// Trains `model`: under `strategy` over `group`, or as the single-device reference when
/// `group` is `None`.
///
/// # Errors
/// From [`shard`] (configuration, inconsistent models) and failed collectives.
///
/// # Panics
/// If the batch does not split evenly over the ranks and micro-batches.
pub fn train<B: Backend, M: ParityModel<B>>(
    model: M,
    group: Option<Arc<dyn ProcessGroup>>,
    strategy: Strategy,
    opts: Options,
    device: &B::Device,
) -> Result<Run, ShardError> {
    let (rank, world) = group
        .as_ref()
        .map_or((0, 1), |g| (g.rank(), g.world_size()));
    assert!(
        opts.global_batch.is_multiple_of(world * opts.accumulate),
        "a global batch of {} rows does not split over {world} ranks x {} micro-batches",
        opts.global_batch,
        opts.accumulate
    );
    let local = opts.global_batch / world;
    let width = model.input_width();
    let mut model = match &group {
        // Small buckets, so that a step flushes several of them.
        Some(g) => shard(
            model,
            g.clone(),
            ShardConfig::new(strategy)
                .with_bucket_bytes(600)
                .with_overlap(opts.overlap),
        )?,
        None => model,
    };
    let initial = params::<B, M>(&model);
    let traffic_before = crate::strategy::stats::comm_stats(&model).unwrap_or_default();
    let mut optim = ShardedOptimizer::<_, B>::new(
        AdamWConfig::new()
            .with_weight_decay(0.1)
            .init::<Train<B>, M>(),
    );
    let mut losses = Vec::new();
    let config = crate::StepConfig {
        accumulate: opts.accumulate,
        no_sync: opts.no_sync && group.is_some(),
        clip: opts.clip,
        remat_budget: opts.remat_budget,
        precision: opts.precision,
        loss_scale: None,
        dropout_seed: None,
    };
    for step in 0..opts.steps {
        let micro = local / opts.accumulate;
        let (stepped, stats) = crate::step(model, &mut optim, 1e-2, &config, |model, m| {
            let start = rank * local + m * micro;
            let (x, y) = data::<Train<B>>(width, start..start + micro, step, device);
            model.loss(x, y).div_scalar(opts.accumulate as f64)
        })?;
        model = stepped;
        let mut step_loss = stats.loss;
        if let Some(g) = &group {
            let mut v = [step_loss as f32];
            g.all_reduce((&mut v[..]).into(), ReduceOp::Avg)?;
            step_loss = f64::from(v[0]);
        }
        losses.push(step_loss);
    }
    let traffic = crate::strategy::stats::comm_stats(&model)
        .unwrap_or_default()
        .since(&traffic_before);
    let prefetch = crate::strategy::stats::prefetch_stats(&model).unwrap_or_default();
    let model = match &group {
        Some(_) => gather_model(model),
        None => model,
    };
    Ok(Run {
        losses,
        params: params::<B, M>(&model),
        initial,
        traffic,
        prefetch,
    })
}

/// `||a - b|| / ||b||`.
pub fn rel(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum();
    let den: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

/// Relative errors of a run against the reference.
#[derive(Debug, Clone, Copy, Default)]
pub struct Errors {
    /// Largest over the per-step losses.
    pub loss: f64,
    /// Of all final parameters as one vector (`||a - b|| / ||b||`, the fixtures' definition).
    pub params: f64,
    /// Largest over single parameter tensors (an 8-element bias whose gradient is near zero
    /// amplifies float32 reduction-order noise through Adam's normalisation, so this is
    /// reported, not asserted).
    pub tensor: f64,
}

impl Errors {
    /// Compares `run` with `reference`.
    ///
    /// # Panics
    /// If the runs have different numbers of parameters.
    pub fn of(run: &Run, reference: &Run) -> Errors {
        let loss = run
            .losses
            .iter()
            .zip(&reference.losses)
            .map(|(a, b)| ((a - b) / b.abs().max(1e-12)).abs())
            .fold(0.0, f64::max);
        assert_eq!(run.params.len(), reference.params.len(), "parameter count");
        let params = rel(&run.params.concat(), &reference.params.concat());
        let tensor = run
            .params
            .iter()
            .zip(&reference.params)
            .map(|(a, b)| rel(a, b))
            .fold(0.0, f64::max);
        Errors {
            loss,
            params,
            tensor,
        }
    }

    /// The asserted error: losses and parameters.
    pub fn worst(&self) -> f64 {
        self.loss.max(self.params)
    }
}
