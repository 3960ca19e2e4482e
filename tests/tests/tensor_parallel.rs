//! Tensor parallelism of kiln's GPT-2 and Llama under their default plans (Megatron's split),
//! against one device: the same losses and weights after AdamW steps, Megatron's communication
//! (2 all-reduces forward and 2 backward per block, of `batch x seq x n_embd` elements each) and
//! no tensor formed whole.

use burn::module::AutodiffModule;
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Int, Tensor, TensorData};
use kiln::shard::check::{params, rel};
use kiln::shard::tp::{TpStats, reset_stats, stats};
use kiln::shard::{TpPlan, TpStyle, tensor_parallel};
use kiln::{Flex, Train};
use kiln_comm::{LocalGroup, ProcessGroup, spawn_ranks};
use kiln_model::causal_lm_loss;
use std::sync::{Arc, Mutex};

type B = Train<Flex>;

const VOCAB: usize = 64;
const SEQ: usize = 8;
const BATCH: usize = 3;
const LAYERS: usize = 2;
const STEPS: usize = 3;

struct Run {
    losses: Vec<f32>,
    params: Vec<Vec<f32>>,
    forward: TpStats,
    backward: TpStats,
}

/// The batch, drawn once: ranks as threads share the backend's random generator, so draws
/// inside them would race.
fn tokens() -> TensorData {
    let device = Default::default();
    B::seed(&device, 5);
    Tensor::<B, 2, Int>::random(
        [BATCH, SEQ + 1],
        Distribution::Uniform(0.0, VOCAB as f64),
        &device,
    )
    .into_data()
}

fn train<M: AutodiffModule<B>>(
    model: M,
    forward: impl Fn(&M, Tensor<B, 2, Int>) -> Tensor<B, 3>,
    plan: &TpPlan,
    group: Option<Arc<dyn ProcessGroup>>,
    tokens: TensorData,
) -> Run {
    let device = Default::default();
    let mut model = match group {
        Some(g) => tensor_parallel(model, plan, g).unwrap().0,
        None => model,
    };
    let tokens = Tensor::<B, 2, Int>::from_data(tokens, &device);
    let x = tokens.clone().slice([0..BATCH, 0..SEQ]);
    let y = tokens.slice([0..BATCH, 1..SEQ + 1]);
    let mut optim = AdamWConfig::new().init();
    let (mut losses, mut fwd, mut bwd) = (vec![], TpStats::default(), TpStats::default());
    for step in 0..STEPS {
        reset_stats();
        let loss = causal_lm_loss(forward(&model, x.clone()), y.clone());
        if step == 0 {
            fwd = stats();
        }
        losses.push(loss.clone().into_scalar());
        reset_stats();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        if step == 0 {
            bwd = stats();
        }
        model = optim.step(1e-2, model, grads);
    }
    Run {
        losses,
        params: params::<Flex, _>(&model),
        forward: fwd,
        backward: bwd,
    }
}

fn check<M: AutodiffModule<B> + Clone + Send>(
    name: &str,
    initial: M,
    forward: impl Fn(&M, Tensor<B, 2, Int>) -> Tensor<B, 3> + Sync,
    plan: TpPlan,
    n_embd: usize,
) {
    let reference = train(initial.clone(), &forward, &plan, None, tokens());
    for tp in [2, 4] {
        let initial = Mutex::new(initial.clone());
        let tokens = tokens();
        let runs = spawn_ranks(tp, |g: LocalGroup| {
            let model = initial.lock().unwrap().clone();
            train(model, &forward, &plan, Some(Arc::new(g)), tokens.clone())
        });
        for (rank, run) in runs.iter().enumerate() {
            let mut worst = 0f32;
            for (a, b) in run.losses.iter().zip(&reference.losses) {
                worst = worst.max((a - b).abs() / b.abs());
            }
            for (p, q) in run.params.iter().zip(&reference.params) {
                worst = worst.max(rel(p, q) as f32);
            }
            assert!(
                worst <= 1e-5,
                "{name} tp {tp} rank {rank}: relative error {worst:e}\nlosses {:?}\nreference {:?}",
                run.losses,
                reference.losses
            );
            let bytes = 2 * LAYERS * BATCH * SEQ * n_embd * 4;
            if plan.rules.iter().any(|(_, s)| *s == TpStyle::Vocab) {
                // Vocabulary-parallel embedding and head, and the loss on the split logits:
                // nothing formed whole.
                let (f, b) = (&run.forward, &run.backward);
                assert_eq!(
                    (f.total_gathers(), b.total_gathers()),
                    (0, 0),
                    "{name} tp {tp} vocab rank {rank}: forward {f:?}, backward {b:?}"
                );
                if rank == 0 {
                    println!(
                        "{name} tp {tp} with a vocabulary-parallel embedding and loss: largest \
                         relative error {worst:e}; forward {} all-reduces ({} bytes), backward \
                         {} ({} bytes); 0 tensors formed whole",
                        f.all_reduces, f.all_reduce_bytes, b.all_reduces, b.all_reduce_bytes
                    );
                }
                continue;
            }
            if plan.sequence_parallel {
                // Megatron's sequence parallelism: per block, 2 all-gathers and 2
                // reduce-scatters forward; backward 2 reduce-scatters and 4 all-gathers (the
                // row-parallel layers' output gradients, and the column-parallel layers'
                // inputs again for their weight gradients, as Megatron-LM does). The first
                // block's attention reads the (whole) embedding: one all-gather fewer each way.
                // The embedding's gradient is gathered (the end of the sequence-parallel
                // region, one per embedding table); nothing else is formed whole.
                let (f, b) = (&run.forward, &run.backward);
                let tables = if name == "GPT-2" { 2 } else { 1 };
                assert_eq!(
                    (f.all_gathers, f.reduce_scatters, f.total_gathers()),
                    (2 * LAYERS - 1, 2 * LAYERS, 0),
                    "{name} tp {tp} sp rank {rank} forward: {f:?}"
                );
                assert_eq!(
                    (b.all_gathers, b.reduce_scatters, b.gathers.clone()),
                    (
                        4 * LAYERS - 1,
                        2 * LAYERS,
                        [("embedding_backward", tables)].into_iter().collect()
                    ),
                    "{name} tp {tp} sp rank {rank} backward: {b:?}"
                );
                let tokens = BATCH * SEQ * n_embd * 4;
                assert_eq!(f.reduce_scatter_bytes, 2 * LAYERS * tokens);
                assert_eq!(
                    f.all_gather_bytes,
                    (2 * LAYERS - 1) * tokens * (tp - 1) / tp
                );
                if rank == 0 {
                    println!(
                        "{name} tp {tp} with sequence parallelism: largest relative error \
                         {worst:e}; forward {} all-gathers, {} reduce-scatters; backward {} \
                         all-gathers, {} reduce-scatters, {} all-reduces (gradient terms of weights \
                         applied to sequence parts: norms, biases, a tied head; {} bytes)",
                        f.all_gathers,
                        f.reduce_scatters,
                        b.all_gathers,
                        b.reduce_scatters,
                        b.all_reduces,
                        b.all_reduce_bytes
                    );
                }
                continue;
            }
            for (pass, s) in [("forward", &run.forward), ("backward", &run.backward)] {
                assert_eq!(
                    (s.all_reduces, s.all_reduce_bytes, s.total_gathers()),
                    (2 * LAYERS, bytes, 0),
                    "{name} tp {tp} rank {rank} {pass}: {s:?}"
                );
            }
            if rank == 0 {
                println!(
                    "{name} tp {tp}: largest relative error {worst:e}; per step {} all-reduces \
                     forward and {} backward, {} bytes each way, 0 tensors formed whole",
                    run.forward.all_reduces, run.backward.all_reduces, bytes
                );
            }
        }
    }
}

#[test]
fn gpt2_under_its_default_plan_equals_one_device() {
    let device = Default::default();
    B::seed(&device, 3);
    let model = kiln_gpt2::Gpt2Config::new(VOCAB, SEQ, 32, LAYERS, 4).init::<B>(&device);
    params::<Flex, _>(&model);
    for sp in [false, true] {
        check(
            "GPT-2",
            model.clone(),
            |m: &kiln_gpt2::Gpt2<B>, x| m.forward(x),
            TpPlan::gpt2().with_sequence_parallel(sp),
            32,
        );
    }
    let mut vocab = TpPlan::gpt2();
    vocab.rules.push(("wte".into(), TpStyle::Vocab));
    check(
        "GPT-2",
        model,
        |m: &kiln_gpt2::Gpt2<B>, x| m.forward(x),
        vocab,
        32,
    );
}

#[test]
fn llama_under_its_default_plan_equals_one_device() {
    let device = Default::default();
    B::seed(&device, 3);
    // Grouped KV heads: 4 query heads, 4 KV heads at tp 4 (1 each), 2 at tp 2.
    let config = kiln_llama::LlamaConfig {
        vocab_size: VOCAB,
        hidden_size: 32,
        intermediate_size: 48,
        num_hidden_layers: LAYERS,
        num_attention_heads: 8,
        num_key_value_heads: Some(4),
        head_dim: None,
        max_position_embeddings: SEQ,
        rms_norm_eps: 1e-5,
        rope_theta: Some(10_000.0),
        rope_parameters: None,
        rope_scaling: None,
        tie_word_embeddings: false,
        attention_bias: false,
        mlp_bias: false,
        hidden_act: "silu".into(),
    };
    let model = config.init::<B>(&device);
    params::<Flex, _>(&model);
    for sp in [false, true] {
        check(
            "Llama",
            model.clone(),
            |m: &kiln_llama::Llama<B>, x| m.forward(x),
            TpPlan::llama().with_sequence_parallel(sp),
            32,
        );
    }
    let mut vocab = TpPlan::llama();
    vocab.rules.push(("embed_tokens".into(), TpStyle::Vocab));
    vocab
        .rules
        .push(("lm_head".into(), TpStyle::Colwise { blocks: 1 }));
    check(
        "Llama",
        model,
        |m: &kiln_llama::Llama<B>, x| m.forward(x),
        vocab,
        32,
    );
}
