//! Micro-benchmarks of this machine, for the "cpu" profile.

use burn::backend::{Autodiff, Flex};
use burn::tensor::{Distribution, Tensor};
use kiln_comm::{BufMut, GroupOptions, LocalGroup, ProcessGroup, ReduceOp};
use kiln_shard::Shard;
use std::sync::Mutex;
use std::time::Instant;

/// What this machine measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Calibration {
    /// Cores (threads the kernels use).
    pub cores: usize,
    /// f32 matmul FLOP/s of one rank.
    pub matmul_f32: f64,
    /// The share of the f32 matmul rate reached by [512, K] x [K, 512] products of K = 32,
    /// 128, 512 and 2048 (the depth buckets of [`crate::Work::flops_by_depth`]).
    pub depth_efficiency: [f64; 4],
    /// The FLOP/s of a matmul through kiln's decorator under a bf16 policy.
    pub matmul_half: f64,
    /// Bytes/s of a large elementwise op (read two, write one).
    pub mem_bw: f64,
    /// Bytes/s of kiln's bf16 elementwise kernels (an add, a broadcast add, a scalar product
    /// and a sum over rows: their mean time per byte).
    pub mem_bw_half: f64,
    /// Seconds per small op through `Autodiff<Shard<Flex>>` (dispatch, autodiff's graph).
    pub op_overhead: f64,
    /// Seconds of an all-reduce of one value between two ranks as threads.
    pub message_latency: f64,
}

fn best(reps: usize, mut f: impl FnMut()) -> f64 {
    // Warm: the first runs of an op pay the heap's growth (fresh pages faulted in), which a
    // training step's kernels, reusing the memory of the step before, do not.
    for _ in 0..3 {
        f();
    }
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

/// Measures what one of `ranks` ranks as threads of this machine gets (about a second, once
/// per process and number of ranks): the kernels run in a pool of the threads `kiln train`
/// gives each rank, and where the ranks' threads outnumber the cores, the rates are divided
/// by how many share each core.
pub fn measure(ranks: usize) -> Calibration {
    static DONE: Mutex<Vec<(usize, Calibration)>> = Mutex::new(Vec::new());
    let ranks = ranks.max(1);
    if let Some((_, c)) = DONE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .iter()
        .find(|(r, _)| *r == ranks)
    {
        return *c;
    }
    let threads = kiln_shard::threads::per_rank(ranks).unwrap_or(1);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let oversubscribed = ((ranks * threads) as f64 / cores as f64).max(1.0);
    let mut c = kiln_shard::threads::with_own_pool(threads, run);
    c.cores = cores;
    c.matmul_f32 /= oversubscribed;
    c.matmul_half /= oversubscribed;
    c.mem_bw /= oversubscribed;
    c.mem_bw_half /= oversubscribed;
    c.op_overhead *= oversubscribed;
    // The ranks stream memory at once: each gets at most its share of the machine's.
    if ranks > 1 {
        let all = measure(1).mem_bw;
        c.mem_bw = c.mem_bw.min(all / ranks as f64);
        let all_half = measure(1).mem_bw_half;
        c.mem_bw_half = c.mem_bw_half.min(all_half / ranks as f64);
    }
    DONE.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .push((ranks, c));
    c
}

fn run() -> Calibration {
    type B = Flex;
    let device = Default::default();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    // 16 MiB tensors: the size of a step's activations, served from the heap as theirs are.
    // Measured first: right after the matrix products below, Flex's f32 add ran 4x slower on
    // this machine's AVX-512 CPU for the next several calls (9.6 ms against 2.4 ms; cause not
    // found), which priced the elementwise work of a step at twice what the step took.
    let len = 1 << 22;
    let x = Tensor::<B, 1>::random([len], Distribution::Default, &device);
    let y = Tensor::<B, 1>::random([len], Distribution::Default, &device);
    let t = best(8, || {
        let z = x.clone() + y.clone();
        drop(z);
    });
    let mem_bw = 3.0 * (len * 4) as f64 / t;
    // kiln's bf16 elementwise kernels through the decorator, as a step runs them: Flex's
    // same-shape bf16 add streams at ~40% of f32's rate, but a broadcast, a scalar op and a
    // reduction over rows run at 2x to 7x its time per byte (widened and rounded piece by
    // piece, or Flex's scalar loops); one op of each, their mean time per byte. (With the add
    // alone the planner priced a bf16 step as an f32 one: 38% under the measured time.)
    type S = Shard<Flex>;
    let bf16 = burn::tensor::DType::BF16;
    let x16 = Tensor::<S, 1>::random([len], Distribution::Default, &device).cast(bf16);
    let y16 = Tensor::<S, 1>::random([len], Distribution::Default, &device).cast(bf16);
    let rows = x16.clone().reshape([len / 1024, 1024]);
    let row = Tensor::<S, 2>::random([1, 1024], Distribution::Default, &device).cast(bf16);
    let bytes = (len * 2) as f64;
    let seconds_per_byte = [
        best(8, || drop(x16.clone() + y16.clone())) / (3.0 * bytes),
        best(8, || drop(rows.clone() + row.clone())) / (2.0 * bytes),
        best(8, || drop(x16.clone().mul_scalar(1.5))) / (2.0 * bytes),
        best(8, || drop(rows.clone().sum_dim(1))) / bytes,
    ];
    let mem_bw_half = seconds_per_byte.len() as f64 / seconds_per_byte.iter().sum::<f64>();
    let (m, k, n) = (512, 1024, 1024);
    let a = Tensor::<B, 2>::random([m, k], Distribution::Default, &device);
    let b = Tensor::<B, 2>::random([k, n], Distribution::Default, &device);
    let t = best(3, || {
        let c = a.clone().matmul(b.clone());
        let _ = c.into_data();
    });
    let matmul_f32 = 2.0 * (m * k * n) as f64 / t;
    let depth_efficiency = [32, 128, 512, 2048].map(|depth| {
        let a = Tensor::<B, 2>::random([512, depth], Distribution::Default, &device);
        let b = Tensor::<B, 2>::random([depth, 512], Distribution::Default, &device);
        let t = best(3, || {
            let _ = a.clone().matmul(b.clone()).into_data();
        });
        (2.0 * (512 * 512 * depth) as f64 / t / matmul_f32).min(1.0)
    });

    // kiln's 16-bit matmul on this CPU: through the decorator under a bf16 policy (operands
    // narrowed, the product computed and widened as a training step does).
    let a16 = Tensor::<S, 2>::random([m, k], Distribution::Default, &device);
    let b16 = Tensor::<S, 2>::random([k, n], Distribution::Default, &device);
    let t = best(3, || {
        kiln_shard::autocast(kiln_shard::Precision::BF16, || {
            let c = a16.clone().matmul(b16.clone());
            let _ = c.into_data();
        })
    });
    let matmul_half = 2.0 * (m * k * n) as f64 / t;

    type K = Autodiff<Shard<Flex>>;
    let ops = 2000;
    let small = Tensor::<K, 1>::random([16], Distribution::Default, &device).require_grad();
    let t = best(3, || {
        let mut v = small.clone();
        for _ in 0..ops {
            v = v.mul_scalar(1.0001);
        }
        drop(v);
    });
    let op_overhead = t / ops as f64;

    let groups = LocalGroup::new_world(2, GroupOptions::default());
    let calls = 200;
    let times: Vec<f64> = std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .map(|g| {
                s.spawn(move || {
                    let mut v = [1.0f32];
                    let _ = g.all_reduce(BufMut::F32(&mut v), ReduceOp::Sum);
                    let t = Instant::now();
                    for _ in 0..calls {
                        let _ = g.all_reduce(BufMut::F32(&mut v), ReduceOp::Sum);
                    }
                    t.elapsed().as_secs_f64() / calls as f64
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or(0.0))
            .collect()
    });
    let message_latency = times.iter().copied().fold(0.0, f64::max);

    Calibration {
        cores,
        matmul_f32,
        matmul_half,
        depth_efficiency,
        mem_bw,
        mem_bw_half,
        op_overhead,
        message_latency,
    }
}

/// This machine's memory, bytes (`/proc/meminfo`; 16 GiB where it cannot be read).
pub fn physical_memory() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kib| kib.parse::<u64>().ok())
        })
        .map_or(16 << 30, |kib| kib * 1024)
}
