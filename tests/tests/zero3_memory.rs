//! ZeRO-3 keeps its promise on a model with a tied output head and LayerNorms (GPT-2, 8
//! blocks): whole parameters exist only while an op uses them. Measured per rank (the ranks
//! are threads of this process) by `RankAlloc`, which tags each allocation with the rank and
//! kind of the thread that made it.

use burn::backend::Flex;
use burn::module::Module;
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::{Int, Tensor, TensorData};
use kiln::shard::account::{MemKind, RankAlloc, RankMemory, param_bytes, record_bytes};
use kiln::shard::{ShardConfig, ShardedOptimizer, Strategy, shard};
use kiln_comm::{LocalGroup, ProcessGroup, spawn_ranks};
use kiln_gpt2::{Gpt2, Gpt2Config};
use kiln_model::causal_lm_loss;
use std::sync::Arc;

#[global_allocator]
static ALLOC: RankAlloc = RankAlloc;

type B = kiln::Train<Flex>;

const RANKS: usize = 4;

/// The tests of this file count the same ranks' bytes: they run one at a time.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
const BATCH: usize = 2;
const SEQ: usize = 32;

fn config() -> Gpt2Config {
    Gpt2Config::new(512, SEQ, 64, 8, 4)
}

fn batch(rank: usize, step: usize) -> (Tensor<B, 2, Int>, Tensor<B, 2, Int>) {
    let ids = |shift: usize| {
        let v: Vec<i64> = (0..BATCH * SEQ)
            .map(|i| ((i * 31 + rank * 7 + step * 13 + shift) % 512) as i64)
            .collect();
        Tensor::<B, 2, Int>::from_data(TensorData::new(v, [BATCH, SEQ]), &Default::default())
    };
    (ids(0), ids(1))
}

/// What one rank measured in one training step (bytes).
#[derive(Debug, Clone, Copy)]
struct Step {
    live_before: usize,
    peak: usize,
    gathered_after_forward: usize,
    gathered_after_backward: usize,
    gathered_peak: usize,
    other_peak: usize,
    comm_peak: usize,
    shards: usize,
}

fn step(
    model: Gpt2<B>,
    optim: &mut impl Optimizer<Gpt2<B>, B>,
    rank: usize,
    n: usize,
) -> (Gpt2<B>, Step) {
    let live_before = RankMemory::of(rank).total();
    let gathered_before = RankMemory::of(rank).live(MemKind::Gathered);
    RankMemory::reset_peak(rank);
    let (x, y) = batch(rank, n);
    let loss = causal_lm_loss(model.forward(x), y);
    let gathered_after_forward = RankMemory::of(rank).live(MemKind::Gathered) - gathered_before;
    let grads = GradientsParams::from_grads(loss.backward(), &model);
    let gathered_after_backward = RankMemory::of(rank).live(MemKind::Gathered) - gathered_before;
    let model = optim.step(1e-3, model, grads);
    let m = RankMemory::of(rank);
    let shards = param_bytes::<Flex, B, _>(&model);
    (
        model,
        Step {
            live_before,
            peak: m.peak,
            gathered_after_forward,
            gathered_after_backward,
            gathered_peak: m.peak_of(MemKind::Gathered) - gathered_before,
            other_peak: m.peak_of(MemKind::Other),
            comm_peak: m.peak_of(MemKind::Comm),
            shards,
        },
    )
}

#[test]
fn zero3_holds_no_whole_parameter_between_uses() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let cfg = config();
    let d = cfg.n_embd;
    // The largest "layers": the token embedding (tied to the head) and a block.
    let embedding = cfg.vocab_size * d * 4;
    let block = (12 * d * d + 13 * d) * 4;
    let largest_two = embedding + block;
    let steps = spawn_ranks(RANKS, |g: LocalGroup| {
        let rank = g.rank();
        kiln::shard::account::attribute_to_rank(rank);
        let group: Arc<dyn ProcessGroup> = Arc::new(g);
        // The same step of an unsharded model on this thread: activations and whole gradients.
        let plain = {
            let model = cfg.init::<B>(&Default::default());
            let mut optim =
                ShardedOptimizer::<_, Flex>::new(AdamWConfig::new().init::<B, Gpt2<B>>());
            let (model, _) = step(model, &mut optim, rank, 0);
            step(model, &mut optim, rank, 1).1
        };
        let model = cfg.init::<B>(&Default::default());
        // Buckets of 256 KiB, so that reduction buffers stay small beside the model; no
        // prefetch (which by design keeps the next parameters whole ahead of their use).
        let config = ShardConfig::new(Strategy::Zero3)
            .with_bucket_bytes(256 << 10)
            .with_prefetch_bytes(0);
        let model = shard(model, group, config).unwrap();
        let mut optim = ShardedOptimizer::<_, Flex>::new(AdamWConfig::new().init::<B, Gpt2<B>>());
        // The first step creates the optimizer state; the second is measured.
        let (model, _) = step(model, &mut optim, rank, 0);
        let (model, s) = step(model, &mut optim, rank, 1);
        let optimizer = record_bytes::<B, _>(optim.to_record());
        drop(model);
        (s, optimizer, plain)
    });
    for (rank, (s, optimizer, plain)) in steps.iter().enumerate() {
        println!(
            "rank {rank}: live before the step {} B (parameter shards {} B, AdamW state {} B); \
             peak during the step {} B: gathered parameters {} B, reduced gradients and \
             buffers {} B, everything else (activations, gradients, temporaries) {} B; whole \
             parameters alive after forward {} B, after backward {} B",
            s.live_before,
            s.shards,
            optimizer,
            s.peak,
            s.gathered_peak,
            s.comm_peak,
            s.other_peak,
            s.gathered_after_forward,
            s.gathered_after_backward
        );
        // "Gathered on use, dropped after": nothing gathered outlives forward (a tied head's
        // transposed weight or a LayerNorm's reshaped scale used to be kept for backward).
        assert_eq!(s.gathered_after_forward, 0, "rank {rank}: {s:?}");
        assert_eq!(s.gathered_after_backward, 0, "rank {rank}: {s:?}");
        // At any moment at most the parameters of the two largest layers are whole.
        assert!(
            s.gathered_peak <= largest_two,
            "rank {rank}: {} B of gathered parameters at once, bound {largest_two} B",
            s.gathered_peak
        );
        // The step's peak: what the rank held before (shards, optimizer state), plus what the
        // same step of the unsharded model adds (its activations and whole gradients, measured
        // on this thread), plus the parameters of the two largest layers whole, plus the
        // reduction's buffers.
        let activations = plain.peak - plain.live_before;
        let bound = s.live_before + activations + largest_two + s.comm_peak;
        println!(
            "rank {rank}: peak {} B <= shards and state {} B + unsharded step's activations and \
             gradients {activations} B + two largest layers {largest_two} B + reduction buffers \
             {} B = {bound} B",
            s.peak, s.live_before, s.comm_peak
        );
        assert!(
            s.peak <= bound,
            "rank {rank}: peak {} B, bound {bound} B",
            s.peak
        );
    }
}

/// The memory profile that `kiln_shard::step` reports for a ZeRO-3 x4 step: parameters,
/// gradients and optimizer state are ZeRO's 16Ψ/N (4 + 4 + 8 bytes per parameter, over 4
/// ranks), and activations are reported on their own, as large as the unsharded model's.
#[test]
fn a_zero3_step_reports_zero_formula_model_state_and_activations_apart() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    use kiln::shard::account::StepMemory;
    let cfg = config();
    let memory = spawn_ranks(RANKS, |g: LocalGroup| {
        let rank = g.rank();
        kiln::shard::account::attribute_to_rank(rank);
        let group: Arc<dyn ProcessGroup> = Arc::new(g);
        let two_steps = |model: Gpt2<B>| -> (StepMemory, usize, usize) {
            let psi = model.num_params();
            let mut optim =
                ShardedOptimizer::<_, Flex>::new(AdamWConfig::new().init::<B, Gpt2<B>>());
            let mut model = model;
            let mut last = None;
            for n in 0..2 {
                let (x, y) = batch(rank, n);
                let (m, stats) = kiln::shard::step(
                    model,
                    &mut optim,
                    1e-3,
                    &Default::default(),
                    |m: &Gpt2<B>, _| causal_lm_loss(m.forward(x.clone()), y.clone()),
                )
                .expect("a step");
                model = m;
                last = stats.memory;
            }
            let optimizer = record_bytes::<B, _>(optim.to_record());
            (last.expect("RankAlloc counts"), optimizer, psi)
        };
        let plain = two_steps(cfg.init::<B>(&Default::default()));
        let config = ShardConfig::new(Strategy::Zero3)
            .with_bucket_bytes(256 << 10)
            .with_prefetch_bytes(0);
        let model = shard(cfg.init::<B>(&Default::default()), group, config).unwrap();
        (plain, two_steps(model))
    });
    for (rank, ((plain, _, _), (s, optimizer, psi))) in memory.iter().enumerate() {
        let tensors = 4 + 12 * config().n_layer; // GPT-2's parameter tensors (a bound)
        println!(
            "rank {rank}: Ψ = {psi}; params {} B, grads {} B, optimizer {optimizer} B \
             (16Ψ/N = {} B); activations {} B (unsharded {} B), backward {} B, gathered {} B, \
             comm {} B; peak {} B",
            s.params,
            s.grads,
            16 * psi / RANKS,
            s.peak_of(MemKind::Activations),
            plain.peak_of(MemKind::Activations),
            s.peak_of(MemKind::Backward),
            s.peak_of(MemKind::Gathered),
            s.peak_of(MemKind::Comm),
            s.peak
        );
        assert_eq!(s.rank, rank);
        // Each tensor's shard is within one element of numel/N.
        let near = |got: usize, want: usize, slack: usize| got.abs_diff(want) <= slack;
        assert!(near(s.params, 4 * psi / RANKS, 4 * tensors), "{s:?}");
        assert!(near(s.grads, 4 * psi / RANKS, 4 * tensors), "{s:?}");
        // The record's serialisation adds a few dozen bytes per tensor (shape, type).
        assert!(
            *optimizer >= 8 * psi / RANKS - 8 * tensors
                && *optimizer <= 8 * psi / RANKS + 256 * tensors,
            "optimizer {optimizer} B, 8Ψ/N = {} B",
            8 * psi / RANKS
        );
        // Unsharded, the same rank holds all of it.
        assert_eq!(plain.params, 4 * psi);
        assert_eq!(plain.grads, 4 * psi);
        // Activations: what forward keeps is the model's, not the strategy's; gathered
        // parameters are counted apart, never as activations.
        let (a, p) = (
            s.peak_of(MemKind::Activations) as f64,
            plain.peak_of(MemKind::Activations) as f64,
        );
        assert!(
            p > 0.0 && (a - p).abs() <= 0.1 * p,
            "activations {a} B, unsharded {p} B"
        );
        assert!(s.peak_of(MemKind::Gathered) > 0 && plain.peak_of(MemKind::Gathered) == 0);
        assert!(s.peak >= s.held_before + s.peak_of(MemKind::Activations) / 2);
    }
}
