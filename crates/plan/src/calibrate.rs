//! Micro-benchmarks of this machine, for the "cpu" profile.

use burn::backend::{Autodiff, Flex};
use burn::tensor::{Distribution, Tensor};
use kiln_comm::{BufMut, GroupOptions, LocalGroup, ProcessGroup, ReduceOp};
use kiln_shard::Shard;
use std::sync::OnceLock;
use std::time::Instant;

/// What this machine measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Calibration {
    /// Cores (threads the kernels use).
    pub cores: usize,
    /// f32 matmul FLOP/s on all cores.
    pub matmul_f32: f64,
    /// The rate of kiln's bf16/f16 matmuls on the CPU: they run Flex's f32 GEMM on widened
    /// operands (`ops/fast.rs`), so the f32 rate.
    pub matmul_half: f64,
    /// Bytes/s of a large elementwise op (read two, write one).
    pub mem_bw: f64,
    /// Seconds per small op through `Autodiff<Shard<Flex>>` (dispatch, autodiff's graph).
    pub op_overhead: f64,
    /// Seconds of an all-reduce of one value between two ranks as threads.
    pub message_latency: f64,
}

fn best(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

/// Measures this machine once per process (about a second).
pub fn measure() -> Calibration {
    static ONCE: OnceLock<Calibration> = OnceLock::new();
    *ONCE.get_or_init(run)
}

fn run() -> Calibration {
    type B = Flex;
    let device = Default::default();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let (m, k, n) = (512, 1024, 1024);
    let a = Tensor::<B, 2>::random([m, k], Distribution::Default, &device);
    let b = Tensor::<B, 2>::random([k, n], Distribution::Default, &device);
    let t = best(3, || {
        let c = a.clone().matmul(b.clone());
        let _ = c.into_data();
    });
    let matmul_f32 = 2.0 * (m * k * n) as f64 / t;

    let len = 1 << 24;
    let x = Tensor::<B, 1>::random([len], Distribution::Default, &device);
    let y = Tensor::<B, 1>::random([len], Distribution::Default, &device);
    let t = best(3, || {
        let z = x.clone() + y.clone();
        drop(z);
    });
    let mem_bw = 3.0 * (len * 4) as f64 / t;

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
        matmul_half: matmul_f32,
        mem_bw,
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
