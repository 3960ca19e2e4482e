//! `zero-bench`: what DDP and ZeRO-1/2/3 hold and send per rank, measured beside ZeRO's
//! predictions, and the decorator's overhead at world size 1.
//!
//! ```text
//! cargo run --release -p kiln-cli --bin zero-bench                 # Ψ ≈ 1.05 M, N = 1, 2, 4, 8
//! cargo run --release -p kiln-cli --bin zero-bench -- --width 256  # a quicker run (Ψ ≈ 263 k)
//! ```
//!
//! Ranks are threads (`LocalGroup`), each training the same MLP (`--layers` x Linear(width,
//! width), fp32, AdamW). Per rank, after a warm-up step (so the optimizer state exists), one
//! step is measured:
//! - model-state bytes: parameters and gradients as held (shards count their local part),
//!   optimizer state as its serialised record read locally; beside ZeRO's 16Ψ, 8Ψ+8Ψ/N,
//!   4Ψ+12Ψ/N, 16Ψ/N (Rajbhandari et al. 2020);
//! - elements sent per rank in the step (the group's counters) beside 2Ψ(N-1)/N (DDP, ZeRO-1/2)
//!   and 3Ψ(N-1)/N (ZeRO-3);
//! - the process's peak heap during the step (a counting allocator; all N ranks share the
//!   process, so it is also shown divided by N).
//!
//! Then, at world size 1, the time of a training step of `Autodiff<Kiln<Flex>>` under ZeRO-3
//! against the same stack unsharded, and of an inference forward of `Kiln<Flex>` against bare
//! `Flex`, measured alternately in the same run. (Bare `Autodiff<Flex>` cannot be built beside
//! kiln: kiln turns on Burn's `distributed` feature; see the README.)

use burn::backend::Flex;
use burn::module::Module;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use clap::Parser;
use kiln_comm::{LocalGroup, OpKind, ProcessGroup};
use kiln_shard::account::{CountingAlloc, grad_bytes, param_bytes, record_bytes};
use kiln_shard::{Shard, ShardConfig, ShardedOptimizer, Strategy, shard};
use std::sync::{Arc, Mutex};
use std::time::Instant;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

type Kiln = Shard<Flex>;
type Train = kiln::Train<Flex>;

#[derive(Parser, Debug)]
#[command(name = "zero-bench")]
struct Args {
    /// Width of each layer.
    #[arg(long, default_value_t = 512)]
    width: usize,
    /// Number of layers.
    #[arg(long, default_value_t = 4)]
    layers: usize,
    /// Rows per rank per step.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// World sizes.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    ranks: Vec<usize>,
    /// Timed steps for the overhead ratio.
    #[arg(long, default_value_t = 20)]
    timed_steps: usize,
}

#[derive(Module, Debug)]
struct Deep<B: Backend> {
    layers: Vec<Linear<B>>,
    act: Relu,
}

impl<B: Backend> Deep<B> {
    fn new(width: usize, layers: usize, device: &B::Device) -> Self {
        B::seed(device, 7);
        let model = Deep {
            layers: (0..layers)
                .map(|_| LinearConfig::new(width, width).init(device))
                .collect(),
            act: Relu::new(),
        };
        // Materialise the lazily initialised parameters once, before clones share them.
        let _ = model.clone().into_record();
        model
    }
    fn forward(&self, mut x: Tensor<B, 2>) -> Tensor<B, 2> {
        for l in &self.layers {
            x = self.act.forward(l.forward(x));
        }
        x
    }
}

fn batch<B: Backend>(rows: usize, width: usize, seed: usize, device: &B::Device) -> Tensor<B, 2> {
    let v: Vec<f32> = (0..rows * width)
        .map(|i| (((i * 31 + seed * 17) % 97) as f32 / 48.0) - 1.0)
        .collect();
    Tensor::from_data(TensorData::new(v, [rows, width]), device)
}

struct Measured {
    params: usize,
    grads: usize,
    optimizer: usize,
    sent_elems: u64,
    peak: usize,
}

/// One rank: shard, a warm-up step, then one measured step.
fn measure(
    model: Deep<Train>,
    group: Arc<dyn ProcessGroup>,
    strategy: Strategy,
    args: &Args,
) -> Measured {
    let device = Default::default();
    let rank = group.rank();
    let mut model = shard(model, group.clone(), ShardConfig::new(strategy)).expect("shard");
    let mut optim =
        ShardedOptimizer::<_, Flex>::new(AdamWConfig::new().init::<Train, Deep<Train>>());
    let loss = model
        .forward(batch(args.batch, args.width, rank, &device))
        .powf_scalar(2.0)
        .mean();
    let grads = GradientsParams::from_grads(loss.backward(), &model);
    model = optim.step(1e-3, model, grads);

    group.barrier().expect("barrier");
    if rank == 0 {
        CountingAlloc::reset_peak();
    }
    group.barrier().expect("barrier");
    let before = group.stats();
    let loss = model
        .forward(batch(args.batch, args.width, rank + 100, &device))
        .powf_scalar(2.0)
        .mean();
    let grads = GradientsParams::from_grads(loss.backward(), &model);
    let grads_held = grad_bytes::<Flex, Train, _>(&model, &grads);
    model = optim.step(1e-3, model, grads);
    let sent = group.stats().since(&before);
    group.barrier().expect("barrier");
    let peak = CountingAlloc::peak();
    Measured {
        params: param_bytes::<Flex, Train, _>(&model),
        grads: grads_held,
        optimizer: record_bytes::<Train, _>(optim.to_record()),
        sent_elems: (sent.total_sent() - sent.get(OpKind::Barrier).bytes_sent) / 4,
        peak,
    }
}

fn mib(b: f64) -> String {
    format!("{:.2}", b / (1u64 << 20) as f64)
}

fn memory_and_traffic(args: &Args) {
    let device = Default::default();
    let model = Deep::<Train>::new(args.width, args.layers, &device);
    let psi: usize = model.num_params();
    println!(
        "model: {} x Linear({w}, {w}) + bias, fp32, AdamW: Ψ = {psi} parameters ({} MiB)",
        args.layers,
        mib((psi * 4) as f64),
        w = args.width
    );
    println!(
        "{:<6} {:>2} | {:>8} {:>8} {:>8} {:>9} | {:>9} {:>6} | {:>11} {:>11} {:>6} | {:>9} {:>9}",
        "strat",
        "N",
        "params",
        "grads",
        "optim",
        "state",
        "predicted",
        "ratio",
        "sent elems",
        "predicted",
        "ratio",
        "peak MiB",
        "peak/N"
    );
    let model = Mutex::new(model);
    let psi_f = psi as f64;
    for strategy in [
        Strategy::Ddp,
        Strategy::Zero1,
        Strategy::Zero2,
        Strategy::Zero3,
    ] {
        for &n in &args.ranks {
            let per_rank = kiln::shard::threads::spawn_ranks(n, |g: LocalGroup| {
                let m = model.lock().expect("model").clone();
                measure(m, Arc::new(g), strategy, args)
            })
            .unwrap_or_else(|e| panic!("zero_bench: {e}"));
            let nf = n as f64;
            let predicted_state = match strategy {
                Strategy::Ddp => 16.0 * psi_f,
                Strategy::Zero1 => 8.0 * psi_f + 8.0 * psi_f / nf,
                Strategy::Zero2 => 4.0 * psi_f + 12.0 * psi_f / nf,
                _ => 16.0 * psi_f / nf,
            };
            let predicted_sent = match strategy {
                Strategy::Zero3 => 3.0 * psi_f * (nf - 1.0) / nf,
                _ => 2.0 * psi_f * (nf - 1.0) / nf,
            };
            // Rank 0 (shards differ by at most one element).
            let m = &per_rank[0];
            let state = m.params + m.grads + m.optimizer;
            let sent_ratio = if predicted_sent > 0.0 {
                format!("{:.3}", m.sent_elems as f64 / predicted_sent)
            } else {
                "-".into()
            };
            println!(
                "{:<6} {n:>2} | {:>8} {:>8} {:>8} {:>9} | {:>9} {:>6.3} | {:>11} {:>11.0} {:>6} | {:>9} {:>9}",
                strategy.to_string(),
                mib(m.params as f64),
                mib(m.grads as f64),
                mib(m.optimizer as f64),
                mib(state as f64),
                mib(predicted_state),
                state as f64 / predicted_state,
                m.sent_elems,
                predicted_sent,
                sent_ratio,
                mib(m.peak as f64),
                mib(m.peak as f64 / nf)
            );
        }
    }
    println!(
        "(state = params + grads held after backward + optimizer record read locally; grads of \
         ZeRO-1 are whole until backward ends, then sharded, so after backward they count 4Ψ/N)"
    );
}

/// Step time of the sharded machinery at world size 1, and forward time of the decorator,
/// each against its plain counterpart, alternated so that drift affects both alike.
fn overhead(args: &Args) {
    let device = Default::default();
    let steps = args.timed_steps;
    let x = batch::<Train>(args.batch, args.width, 1, &device);
    let time_train = |sharded: bool| {
        let model = Deep::<Train>::new(args.width, args.layers, &device);
        let mut model = if sharded {
            let g = LocalGroup::new_world(1, Default::default())
                .pop()
                .expect("one rank");
            shard(model, Arc::new(g), ShardConfig::new(Strategy::Zero3)).expect("shard")
        } else {
            model
        };
        let mut optim =
            ShardedOptimizer::<_, Flex>::new(AdamWConfig::new().init::<Train, Deep<Train>>());
        let mut total = 0.0;
        for i in 0..=steps {
            let t = Instant::now();
            let loss = model.forward(x.clone()).powf_scalar(2.0).mean();
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(1e-3, model, grads);
            if i > 0 {
                total += t.elapsed().as_secs_f64();
            }
        }
        total / steps as f64
    };
    let (mut plain, mut kiln) = (f64::MAX, f64::MAX);
    for _ in 0..3 {
        plain = plain.min(time_train(false));
        kiln = kiln.min(time_train(true));
    }
    println!(
        "training step at world size 1: Autodiff<Kiln<Flex>> ZeRO-3 {:.3} ms vs unsharded {:.3} ms: ratio {:.3}",
        kiln * 1e3,
        plain * 1e3,
        kiln / plain
    );

    let fwd = |f: &dyn Fn()| {
        let t = Instant::now();
        for _ in 0..steps {
            f();
        }
        t.elapsed().as_secs_f64() / steps as f64
    };
    let bare = Deep::<Flex>::new(args.width, args.layers, &device);
    let wrapped = Deep::<Kiln>::new(args.width, args.layers, &device);
    let xb = batch::<Flex>(args.batch, args.width, 1, &device);
    let xk = batch::<Kiln>(args.batch, args.width, 1, &device);
    let (mut tb, mut tk) = (f64::MAX, f64::MAX);
    for _ in 0..5 {
        tb = tb.min(fwd(&|| {
            let _ = bare.forward(xb.clone()).into_data();
        }));
        tk = tk.min(fwd(&|| {
            let _ = wrapped.forward(xk.clone()).into_data();
        }));
    }
    println!(
        "inference forward: Kiln<Flex> {:.3} ms vs Flex {:.3} ms: ratio {:.3}",
        tk * 1e3,
        tb * 1e3,
        tk / tb
    );
}

fn main() {
    kiln::shard::threads::keep_freed_memory();
    let args = Args::parse();
    memory_and_traffic(&args);
    overhead(&args);
}
