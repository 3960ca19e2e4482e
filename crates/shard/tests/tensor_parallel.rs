//! Tensor parallelism on a model kiln did not write: burn-nn's transformer encoder under a
//! Megatron plan by module path trains equal to one device, with Megatron's communication
//! (2 all-reduces forward and 2 backward per block) and no tensor formed whole.

use burn::backend::Flex;
use burn::module::Module;
use burn::nn::transformer::{
    TransformerEncoder, TransformerEncoderConfig, TransformerEncoderInput,
};
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Tensor, TensorData};
use kiln_comm::{LocalGroup, ProcessGroup, spawn_ranks};
use kiln_shard::check::{Train, params, rel};
use kiln_shard::tp::{TpStats, reset_stats, stats};
use kiln_shard::{TpPlan, TpStyle, tensor_parallel};
use std::sync::{Arc, Mutex};

type B = Train<Flex>;

const SEQ: usize = 4;
const D_MODEL: usize = 8;
const HEADS: usize = 4;
const LAYERS: usize = 2;
const STEPS: usize = 3;

#[derive(Module, Debug)]
struct Tiny<B: Backend> {
    /// Replicated, in front of the first block (whose input gradient it needs).
    embed: Linear<B>,
    encoder: TransformerEncoder<B>,
    head: Linear<B>,
}

impl Tiny<B> {
    fn loss(&self, x: Tensor<B, 3>, y: Tensor<B, 2>) -> Tensor<B, 1> {
        let [batch, _, _] = x.dims();
        let h = self
            .encoder
            .forward(TransformerEncoderInput::new(self.embed.forward(x)));
        let out = self.head.forward(h.mean_dim(1).reshape([batch, D_MODEL]));
        (out - y).powf_scalar(2.0).mean()
    }
}

fn tiny() -> Tiny<B> {
    tiny_with(0.0)
}

/// Held by each test for its whole run: the tests seed and draw from Flex's one process-wide
/// generator (weights, data, dropout masks), so two at once would draw each other's numbers
/// (`cargo test` runs a file's tests on parallel threads).
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static RNG: Mutex<()> = Mutex::new(());
    RNG.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn tiny_with(dropout: f64) -> Tiny<B> {
    let device = Default::default();
    B::seed(&device, 7);
    let model = Tiny {
        embed: LinearConfig::new(D_MODEL, D_MODEL).init(&device),
        encoder: TransformerEncoderConfig::new(D_MODEL, 16, HEADS, LAYERS)
            .with_dropout(dropout)
            .init(&device),
        head: LinearConfig::new(D_MODEL, 3).init(&device),
    };
    params::<Flex, _>(&model);
    model
}

fn megatron() -> TpPlan {
    let col = TpStyle::Colwise { blocks: 1 };
    TpPlan::from_pairs(&[
        ("query", col),
        ("key", col),
        ("value", col),
        ("output", TpStyle::Rowwise),
        ("linear_inner", col),
        ("linear_outer", TpStyle::Rowwise),
    ])
}

struct Run {
    losses: Vec<f32>,
    params: Vec<Vec<f32>>,
    forward: TpStats,
    backward: TpStats,
}

/// The batch, drawn once: ranks as threads share the backend's random generator, so draws
/// inside them would race.
fn batch() -> (TensorData, TensorData) {
    let device = Default::default();
    B::seed(&device, 11);
    let x = Tensor::<B, 3>::random([6, SEQ, D_MODEL], Distribution::Default, &device);
    let y = Tensor::<B, 2>::random([6, 3], Distribution::Default, &device);
    (x.into_data(), y.into_data())
}

fn train(
    model: Tiny<B>,
    group: Option<Arc<dyn ProcessGroup>>,
    data: (TensorData, TensorData),
) -> Run {
    let device = Default::default();
    let model = match group {
        Some(g) => tensor_parallel(model, &megatron(), g).unwrap().0,
        None => model,
    };
    let x = Tensor::<B, 3>::from_data(data.0, &device);
    let y = Tensor::<B, 2>::from_data(data.1, &device);
    let mut optim = AdamWConfig::new().init();
    let mut model = model;
    let (mut losses, mut forward, mut backward) = (vec![], TpStats::default(), TpStats::default());
    for step in 0..STEPS {
        reset_stats();
        let loss = model.loss(x.clone(), y.clone());
        if step == 0 {
            forward = stats();
        }
        losses.push(loss.clone().into_scalar());
        reset_stats();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        if step == 0 {
            backward = stats();
        }
        model = optim.step(1e-2, model, grads);
    }
    Run {
        losses,
        params: params::<Flex, _>(&model),
        forward,
        backward,
    }
}

#[test]
fn burn_nn_transformer_under_a_path_plan_equals_one_device() {
    let _rng = serial();
    let initial = tiny();
    let reference = train(initial.clone(), None, batch());
    for tp in [2, 4] {
        let initial = Mutex::new(initial.clone());
        let data = batch();
        let runs = spawn_ranks(tp, |g: LocalGroup| {
            let model = initial.lock().unwrap().clone();
            train(model, Some(Arc::new(g)), data.clone())
        });
        for (rank, run) in runs.iter().enumerate() {
            let mut worst = 0f32;
            for (a, b) in run.losses.iter().zip(&reference.losses) {
                worst = worst.max((a - b).abs() / b.abs().max(1e-6));
            }
            // Per parameter tensor: the norm of the difference over the reference's norm.
            for (p, q) in run.params.iter().zip(&reference.params) {
                worst = worst.max(rel(p, q) as f32);
            }
            assert!(
                worst <= 1e-5,
                "tp {tp} rank {rank}: relative error {worst:e}\nlosses {:?}\nreference {:?}",
                run.losses,
                reference.losses
            );
            // Megatron's count: one all-reduce after the attention and one after the MLP in
            // forward, one before each in backward; nothing formed whole.
            assert_eq!(
                (run.forward.all_reduces, run.backward.all_reduces),
                (2 * LAYERS, 2 * LAYERS),
                "tp {tp} rank {rank}: forward {:?}, backward {:?}",
                run.forward,
                run.backward
            );
            assert_eq!(
                run.forward.total_gathers() + run.backward.total_gathers(),
                0,
                "tp {tp} rank {rank}: split tensors formed whole: forward {:?}, backward {:?}",
                run.forward.gathers,
                run.backward.gathers
            );
            if rank == 0 {
                println!(
                    "tp {tp}: largest relative error {worst:e}; forward {:?}; backward {:?}",
                    run.forward, run.backward
                );
            }
        }
    }
}

/// Dropout under tensor parallelism: the tp group's ranks draw one mask (rank 0's, broadcast),
/// one device's, so the run equals one device's with the same generator.
#[test]
fn dropout_masks_agree_across_a_tp_group() {
    let _rng = serial();
    let initial = tiny_with(0.2);
    let reference = train(initial.clone(), None, batch());
    let initial = Mutex::new(initial);
    let data = batch();
    let runs = spawn_ranks(2, |g: LocalGroup| {
        let model = initial.lock().unwrap().clone();
        train(model, Some(Arc::new(g)), data.clone())
    });
    for run in &runs {
        for (a, b) in run.losses.iter().zip(&reference.losses) {
            assert!(
                (a - b).abs() <= 1e-5 * b.abs(),
                "losses {:?} vs one device {:?}",
                run.losses,
                reference.losses
            );
        }
    }
    println!(
        "dropout 0.2 at tp 2: losses {:?} = one device's",
        runs[0].losses
    );
}

#[test]
fn plans_name_what_is_wrong() {
    let _rng = serial();
    let model = tiny();
    let g: Arc<dyn ProcessGroup> = Arc::new(LocalGroup::new_world(1, Default::default()).remove(0));
    let nothing = TpPlan::from_pairs(&[("c_attn", TpStyle::Rowwise)]);
    let e = tensor_parallel(model.clone(), &nothing, g.clone()).unwrap_err();
    assert!(e.to_string().contains("\"c_attn\" matches no layer"), "{e}");
    let norm = TpPlan::from_pairs(&[("norm_1", TpStyle::Rowwise)]);
    let e = tensor_parallel(model.clone(), &norm, g).unwrap_err();
    assert!(e.to_string().contains("only Linear layers"), "{e}");
    let groups = LocalGroup::new_world(3, Default::default());
    let g: Arc<dyn ProcessGroup> = Arc::new(groups.into_iter().next().unwrap());
    let e = tensor_parallel(model, &megatron(), g).unwrap_err();
    assert!(
        e.to_string().contains("not a multiple of 1 block(s) x 3"),
        "{e}"
    );
    assert!(TpPlan::parse("c_attn=colwise/3, c_proj=rowwise").is_ok());
    assert!(TpPlan::parse("c_attn=diagonal").is_err());
}
