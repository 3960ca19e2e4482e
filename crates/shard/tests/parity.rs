//! N-rank training equals single-device training with the global batch: DDP, ZeRO-1/2/3 and
//! hybrid, world sizes 1 to 4, on an MLP and on a transformer built from burn-nn modules (a
//! model kiln did not write), with global-norm clipping and 2-step gradient accumulation in
//! some cases. Ranks are threads with `LocalGroup`s; 3 ranks make every shard uneven.

use burn::backend::Flex;
use burn::module::Module;
use burn::nn::transformer::{
    TransformerEncoder, TransformerEncoderConfig, TransformerEncoderInput,
};
use burn::nn::{Linear, LinearConfig, Relu};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use kiln_comm::{LocalGroup, ProcessGroup, spawn_ranks};
use kiln_shard::check::{Errors, Mlp, Options, ParityModel, Train, params, train};
use kiln_shard::{ShardConfig, ShardTensor, Strategy, shard};
use std::sync::{Arc, Mutex};

type B = Train<Flex>;

const TOLERANCE: f64 = 1e-5;
const SEQ: usize = 3;
const D_MODEL: usize = 8;

#[derive(Module, Debug)]
struct Tiny<B: Backend> {
    encoder: TransformerEncoder<B>,
    head: Linear<B>,
}

impl ParityModel<Flex> for Tiny<B> {
    fn loss(&self, x: Tensor<B, 2>, y: Tensor<B, 2>) -> Tensor<B, 1> {
        let [batch, _] = x.dims();
        let x = x.reshape([batch, SEQ, D_MODEL]);
        let h = self.encoder.forward(TransformerEncoderInput::new(x));
        let out = self.head.forward(h.mean_dim(1).reshape([batch, D_MODEL]));
        (out - y).powf_scalar(2.0).mean()
    }
    fn input_width(&self) -> usize {
        SEQ * D_MODEL
    }
}

fn mlp() -> Mlp<B> {
    Mlp::new(&Default::default())
}

fn tiny() -> Tiny<B> {
    let device = Default::default();
    B::seed(&device, 2);
    let model = Tiny {
        encoder: TransformerEncoderConfig::new(D_MODEL, 12, 2, 2)
            .with_dropout(0.0)
            .init(&device),
        head: LinearConfig::new(D_MODEL, 5).init(&device),
    };
    // Parameters are initialised lazily, and every clone of an uninitialised one would draw
    // its own values: materialise them once, before ranks clone the model.
    params::<Flex, _>(&model);
    model
}

fn check<M: ParityModel<Flex>>(
    make: fn() -> M,
    strategies: &[Strategy],
    worlds: &[usize],
    opts: Options,
) {
    let device = Default::default();
    let initial = make();
    let reference = train(initial.clone(), None, Strategy::Ddp, opts, &device).unwrap();
    assert!(
        reference.losses[opts.steps - 1] < reference.losses[0],
        "the reference learns"
    );
    let initial = Mutex::new(initial);
    let mut largest = Errors::default();
    for &strategy in strategies {
        for &world in worlds {
            let runs = spawn_ranks(world, |g: LocalGroup| {
                let model = initial.lock().unwrap().clone();
                train(model, Some(Arc::new(g)), strategy, opts, &device).unwrap()
            });
            for (rank, run) in runs.iter().enumerate() {
                let e = Errors::of(run, &reference);
                largest.loss = largest.loss.max(e.loss);
                largest.params = largest.params.max(e.params);
                largest.tensor = largest.tensor.max(e.tensor);
                assert!(
                    e.worst() <= TOLERANCE,
                    "{strategy} world {world} rank {rank}: {e:?} > {TOLERANCE:e}\n\
                     losses {:?}\nreference {:?}",
                    run.losses,
                    reference.losses
                );
            }
        }
    }
    println!(
        "largest relative errors over {strategies:?} x world {worlds:?} ({opts:?}): {largest:?}"
    );
}

const ALL: [Strategy; 4] = [
    Strategy::Ddp,
    Strategy::Zero1,
    Strategy::Zero2,
    Strategy::Zero3,
];
const CLIP_ACC: Options = Options {
    global_batch: 24,
    steps: 20,
    clip: Some(0.05),
    accumulate: 2,
    no_sync: false,
    overlap: true,
    remat_budget: None,
    precision: kiln_shard::Precision::F32,
};

/// Rematerialisation under a small budget (8 KiB: most activations given up and recomputed
/// in backward, parameters gathered again under ZeRO-3) with clipping and accumulation, every
/// strategy: N ranks still equal one device.
#[test]
fn a_transformer_with_remat_under_a_budget_every_strategy() {
    let opts = Options {
        remat_budget: Some(8 << 10),
        steps: 6,
        ..CLIP_ACC
    };
    check(tiny, &ALL, &[2, 3], opts);
}

#[test]
fn mlp_every_strategy_world_1_to_4() {
    check(mlp, &ALL, &[1, 2, 3, 4], Options::default());
}

#[test]
fn mlp_hybrid() {
    check(
        mlp,
        &[Strategy::Hybrid { shard_size: 2 }],
        &[2, 4],
        Options::default(),
    );
}

#[test]
fn mlp_with_clipping_and_accumulation() {
    check(mlp, &ALL, &[2, 3], CLIP_ACC);
}

#[test]
fn transformer_every_strategy_world_1_to_4() {
    check(tiny, &ALL, &[1, 2, 3, 4], Options::default());
}

#[test]
fn transformer_hybrid_and_zero3_with_clipping_and_accumulation() {
    check(
        tiny,
        &[Strategy::Hybrid { shard_size: 2 }, Strategy::Zero3],
        &[4],
        CLIP_ACC,
    );
}

/// Communication on the queue's thread (buckets reduced during backward, ZeRO-3 gathers
/// prefetched) computes exactly what blocking collectives compute, and after the first step
/// the parameters' gathers are prefetched.
#[test]
fn overlap_and_prefetch_change_nothing_but_timing() {
    let device = Default::default();
    let initial = Mutex::new(tiny());
    for strategy in [
        Strategy::Ddp,
        Strategy::Zero2,
        Strategy::Zero3,
        Strategy::Hybrid { shard_size: 2 },
    ] {
        let run = |overlap: bool| {
            spawn_ranks(4, |g: LocalGroup| {
                let model = initial.lock().unwrap().clone();
                let opts = Options {
                    overlap,
                    steps: 4,
                    ..CLIP_ACC
                };
                train(model, Some(Arc::new(g)), strategy, opts, &device).unwrap()
            })
        };
        let (blocking, overlapped) = (run(false), run(true));
        for (rank, (b, o)) in blocking.iter().zip(&overlapped).enumerate() {
            assert_eq!(b.losses, o.losses, "{strategy} rank {rank}");
            assert_eq!(b.params, o.params, "{strategy} rank {rank}");
            // Prefetches that the next step does not use (the first step's order includes
            // reading the initial weights) are sent for nothing: a few gathers; and the
            // prefetches issued when the last step ends are counted if they ran before the
            // counters were read (timing): up to one more forward's gathers.
            let (bt, ot) = (b.traffic.total_sent(), o.traffic.total_sent());
            if strategy.shards_params() {
                if rank == 0 {
                    println!(
                        "{strategy}: {:?}, {ot} B sent vs {bt} B blocking",
                        o.prefetch
                    );
                }
                assert!(bt <= ot && ot * 4 <= bt * 5, "{strategy}: {ot} B vs {bt} B");
            } else {
                assert_eq!(bt, ot, "{strategy}");
            }
            assert_eq!(
                b.prefetch.gathers, 0,
                "{strategy}: blocking runs use no queue"
            );
            if strategy.shards_params() {
                // 4 steps x 2 micro-batches; the first step records the order.
                let p = o.prefetch;
                assert!(
                    p.gathers > 0 && p.prefetched * 8 >= p.gathers * 5,
                    "{strategy} rank {rank}: {p:?}"
                );
            }
        }
    }
}

/// A prefetch serves only the value it was gathered from: a copy of a ZeRO-3 model kept from
/// before a step still reads its own weights after the step (when the next step's first
/// gathers, of the new weights, are already in flight).
#[test]
fn a_copy_from_before_a_step_is_not_served_newer_prefetched_weights() {
    use burn::optim::AdamWConfig;
    use kiln_shard::check::data;
    use kiln_shard::{ShardedOptimizer, StepConfig, step};
    let initial = Mutex::new(mlp());
    spawn_ranks(2, |g: LocalGroup| {
        let rank = g.rank();
        let model = initial.lock().unwrap().clone();
        let mut model = shard(model, Arc::new(g), ShardConfig::new(Strategy::Zero3)).unwrap();
        let mut optim = ShardedOptimizer::<_, Flex>::new(AdamWConfig::new().init());
        let width = model.input_width();
        let mut kept = None;
        for i in 0..3 {
            if i == 2 {
                kept = Some((model.clone(), params::<Flex, _>(&model)));
            }
            let (x, y) = data::<B>(width, rank * 4..rank * 4 + 4, i, &Default::default());
            let (stepped, _) = step(model, &mut optim, 1e-2, &StepConfig::default(), |m, _| {
                m.loss(x.clone(), y.clone())
            })
            .expect("a step");
            model = stepped;
        }
        let (kept, values) = kept.unwrap();
        assert_eq!(params::<Flex, _>(&kept), values, "rank {rank}");
        assert_ne!(
            params::<Flex, _>(&model),
            values,
            "rank {rank}: the model trained"
        );
    });
}

#[test]
fn zero3_holds_only_shards() {
    let initial = Mutex::new(mlp());
    let total: usize = params::<Flex, _>(&*initial.lock().unwrap())
        .iter()
        .map(Vec::len)
        .sum();
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
    // 4 tensors, each split with at most one extra element per rank.
    assert!(
        held.iter().all(|&h| h <= total / 3 + 4),
        "{held:?} of {total}"
    );
}

#[test]
fn ranks_with_different_models_are_reported() {
    let errors = spawn_ranks(2, |g: LocalGroup| {
        let device = Default::default();
        let width = if g.rank() == 0 { 4 } else { 5 };
        let model = (LinearConfig::new(width, 3).init::<B>(&device), Relu::new());
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

#[test]
fn reading_a_shard_on_one_rank_alone_is_an_error_not_a_hang() {
    let options =
        kiln_comm::GroupOptions::default().with_timeout(std::time::Duration::from_millis(300));
    let initial = Mutex::new(mlp());
    let start = std::time::Instant::now();
    let outcome = std::panic::catch_unwind(|| {
        kiln_comm::spawn_ranks_with(2, options, |g: LocalGroup| {
            let rank = g.rank();
            let model = initial.lock().unwrap().clone();
            let model = shard(model, Arc::new(g), ShardConfig::new(Strategy::Zero3)).unwrap();
            if rank == 0 {
                // "Validation on rank 0": reading a sharded weight is a collective.
                let _ = params::<Flex, _>(&model);
            } else {
                std::thread::sleep(std::time::Duration::from_millis(1000));
            }
        })
    });
    let msg = *outcome.unwrap_err().downcast::<String>().unwrap();
    assert!(msg.contains("rank 0 panicked"), "{msg}");
    assert!(
        msg.contains("could not all-gather a tensor of shape"),
        "{msg}"
    );
    assert!(msg.contains("timed out"), "{msg}");
    assert!(start.elapsed() < std::time::Duration::from_secs(10));
}

/// Loading a record replaces the parameters (and gives them the record's ids): the load mapper
/// `shard` installs keeps their gradient-sync marks, so training goes on with every gradient
/// reduced, and equals a model that was never reloaded.
#[test]
fn loading_a_record_keeps_the_gradient_sync_marks() {
    use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
    use kiln_shard::ShardedOptimizer;
    for strategy in [Strategy::Ddp, Strategy::Zero3] {
        let results = spawn_ranks(2, |g: LocalGroup| {
            let device = Default::default();
            // Each rank builds its own copies (`Mlp::new` is deterministic): ranks that
            // shared autodiff tensors would share burn-autodiff graphs across threads,
            // whose locks burn 0.21 takes in opposite orders in `register` and `backward`
            // (a deadlock that hung CI once).
            // Ranks train on different rows: unreduced gradients would make them diverge.
            let rows = g.rank() * 4..(g.rank() + 1) * 4;
            let model = shard(mlp(), Arc::new(g), ShardConfig::new(strategy)).unwrap();
            let model = model.load_record(mlp().into_record());
            let (x, y) = kiln_shard::check::data::<B>(7, rows, 0, &device);
            let grads = GradientsParams::from_grads(model.loss(x, y).backward(), &model);
            let mut optim =
                ShardedOptimizer::<_, Flex>::new(AdamWConfig::new().init::<B, Mlp<B>>());
            let model = optim.step(1e-2, model, grads);
            params::<Flex, _>(&model)
        });
        assert_eq!(
            results[0], results[1],
            "{strategy}: ranks diverged after loading"
        );
    }
}

/// Gradients computed under `no_sync` and stepped without `reduce_gradients` were never reduced:
/// the optimizer refuses them, naming the fix.
#[test]
fn unreduced_gradients_are_an_error() {
    use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
    use kiln_shard::ShardedOptimizer;
    let run = |reduce: bool| {
        std::panic::catch_unwind(|| {
            spawn_ranks(2, |g: LocalGroup| {
                let device = Default::default();
                let model = shard(mlp(), Arc::new(g), ShardConfig::new(Strategy::Ddp)).unwrap();
                let (x, y) = kiln_shard::check::data::<B>(7, 0..4, 0, &device);
                let mut grads = kiln_shard::no_sync(&model, || {
                    GradientsParams::from_grads(model.loss(x, y).backward(), &model)
                });
                if reduce {
                    grads = kiln_shard::reduce_gradients(&model, grads);
                }
                let mut optim =
                    ShardedOptimizer::<_, Flex>::new(AdamWConfig::new().init::<B, Mlp<B>>());
                optim.step(1e-3, model, grads);
            })
        })
    };
    let msg = *run(false).unwrap_err().downcast::<String>().unwrap();
    assert!(msg.contains("were never reduced across ranks"), "{msg}");
    assert!(msg.contains("kiln_shard::reduce_gradients"), "{msg}");
    assert!(run(true).is_ok());
}

/// A thread that sharded a model at world size 1 (zero-bench's baseline does) can then train an
/// unsharded one: over one rank there is nothing to reduce, so the optimizer's check passes.
#[test]
fn an_unsharded_model_trains_after_a_world_1_shard_on_the_same_thread() {
    let device = Default::default();
    let group = LocalGroup::new_world(1, Default::default())
        .pop()
        .expect("one rank");
    let sharded = shard(mlp(), Arc::new(group), ShardConfig::new(Strategy::Zero3)).unwrap();
    drop(sharded);
    let run = train(mlp(), None, Strategy::Ddp, Options::default(), &device).unwrap();
    assert!(run.losses[run.losses.len() - 1] < run.losses[0]);
}

/// A model initialised by Burn's own random initialisers, with no seed and no kiln init, draws
/// different weights on every rank; `shard` makes them rank 0's, so N-rank training equals one
/// device that starts from rank 0's weights. Lazily initialised (ZeRO-3 creates the shards from
/// a shared seed) and initialised before `shard` (rank 0 broadcasts, or scatters shards).
#[test]
fn burn_initialised_models_train_like_one_device_from_rank_0_weights() {
    let device = Default::default();
    let cases = [
        (Strategy::Ddp, 2),
        (Strategy::Zero1, 3),
        (Strategy::Zero2, 2),
        (Strategy::Zero3, 4),
        (Strategy::Zero3, 3),
        (Strategy::Hybrid { shard_size: 2 }, 4),
    ];
    let mut worst = 0.0f64;
    for (strategy, world) in cases {
        for materialise in [false, true] {
            let runs = spawn_ranks(world, |g: LocalGroup| {
                let model = Mlp::<B>::random(&Default::default());
                if materialise {
                    params::<Flex, _>(&model);
                }
                train(
                    model,
                    Some(Arc::new(g)),
                    strategy,
                    Options::default(),
                    &device,
                )
                .unwrap()
            });
            // Every rank saw the same (rank 0's) initial weights, whole.
            for r in &runs[1..] {
                assert_eq!(
                    r.initial, runs[0].initial,
                    "{strategy} x{world}: initial weights"
                );
            }
            let reference =
                kiln_shard::check::with_values(Mlp::<B>::random(&device), &runs[0].initial);
            let reference = train(reference, None, strategy, Options::default(), &device).unwrap();
            let e = Errors::of(&runs[0], &reference);
            worst = worst.max(e.worst());
            assert!(
                e.worst() < TOLERANCE,
                "{strategy} x{world} (materialised before shard: {materialise}): {e:?}"
            );
        }
    }
    println!("Burn-initialised MLP, every strategy, 2-4 ranks: worst error {worst:.3e}");
}

/// `no_sync` over 4 micro-batches reduces once per step: exactly 1/4 of the gradient traffic
/// of reducing every micro-batch, with the same training result.
#[test]
fn no_sync_sends_a_quarter_of_the_traffic_with_the_same_result() {
    use kiln_comm::OpKind;
    let device = Default::default();
    for strategy in [Strategy::Ddp, Strategy::Zero2] {
        let run = |no_sync: bool| {
            spawn_ranks(2, |g: LocalGroup| {
                let group: Arc<dyn ProcessGroup> = Arc::new(g);
                let opts = Options {
                    accumulate: 4,
                    steps: 5,
                    no_sync,
                    ..Options::default()
                };
                let kind = if strategy == Strategy::Ddp {
                    OpKind::AllReduce
                } else {
                    OpKind::ReduceScatter
                };
                // The harness all-reduces one f32 (the step's loss) per step: measured here,
                // to be subtracted from DDP's all-reduce traffic.
                let before = group.stats();
                group
                    .all_reduce((&mut [0f32][..]).into(), kiln_comm::ReduceOp::Avg)
                    .unwrap();
                let loss_bytes = group
                    .stats()
                    .since(&before)
                    .get(OpKind::AllReduce)
                    .bytes_sent;
                let loss_bytes = if strategy == Strategy::Ddp {
                    loss_bytes
                } else {
                    0
                };
                let run = train(mlp(), Some(group.clone()), strategy, opts, &device).unwrap();
                let sent = run.traffic.get(kind).bytes_sent;
                (run, sent - opts.steps as u64 * loss_bytes)
            })
        };
        let (synced, every) = run(false).swap_remove(0);
        let (deferred, once) = run(true).swap_remove(0);
        assert!(once > 0);
        assert_eq!(
            every,
            4 * once,
            "{strategy}: {every} B reducing every micro-batch vs {once} B with no_sync"
        );
        let e = Errors::of(&deferred, &synced);
        assert!(e.worst() < TOLERANCE, "{strategy}: {e:?}");
        println!(
            "{strategy}: gradient traffic {every} B every micro-batch, {once} B with no_sync; \
             error {:.3e}",
            e.worst()
        );
    }
}
