//! N-rank training equals single-device training with the global batch: DDP, ZeRO-1/2/3 and
//! hybrid, world sizes 1 to 4, on an MLP and on a transformer built from burn-nn modules.
//!
//! The reference runs the same model, data and optimizer on one rank with no sharding (the
//! decorator then only forwards). Ranks are threads with `LocalGroup`s; the global batch of 12
//! rows is split evenly (3 ranks make parameter shards uneven).

use burn::backend::{Autodiff, Flex};
use burn::module::{AutodiffModule, Module};
use burn::nn::transformer::{
    TransformerEncoder, TransformerEncoderConfig, TransformerEncoderInput,
};
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{AdamWConfig, GradientsAccumulator, Optimizer};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use kiln_comm::{LocalGroup, ProcessGroup, ReduceOp, spawn_ranks};
use kiln_shard::{
    Shard, ShardConfig, ShardTensor, ShardedOptimizer, Strategy, clip_grad_norm, gather_model,
    shard,
};
use std::sync::{Arc, Mutex};

type B = Autodiff<Shard<Flex>>;

const GLOBAL_BATCH: usize = 24;
const STEPS: usize = 20;
const TOLERANCE: f64 = 1e-5;

#[derive(Module, Debug)]
struct Mlp<B: Backend> {
    a: Linear<B>,
    b: Linear<B>,
    act: Relu,
}

#[derive(Module, Debug)]
struct Tiny<B: Backend> {
    encoder: TransformerEncoder<B>,
    head: Linear<B>,
}

trait Net: AutodiffModule<B> + Clone + Send + 'static {
    fn loss(&self, x: Tensor<B, 2>, y: Tensor<B, 2>) -> Tensor<B, 1>;
    fn input_width() -> usize;
}

impl Net for Mlp<B> {
    fn loss(&self, x: Tensor<B, 2>, y: Tensor<B, 2>) -> Tensor<B, 1> {
        let out = self.b.forward(self.act.forward(self.a.forward(x)));
        (out - y).powf_scalar(2.0).mean()
    }
    fn input_width() -> usize {
        7
    }
}

const SEQ: usize = 3;
const D_MODEL: usize = 8;

impl Net for Tiny<B> {
    fn loss(&self, x: Tensor<B, 2>, y: Tensor<B, 2>) -> Tensor<B, 1> {
        let [batch, _] = x.dims();
        let x = x.reshape([batch, SEQ, D_MODEL]);
        let h = self.encoder.forward(TransformerEncoderInput::new(x));
        let out = self.head.forward(h.mean_dim(1).reshape([batch, D_MODEL]));
        (out - y).powf_scalar(2.0).mean()
    }
    fn input_width() -> usize {
        SEQ * D_MODEL
    }
}

fn mlp() -> Mlp<B> {
    let device = Default::default();
    B::seed(&device, 1);
    Mlp {
        // Output sizes 13 and 5 do not divide by 2, 3 or 4.
        a: LinearConfig::new(7, 13).init(&device),
        b: LinearConfig::new(13, 5).init(&device),
        act: Relu::new(),
    }
}

fn tiny() -> Tiny<B> {
    let device = Default::default();
    B::seed(&device, 2);
    Tiny {
        encoder: TransformerEncoderConfig::new(D_MODEL, 12, 2, 2)
            .with_dropout(0.0)
            .init(&device),
        head: LinearConfig::new(D_MODEL, 5).init(&device),
    }
}

/// Deterministic data: row `i` of the global batch.
fn data(width: usize, rows: std::ops::Range<usize>, step: usize) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let device = Default::default();
    let n = rows.len();
    let x: Vec<f32> = rows
        .clone()
        .flat_map(|i| {
            (0..width).map(move |j| (((i * 31 + j * 7 + step * 13) % 17) as f32 / 8.0) - 1.0)
        })
        .collect();
    let y: Vec<f32> = rows
        .flat_map(|i| (0..5).map(move |j| (((i * 5 + j * 11 + step * 3) % 7) as f32 / 3.0) - 1.0))
        .collect();
    (
        Tensor::from_data(TensorData::new(x, [n, width]), &device),
        Tensor::from_data(TensorData::new(y, [n, 5]), &device),
    )
}

#[derive(Clone, Copy, Debug)]
struct Options {
    clip: Option<f64>,
    accumulate: usize,
}

struct Run {
    losses: Vec<f64>,
    params: Vec<Vec<f32>>,
}

fn params<M: Module<B>>(model: &M) -> Vec<Vec<f32>> {
    struct Collect(Vec<Vec<f32>>);
    impl burn::module::ModuleVisitor<B> for Collect {
        fn visit_float<const D: usize>(&mut self, p: &burn::module::Param<Tensor<B, D>>) {
            self.0.push(p.val().into_data().to_vec::<f32>().unwrap());
        }
    }
    let mut c = Collect(Vec::new());
    model.visit(&mut c);
    c.0
}

/// One rank's training: `group` is `None` for the single-device reference.
fn train<M: Net>(
    model: M,
    group: Option<Arc<dyn ProcessGroup>>,
    strategy: Strategy,
    opts: Options,
) -> Run {
    let (rank, world) = group
        .as_ref()
        .map_or((0, 1), |g| (g.rank(), g.world_size()));
    let local = GLOBAL_BATCH / world;
    let mut model = match &group {
        Some(g) => shard(
            model,
            g.clone(),
            ShardConfig::new(strategy).with_bucket_bytes(600),
        )
        .unwrap(),
        None => model,
    };
    let adamw = AdamWConfig::new().with_weight_decay(0.1).init::<B, M>();
    let mut optim = ShardedOptimizer::<_, Flex>::new(adamw);
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let mut acc = GradientsAccumulator::<M>::new();
        let mut step_loss = 0.0;
        let micro = local / opts.accumulate;
        for m in 0..opts.accumulate {
            let start = rank * local + m * micro;
            let (x, y) = data(M::input_width(), start..start + micro, step);
            let loss = model.loss(x, y).div_scalar(opts.accumulate as f64);
            step_loss += loss.clone().into_scalar() as f64;
            let grads = kiln_shard::backward(loss, &model);
            acc.accumulate(&model, grads);
        }
        let mut grads = acc.grads();
        if let Some(max) = opts.clip {
            grads = clip_grad_norm(&model, grads, max).0;
        }
        if let Some(g) = &group {
            let mut v = [step_loss as f32];
            g.all_reduce((&mut v[..]).into(), ReduceOp::Avg).unwrap();
            step_loss = v[0] as f64;
        }
        losses.push(step_loss);
        model = optim.step(1e-2, model, grads);
    }
    let model = match &group {
        Some(_) => gather_model(model),
        None => model,
    };
    Run {
        losses,
        params: params(&model),
    }
}

fn rel(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

/// Relative errors of `run` against `reference`: (largest over the per-step losses, of all
/// final parameters as one vector (||a - b|| / ||b||, the fixtures' definition), largest over
/// single parameter tensors (reported, not asserted: an 8-element bias whose gradient is near
/// zero amplifies float32 reduction-order noise through Adam's normalisation)).
fn errors(run: &Run, reference: &Run) -> (f64, f64, f64) {
    let loss = run
        .losses
        .iter()
        .zip(&reference.losses)
        .map(|(a, b)| ((a - b) / b.abs().max(1e-12)).abs())
        .fold(0.0, f64::max);
    assert_eq!(run.params.len(), reference.params.len());
    let all = |r: &Run| r.params.concat();
    let params = rel(&all(run), &all(reference));
    let tensor = run
        .params
        .iter()
        .zip(&reference.params)
        .map(|(a, b)| rel(a, b))
        .fold(0.0, f64::max);
    (loss, params, tensor)
}

fn check<M: Net>(make: fn() -> M, strategies: &[Strategy], worlds: &[usize], opts: Options) {
    let initial = make();
    // Parameters are initialised lazily, and every clone of an uninitialised one would draw
    // its own values: materialise them once.
    params(&initial);
    let reference = train(initial.clone(), None, Strategy::Ddp, opts);
    assert!(
        reference.losses[STEPS - 1] < reference.losses[0],
        "the reference learns"
    );
    let initial = Mutex::new(initial);
    let (mut largest, mut largest_tensor) = (0.0f64, 0.0f64);
    for &strategy in strategies {
        for &world in worlds {
            if let Strategy::Hybrid { shard_size } = strategy
                && world % shard_size != 0
            {
                continue;
            }
            let runs = spawn_ranks(world, |g: LocalGroup| {
                let model = initial.lock().unwrap().clone();
                let g: Arc<dyn ProcessGroup> = Arc::new(g);
                train(model, Some(g), strategy, opts)
            });
            for (rank, run) in runs.iter().enumerate() {
                let (loss_err, param_err, tensor_err) = errors(run, &reference);
                let err = loss_err.max(param_err);
                largest_tensor = largest_tensor.max(tensor_err);
                if std::env::var("KILN_PARITY_DEBUG").is_ok() {
                    for (i, (a, b)) in run.params.iter().zip(&reference.params).enumerate() {
                        let norm = b.iter().map(|x| x * x).sum::<f32>().sqrt();
                        println!("{strategy} w{world} r{rank} param {i} ({} elems, norm {norm:.3e}): {:.3e}", b.len(), rel(a, b));
                    }
                }
                largest = largest.max(err);
                assert!(
                    err <= TOLERANCE,
                    "{strategy} world {world} rank {rank}: relative error {err:.3e} > {TOLERANCE:e}\n\
                     losses {:?}\nreference {:?}",
                    run.losses,
                    reference.losses
                );
            }
        }
    }
    println!(
        "largest relative error over {strategies:?} x world {worlds:?} ({opts:?}): {largest:.3e} \
         (losses, all parameters); largest on one tensor: {largest_tensor:.3e}"
    );
}

const ALL: [Strategy; 4] = [
    Strategy::Ddp,
    Strategy::Zero1,
    Strategy::Zero2,
    Strategy::Zero3,
];
const PLAIN: Options = Options {
    clip: None,
    accumulate: 1,
};

#[test]
fn mlp_every_strategy_world_1_to_4() {
    check(mlp, &ALL, &[1, 2, 3, 4], PLAIN);
}

#[test]
fn mlp_hybrid() {
    check(mlp, &[Strategy::Hybrid { shard_size: 2 }], &[2, 4], PLAIN);
}

#[test]
fn mlp_with_clipping_and_accumulation() {
    let opts = Options {
        clip: Some(0.05),
        accumulate: 2,
    };
    check(mlp, &ALL, &[2, 3], opts);
}

#[test]
fn transformer_every_strategy_world_1_to_4() {
    check(tiny, &ALL, &[1, 2, 3, 4], PLAIN);
}

#[test]
fn transformer_hybrid_with_clipping() {
    let opts = Options {
        clip: Some(0.05),
        accumulate: 2,
    };
    check(
        tiny,
        &[Strategy::Hybrid { shard_size: 2 }, Strategy::Zero3],
        &[4],
        opts,
    );
}

#[test]
fn zero3_holds_only_shards() {
    let initial = mlp();
    params(&initial);
    let initial = Mutex::new(initial);
    let total: usize = params(&*initial.lock().unwrap()).iter().map(Vec::len).sum();
    let held = spawn_ranks(3, |g: LocalGroup| {
        let model = initial.lock().unwrap().clone();
        let model = shard(model, Arc::new(g), ShardConfig::new(Strategy::Zero3)).unwrap();
        struct Count(usize, bool);
        impl burn::module::ModuleVisitor<B> for Count {
            fn visit_float<const D: usize>(&mut self, p: &burn::module::Param<Tensor<B, D>>) {
                let prim = p.val().inner().into_primitive().tensor();
                self.1 &= prim.is_sharded();
                if let ShardTensor::Sharded(s) = &prim {
                    self.0 += burn::tensor::TensorMetadata::shape(&s.shard).num_elements();
                }
            }
        }
        let mut c = Count(0, true);
        model.visit(&mut c);
        assert!(c.1, "every parameter is a shard");
        c.0
    });
    assert_eq!(held.iter().sum::<usize>(), total);
    assert!(
        held.iter().all(|&h| h <= total.div_ceil(3) + 4),
        "{held:?} of {total}"
    );
}

#[test]
fn ranks_with_different_models_are_reported() {
    let errors = spawn_ranks(2, |g: LocalGroup| {
        let device = Default::default();
        let width = if g.rank() == 0 { 4 } else { 5 };
        let model = Mlp::<B> {
            a: LinearConfig::new(width, 3).init(&device),
            b: LinearConfig::new(3, 2).init(&device),
            act: Relu::new(),
        };
        shard(model, Arc::new(g), ShardConfig::new(Strategy::Zero3))
            .unwrap_err()
            .to_string()
    });
    assert!(
        errors[0].contains("ranks disagree about the model"),
        "{}",
        errors[0]
    );
}

#[test]
fn a_bad_hybrid_size_is_named() {
    let errors = spawn_ranks(3, |g: LocalGroup| {
        shard(
            mlp(),
            Arc::new(g),
            ShardConfig::new(Strategy::Hybrid { shard_size: 2 }),
        )
        .unwrap_err()
        .to_string()
    });
    assert!(
        errors[0].contains("hybrid shard size 2 does not divide the world size 3"),
        "{}",
        errors[0]
    );
}

