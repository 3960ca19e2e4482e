//! Shard a Burn model you wrote, without changing it.
//!
//! `Classifier<B: Backend>` below is ordinary Burn code (burn-nn's embedding, transformer encoder
//! and linear layer); nothing in it knows about kiln. The program trains it twice with AdamW on
//! the same global batches: on one device, then split over N ranks under one of kiln's strategies.
//! It prints both loss curves side by side, the largest difference, and what one rank held.
//!
//! ```text
//! # 4 ranks as threads of this process, ZeRO-3 (FSDP's full shard):
//! cargo run --release -p shard-your-model -- --ranks 4 --strategy zero3
//! # 2 processes over TCP, started by kiln's launcher (rank 0 prints):
//! cargo build --release -p kiln-cli -p shard-your-model
//! target/release/kiln launch --nproc-per-node 2 -- target/release/shard-your-model --strategy zero2
//! ```
//!
//! What changes in a user's program, and nothing else does:
//! 1. the backend type: `Train<Flex>` (= `Autodiff<Kiln<Flex>>`) where it was `Autodiff<Flex>`;
//! 2. one call to [`shard`] after building the model;
//! 3. the optimizer wrapped in [`ShardedOptimizer`] (ZeRO-1/2 slice and re-gather around the step);
//! 4. every rank reads its own share of the global batch.
//!
//! Initial weights come from `kiln_train::init`, a hash of (seed, parameter name, element), so
//! every rank and the single-device run start identical and a ZeRO-3 rank computes only its
//! shard; Burn's own initialisers draw from a backend-wide generator whose stream depends on
//! thread interleaving.

use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::transformer::{
    TransformerEncoder, TransformerEncoderConfig, TransformerEncoderInput,
};
use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
use burn::optim::{AdamWConfig, Optimizer};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use clap::Parser;
use kiln::comm::{LaunchEnv, LocalGroup, ProcessGroup, ReduceOp, TcpGroup};
use kiln::shard::account::{comm_stats, param_bytes, record_bytes};
use kiln::shard::check::{self, Errors, params};
use kiln::shard::{ShardConfig, ShardedOptimizer, StepConfig, Strategy, gather_model, shard};
use kiln::{Flex, Train};
use std::error::Error;
use std::sync::Arc;

type B = Train<Flex>;
type Res<T> = Result<T, Box<dyn Error + Send + Sync>>;

const VOCAB: usize = 8;
const SEQ: usize = 12;
const CLASSES: usize = 4;
const D_MODEL: usize = 32;
const SEED: u64 = 7;

// ----- the user's model: plain Burn, generic over the backend -----

/// Counts how often token 0 occurs in a sequence (capped at 3): a small transformer classifier.
#[derive(Module, Debug)]
struct Classifier<B: Backend> {
    embed: Embedding<B>,
    encoder: TransformerEncoder<B>,
    head: Linear<B>,
}

impl<B: Backend> Classifier<B> {
    fn new(device: &B::Device) -> Self {
        Classifier {
            embed: EmbeddingConfig::new(VOCAB, D_MODEL).init(device),
            encoder: TransformerEncoderConfig::new(D_MODEL, 4 * D_MODEL, 4, 2)
                .with_dropout(0.0)
                .init(device),
            head: LinearConfig::new(D_MODEL, CLASSES).init(device),
        }
    }

    /// Logits `[batch, CLASSES]` for tokens `[batch, SEQ]`.
    fn forward(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 2> {
        let [batch, _] = tokens.dims();
        let h = self
            .encoder
            .forward(TransformerEncoderInput::new(self.embed.forward(tokens)));
        self.head.forward(h.mean_dim(1).reshape([batch, D_MODEL]))
    }
}

// ----- data: the same global batch on every rank; each rank reads its rows -----

/// Rows `rows` of step `step`'s global batch: tokens and labels.
fn batch(
    step: usize,
    rows: std::ops::Range<usize>,
    device: &burn::tensor::Device<B>,
) -> (Tensor<B, 2, Int>, Tensor<B, 1, Int>) {
    let n = rows.len();
    let mut tokens = Vec::with_capacity(n * SEQ);
    let mut labels = Vec::with_capacity(n);
    for row in rows {
        let key = kiln_train::data::mix(SEED ^ ((step as u64) << 32) ^ (row as u64) << 8);
        let seq: Vec<i64> = (0..SEQ)
            .map(|i| (kiln_train::data::mix(key + i as u64) % VOCAB as u64) as i64)
            .collect();
        labels.push(seq.iter().filter(|&&t| t == 0).count().min(CLASSES - 1) as i64);
        tokens.extend(seq);
    }
    (
        Tensor::from_data(TensorData::new(tokens, [n, SEQ]), device),
        Tensor::from_data(TensorData::new(labels, [n]), device),
    )
}

// ----- training: the same loop with or without a group -----

#[derive(Parser, Debug, Clone)]
#[command(about = "Train a Burn model on one device, then sharded over N ranks, and compare")]
struct Args {
    /// Ranks as threads of this process (ignored under `kiln launch`, which sets RANK).
    #[arg(long, default_value_t = 2)]
    ranks: usize,
    /// ddp, zero1, zero2, zero3 (fsdp) or hybrid:S.
    #[arg(long, default_value = "zero3")]
    strategy: Strategy,
    /// Optimizer steps.
    #[arg(long, default_value_t = 60)]
    steps: usize,
    /// Rows per step, over all ranks.
    #[arg(long, default_value_t = 32)]
    global_batch: usize,
}

/// What one run produced.
struct Run {
    /// Losses and final parameters, as kiln's parity harness compares them.
    trained: check::Run,
    /// This rank's bytes of parameters after the last step.
    param_bytes: usize,
    /// This rank's bytes of AdamW state after the last step.
    optimizer_bytes: usize,
    /// Bytes this rank sent per step (averaged).
    sent_per_step: u64,
}

fn train(args: &Args, group: Option<Arc<dyn ProcessGroup>>) -> Res<Run> {
    let device = Default::default();
    let (rank, world) = group
        .as_ref()
        .map_or((0, 1), |g| (g.rank(), g.world_size()));
    if args.global_batch < world || !args.global_batch.is_multiple_of(world) {
        return Err(format!(
            "a global batch of {} rows does not split over {world} ranks",
            args.global_batch
        )
        .into());
    }
    let local = args.global_batch / world;

    let model = Classifier::<B>::new(&device);
    let model = match &group {
        Some(g) => shard(model, g.clone(), ShardConfig::new(args.strategy))?,
        None => model,
    };
    let mut model = kiln_train::init::init(model, SEED);
    // Whole initial parameters (a collective under ZeRO-3: every rank takes part).
    let initial = params::<Flex, _>(&model);
    let mut optim = ShardedOptimizer::<_, Flex>::new(
        AdamWConfig::new()
            .with_weight_decay(0.01)
            .init::<B, Classifier<B>>(),
    );
    let loss_fn = CrossEntropyLossConfig::new().init(&device);
    // Traffic on the groups sharding uses (under hybrid sharding, sub-groups of `group`).
    let before = comm_stats(&model);

    let mut losses = Vec::with_capacity(args.steps);
    for step in 0..args.steps {
        let (x, y) = batch(step, rank * local..(rank + 1) * local, &device);
        // The mean over this rank's rows; the gradients are averaged over ranks during
        // backward, so the step is the global batch's. `kiln::shard::step` is the training
        // step every kiln loop takes (accumulation, no_sync and clipping are its options).
        let config = StepConfig::default();
        let (stepped, stats) =
            kiln::shard::step(model, &mut optim, 3e-3, &config, |m: &Classifier<B>, _| {
                loss_fn.forward(m.forward(x.clone()), y.clone())
            })?;
        model = stepped;
        let mut value = [stats.loss as f32];
        if let Some(g) = &group {
            g.all_reduce((&mut value[..]).into(), ReduceOp::Avg)?;
        }
        losses.push(f64::from(value[0]));
        if rank == 0 && (step + 1) % 10 == 0 {
            eprintln!(
                "  step {:>3}/{}: loss {:.4}",
                step + 1,
                args.steps,
                value[0]
            );
        }
    }

    let param_bytes = param_bytes::<Flex, B, _>(&model);
    let optimizer_bytes = record_bytes::<B, _>(optim.to_record());
    let sent_per_step = match (comm_stats(&model), before) {
        (Some(now), Some(before)) => now.since(&before).total_sent() / args.steps as u64,
        _ => 0,
    };
    // Whole parameters, for the comparison (a collective: every rank takes part).
    let model = match &group {
        Some(_) => gather_model(model),
        None => model,
    };
    Ok(Run {
        trained: check::Run {
            losses,
            params: params::<Flex, _>(&model),
            initial,
            traffic: Default::default(),
            prefetch: Default::default(),
        },
        param_bytes,
        optimizer_bytes,
        sent_per_step,
    })
}

fn report(args: &Args, world: usize, single: &Run, sharded: &Run) -> Res<()> {
    println!(
        "\n{:>5}  {:>12}  {:>12}",
        "step",
        "1 device",
        format!("{} x {world}", args.strategy)
    );
    let (one, many) = (&single.trained.losses, &sharded.trained.losses);
    for (i, (a, b)) in one.iter().zip(many).enumerate() {
        if i == 0 || (i + 1) % 10 == 0 {
            println!("{:>5}  {a:>12.6}  {b:>12.6}", i + 1);
        }
    }
    // Parameters are compared as one vector: the attention's key bias gets no gradient (softmax
    // ignores a shift shared by every key) and only drifts by rounding noise around zero, so a
    // per-tensor relative error would compare noise with noise.
    let err = Errors::of(&sharded.trained, &single.trained);
    println!(
        "largest relative difference: losses {:.2e}, final parameters (all together) {:.2e}",
        err.loss, err.params
    );
    println!(
        "held by rank 0: parameters {} B (1 device: {} B), AdamW state {} B (1 device: {} B); \
         sent {} B per step",
        sharded.param_bytes,
        single.param_bytes,
        sharded.optimizer_bytes,
        single.optimizer_bytes,
        sharded.sent_per_step
    );
    if sharded.trained.initial != single.trained.initial {
        return Err("the runs did not start from the same weights".into());
    }
    if one[one.len() - 1] >= one[0] {
        return Err("the single-device run did not learn: the loss did not fall".into());
    }
    if err.worst() > 1e-4 {
        return Err(format!(
            "{} x {world} differs from one device beyond 1e-4",
            args.strategy
        )
        .into());
    }
    Ok(())
}

fn main() -> std::process::ExitCode {
    match run(Args::parse()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> Res<()> {
    if args.steps == 0 {
        return Err("--steps must be at least 1".into());
    }
    let launched = std::env::var_os("RANK").is_some();
    let rank0 = !launched || std::env::var("RANK").as_deref() == Ok("0");
    if rank0 {
        eprintln!("one device:");
    }
    let single = train(&args, None)?;

    let (world, sharded) = if launched {
        let group: Arc<dyn ProcessGroup> = Arc::new(TcpGroup::from_launch_env(
            &LaunchEnv::from_env()?,
            Default::default(),
        )?);
        let world = group.world_size();
        if rank0 {
            eprintln!("{} over {world} processes:", args.strategy);
        }
        (world, train(&args, Some(group))?)
    } else {
        if args.ranks == 0 {
            return Err("--ranks must be at least 1".into());
        }
        eprintln!("{} over {} threads:", args.strategy, args.ranks);
        // Each rank thread computes on a Rayon pool of its own (its share of the cores).
        let runs = kiln::shard::threads::spawn_ranks(args.ranks, |g: LocalGroup| {
            train(&args, Some(Arc::new(g)))
        })?;
        // Every rank's result: the first error wins, else rank 0's run.
        let mut runs = runs.into_iter().collect::<Res<Vec<Run>>>()?;
        (args.ranks, runs.swap_remove(0))
    };
    if rank0 {
        report(&args, world, &single, &sharded)?;
    }
    Ok(())
}
