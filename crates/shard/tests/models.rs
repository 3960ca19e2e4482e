//! Sharding state belongs to each sharded model, not to the thread: a frozen teacher and a
//! student sharded side by side on one thread, a sharded model moved to another thread, an EMA
//! copy of a sharded model, each trained like one device.

use burn::backend::Flex;
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::{ElementConversion, Tensor};
use kiln_comm::{LocalGroup, ProcessGroup, ReduceOp, spawn_ranks};
use kiln_shard::check::{Errors, Mlp, ParityModel, Run, Train, data, params, with_values};
use kiln_shard::{ShardConfig, ShardedOptimizer, Strategy, shard};
use std::sync::Arc;

type B = Train<Flex>;

const TOLERANCE: f64 = 1e-5;
const STEPS: usize = 10;
const ROWS: usize = 8;

fn optim() -> impl Optimizer<Mlp<B>, B> {
    ShardedOptimizer::<_, Flex>::new(AdamWConfig::new().init::<B, Mlp<B>>())
}

/// The mean of `v` over the group (identity without one).
fn global(group: Option<&Arc<dyn ProcessGroup>>, v: f64) -> f64 {
    match group {
        Some(g) => {
            let mut x = [v as f32];
            g.all_reduce((&mut x[..]).into(), ReduceOp::Avg).unwrap();
            f64::from(x[0])
        }
        None => v,
    }
}

/// This rank's rows of a step's batch.
fn rows(group: Option<&Arc<dyn ProcessGroup>>) -> std::ops::Range<usize> {
    let (rank, world) = group.map_or((0, 1), |g| (g.rank(), g.world_size()));
    let n = ROWS / world;
    rank * n..(rank + 1) * n
}

/// Distillation: the student learns the frozen teacher's outputs (mean squared error).
fn distill(student: Mlp<B>, teacher: &Mlp<B>, group: Option<Arc<dyn ProcessGroup>>) -> Run {
    let device = Default::default();
    let mut student = student;
    let initial = params::<Flex, _>(&student);
    let mut optim = optim();
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let (x, _) = data::<B>(7, rows(group.as_ref()), step, &device);
        let target = teacher.forward(x.clone()).detach();
        let loss = (student.forward(x) - target).powf_scalar(2.0).mean();
        losses.push(global(group.as_ref(), loss.clone().into_scalar().elem()));
        let grads = GradientsParams::from_grads(loss.backward(), &student);
        student = optim.step(1e-2, student, grads);
    }
    Run {
        losses,
        params: params::<Flex, _>(&student),
        initial,
        traffic: Default::default(),
        prefetch: Default::default(),
    }
}

#[test]
fn a_frozen_teacher_and_a_student_sharded_on_one_thread() {
    for strategy in [Strategy::Zero3, Strategy::Ddp] {
        let runs = spawn_ranks(2, |g: LocalGroup| {
            let device = Default::default();
            let group: Arc<dyn ProcessGroup> = Arc::new(g);
            let config = ShardConfig::new(strategy);
            let teacher = shard(
                Mlp::<B>::random(&device).no_grad(),
                group.clone(),
                config.clone(),
            )
            .unwrap();
            let student = shard(Mlp::<B>::random(&device), group.clone(), config).unwrap();
            let teacher_weights = params::<Flex, _>(&teacher);
            (distill(student, &teacher, Some(group)), teacher_weights)
        });
        let (run, teacher_weights) = &runs[0];
        let device = Default::default();
        let teacher = with_values(Mlp::<B>::random(&device), teacher_weights).no_grad();
        let student = with_values(Mlp::<B>::random(&device), &run.initial);
        let reference = distill(student, &teacher, None);
        let e = Errors::of(run, &reference);
        assert!(e.worst() < TOLERANCE, "{strategy}: {e:?}");
        assert!(
            run.losses[STEPS - 1] < run.losses[0],
            "{strategy}: {:?}",
            run.losses
        );
    }
}

/// Trains `model` on its rank's rows of the harness's data.
fn fit(mut model: Mlp<B>, group: &Arc<dyn ProcessGroup>, steps: std::ops::Range<usize>) -> Mlp<B> {
    let device = Default::default();
    let mut optim = optim();
    for step in steps {
        let (x, y) = data::<B>(7, rows(Some(group)), step, &device);
        let grads = GradientsParams::from_grads(model.loss(x, y).backward(), &model);
        model = optim.step(1e-2, model, grads);
    }
    model
}

#[test]
fn a_sharded_model_moves_to_another_thread() {
    let runs = spawn_ranks(2, |g: LocalGroup| {
        let group: Arc<dyn ProcessGroup> = Arc::new(g);
        let model = shard(
            Mlp::<B>::new(&Default::default()),
            group.clone(),
            ShardConfig::new(Strategy::Zero3),
        )
        .unwrap();
        // Three steps here, then the model (and its optimizer's job) on a new thread.
        let model = fit(model, &group, 0..3);
        std::thread::scope(|s| {
            s.spawn(|| {
                let model = fit(model, &group, 3..STEPS);
                params::<Flex, _>(&model)
            })
            .join()
            .expect("the moved model trains")
        })
    });
    // Reference: one device, unsharded, the whole batch, the same two optimizers (a fresh
    // AdamW at step 3, as on the ranks).
    let reference = spawn_ranks(1, |g: LocalGroup| {
        let group: Arc<dyn ProcessGroup> = Arc::new(g);
        let model = fit(Mlp::<B>::new(&Default::default()), &group, 0..3);
        let model = fit(model, &group, 3..STEPS);
        params::<Flex, _>(&model)
    });
    let err = kiln_shard::check::rel(&runs[0].concat(), &reference[0].concat());
    assert!(err < TOLERANCE, "moved model vs one device: {err:.3e}");
}

/// An exponential moving average of a sharded model, kept as a second (frozen) copy: under
/// ZeRO-3 both are shards of the same layout, so the update is shard-local.
fn ema_update(ema: Mlp<B>, model: &Mlp<B>, decay: f64) -> Mlp<B> {
    // Walk both models in module order: values of `model` are read through a visitor.
    struct Values(Vec<burn::tensor::TensorPrimitive<B>>);
    impl ModuleVisitor<B> for Values {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
            self.0.push(p.val().detach().into_primitive());
        }
    }
    let mut values = Values(Vec::new());
    model.visit(&mut values);
    struct Blend(std::vec::IntoIter<burn::tensor::TensorPrimitive<B>>, f64);
    impl ModuleMapper<B> for Blend {
        fn map_float<const D: usize>(&mut self, p: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let (id, t, mapper) = p.consume();
            let new = Tensor::<B, D>::from_primitive(self.0.next().expect("same modules"));
            let t = t.mul_scalar(self.1) + new.mul_scalar(1.0 - self.1);
            Param::from_mapped_value(id, t.detach(), mapper)
        }
    }
    ema.map(&mut Blend(values.0.into_iter(), decay))
}

#[test]
fn an_ema_copy_of_a_zero3_model() {
    let run = |group: Option<Arc<dyn ProcessGroup>>| {
        let device = Default::default();
        let mut model = Mlp::<B>::new(&device);
        if let Some(g) = &group {
            model = shard(model, g.clone(), ShardConfig::new(Strategy::Zero3)).unwrap();
        }
        let mut ema = model.clone().no_grad();
        let mut optim = optim();
        for step in 0..STEPS {
            let (x, y) = data::<B>(7, rows(group.as_ref()), step, &device);
            let grads = GradientsParams::from_grads(model.loss(x, y).backward(), &model);
            model = optim.step(1e-2, model, grads);
            ema = ema_update(ema, &model, 0.9);
        }
        (params::<Flex, _>(&model), params::<Flex, _>(&ema))
    };
    let sharded = spawn_ranks(2, |g: LocalGroup| run(Some(Arc::new(g))));
    let (model, ema) = run(None);
    let (s_model, s_ema) = &sharded[0];
    let model_err = kiln_shard::check::rel(&s_model.concat(), &model.concat());
    let ema_err = kiln_shard::check::rel(&s_ema.concat(), &ema.concat());
    assert!(
        model_err < TOLERANCE && ema_err < TOLERANCE,
        "model {model_err:.3e}, EMA {ema_err:.3e}"
    );
    assert!(
        kiln_shard::check::rel(&ema.concat(), &model.concat()) > 1e-3,
        "the EMA lags the model"
    );
}

/// Buffers too: int and bool parameters (and frozen float ones) become rank 0's.
#[derive(Module, Debug)]
struct Buffers<B: burn::tensor::backend::Backend> {
    weight: Param<Tensor<B, 2>>,
    frozen: Param<Tensor<B, 1>>,
    counts: Param<Tensor<B, 1, burn::tensor::Int>>,
    mask: Param<Tensor<B, 2, burn::tensor::Bool>>,
}

#[test]
fn buffers_become_rank_0_s() {
    use burn::tensor::TensorData;
    for strategy in [Strategy::Ddp, Strategy::Zero3] {
        let seen = spawn_ranks(3, |g: LocalGroup| {
            let device = Default::default();
            let r = g.rank();
            let m = Buffers::<B> {
                weight: Param::from_tensor(Tensor::from_data(
                    TensorData::new(vec![r as f32; 6], [2, 3]),
                    &device,
                )),
                frozen: Param::from_tensor(Tensor::from_data([r as f32 + 0.5; 4], &device))
                    .set_require_grad(false),
                counts: Param::initialized(
                    burn::module::ParamId::new(),
                    Tensor::<B, 1, burn::tensor::Int>::from_data(
                        [r as i64, 7, r as i64 * 3],
                        &device,
                    ),
                ),
                mask: Param::initialized(
                    burn::module::ParamId::new(),
                    Tensor::<B, 2, burn::tensor::Bool>::from_data(
                        TensorData::new(vec![r == 1, true, r == 2, false], [2, 2]),
                        &device,
                    ),
                ),
            };
            let m = shard(m, Arc::new(g), ShardConfig::new(strategy)).unwrap();
            (
                m.weight.val().into_data().to_vec::<f32>().unwrap(),
                m.frozen.val().into_data().to_vec::<f32>().unwrap(),
                m.counts
                    .val()
                    .into_data()
                    .convert::<i64>()
                    .to_vec::<i64>()
                    .unwrap(),
                m.mask.val().into_data().to_vec::<bool>().unwrap(),
            )
        });
        for s in &seen {
            assert_eq!(s.0, vec![0.0; 6], "{strategy}");
            assert_eq!(s.1, vec![0.5; 4], "{strategy}");
            assert_eq!(s.2, vec![0, 7, 0], "{strategy}");
            assert_eq!(s.3, vec![false, true, false, false], "{strategy}");
        }
    }
}

/// The opt-out: `InitSync::Verify` sends nothing but fingerprints; equal weights pass, and a
/// parameter that differs is named with the rank.
#[test]
fn verify_names_the_first_parameter_that_differs() {
    use kiln_shard::InitSync;
    let outcomes = spawn_ranks(3, |g: LocalGroup| {
        let device = Default::default();
        let rank = g.rank();
        let group: Arc<dyn ProcessGroup> = Arc::new(g);
        let config = ShardConfig::new(Strategy::Zero3).with_init(InitSync::Verify);
        let equal = shard(Mlp::<B>::new(&device), group.clone(), config.clone()).is_ok();
        // Rank 2 perturbs the second layer's weight.
        let mut values = params::<Flex, _>(&Mlp::<B>::new(&device));
        if rank == 2 {
            values[2][0] += 1.0;
        }
        let model = with_values(Mlp::<B>::new(&device), &values);
        let differs = shard(model, group, config).err().map(|e| e.to_string());
        (equal, differs)
    });
    for (equal, differs) in outcomes {
        assert!(equal);
        let msg = differs.expect("an error on every rank");
        assert!(
            msg.contains("parameter 'b.weight' (#2) differs between rank 0 and rank 2"),
            "{msg}"
        );
    }
}

/// Global-norm clipping of a sharded model's gradients: one all-reduce, whatever the number of
/// parameters, and the norm one device computes.
#[test]
fn clip_grad_norm_is_one_all_reduce() {
    use kiln_comm::OpKind;
    let device = Default::default();
    let (x, y) = data::<B>(7, 0..ROWS, 0, &device);
    let model = Mlp::<B>::new(&device);
    let grads = GradientsParams::from_grads(model.loss(x, y).backward(), &model);
    let (_, single) = kiln_shard::clip_grad_norm(&model, grads, 1e-3).unwrap();
    let results = spawn_ranks(2, |g: LocalGroup| {
        let group: Arc<dyn ProcessGroup> = Arc::new(g);
        let model = shard(
            Mlp::<B>::new(&device),
            group.clone(),
            ShardConfig::new(Strategy::Zero3),
        )
        .unwrap();
        let (x, y) = data::<B>(7, rows(Some(&group)), 0, &device);
        let grads = GradientsParams::from_grads(model.loss(x, y).backward(), &model);
        let before = group.stats();
        let (_, norm) = kiln_shard::clip_grad_norm(&model, grads, 1e-3).unwrap();
        (
            norm,
            group.stats().since(&before).get(OpKind::AllReduce).calls,
        )
    });
    for (norm, calls) in results {
        assert_eq!(calls, 1);
        assert!(
            ((norm - single) / single).abs() < 1e-5,
            "{norm} vs {single}"
        );
    }
}
