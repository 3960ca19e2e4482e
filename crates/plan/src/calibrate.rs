//! Micro-benchmarks of this machine, for the "cpu" profile.

use burn::backend::{Autodiff, Flex};
use burn::tensor::{Distribution, Tensor};
use kiln_comm::{BufMut, GroupOptions, LocalGroup, ProcessGroup, ReduceOp};
use kiln_shard::Shard;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

/// What this machine measured.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
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
    /// Bytes/s of a large elementwise op (read two, write one: 48 MiB moved).
    pub mem_bw: f64,
    /// One rank's `mem_bw` alone times the ranks, over one rank's on all cores (the
    /// machine's): how far the ranks slow each other streaming at once (0 for one rank).
    pub mem_contention: f64,
    /// The same for the bf16 elementwise kernels (`mem_bw_half`).
    pub half_contention: f64,
    /// The rate of the same add moving 768 KiB, 6 MiB, 24 MiB and 48 MiB (the buckets of
    /// [`crate::Work::bytes_by_size`]), as a multiple of `mem_bw` (the last is 1).
    pub bw_by_size: [f64; 4],
    /// Bytes/s of kiln's bf16 elementwise kernels (an add, a broadcast add, a scalar product
    /// and a sum over rows: their mean time per byte).
    pub mem_bw_half: f64,
    /// Seconds per small op through `Autodiff<Shard<Flex>>` (dispatch, autodiff's graph).
    pub op_overhead: f64,
    /// Seconds of an all-reduce of one value between two ranks as threads.
    pub message_latency: f64,
    /// When it was measured, seconds since the Unix epoch.
    pub measured_at: u64,
}

/// Each bench's median time, the benches timed in turns (one run of each per round), round
/// after round for at least [`ROUNDS`] rounds and [`WINDOW`] seconds. A step's time on a
/// shared VM moves by ~20% over seconds; the earlier calibration (the best of 3 to 8 runs of
/// each bench in a burst of ~30 ms) caught a fast or a slow phase whole, and the same layout's
/// plan moved by up to 40% between two calls. Sampled over a second, as a step's own kernels
/// are, and taken at the median, as the measured step time is.
fn medians<const N: usize>(mut benches: [&mut dyn FnMut() -> f64; N]) -> [f64; N] {
    // Warm: the first runs of an op pay the heap's growth (fresh pages faulted in), which a
    // training step's kernels, reusing the memory of the step before, do not.
    for f in benches.iter_mut() {
        for _ in 0..3 {
            f();
        }
    }
    let mut times: [Vec<f64>; N] = std::array::from_fn(|_| Vec::new());
    let start = Instant::now();
    let mut rounds = 0;
    while rounds < ROUNDS || start.elapsed().as_secs_f64() < WINDOW {
        for (f, t) in benches.iter_mut().zip(times.iter_mut()) {
            t.push(f());
        }
        rounds += 1;
    }
    times.map(|mut t| {
        t.sort_by(f64::total_cmp);
        t[t.len() / 2]
    })
}

/// The seconds `f` takes.
fn timed(f: impl FnOnce()) -> f64 {
    let at = Instant::now();
    f();
    at.elapsed().as_secs_f64()
}

/// The fewest rounds of [`medians`].
const ROUNDS: usize = 7;
/// The shortest time [`medians`] samples a group of benches over, seconds.
const WINDOW: f64 = 1.0;

/// Whether [`measure`] measures again instead of reading [`cache_path`]'s file (`kiln plan
/// --recalibrate`); what it measures replaces the file's entry.
static RECALIBRATE: AtomicBool = AtomicBool::new(false);

/// Makes the calibrations of this process measured, not read from the cache.
pub fn recalibrate() {
    RECALIBRATE.store(true, Ordering::Relaxed);
}

/// The file calibrations are kept in between runs: `$KILN_CALIBRATION` (`off`: none), else
/// `$XDG_CACHE_HOME/kiln/calibration.json`, else `~/.cache/kiln/calibration.json`.
pub fn cache_path() -> Option<PathBuf> {
    match std::env::var_os("KILN_CALIBRATION") {
        Some(p) if p == "off" => None,
        Some(p) if !p.is_empty() => Some(PathBuf::from(p)),
        _ => std::env::var_os("XDG_CACHE_HOME")
            .filter(|d| !d.is_empty())
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
            .map(|d| d.join("kiln").join("calibration.json")),
    }
}

/// What a cached calibration is valid for: this machine (its CPU, cores and memory), the
/// ranks and their threads, and the way kiln measures.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Key {
    cpu: String,
    cores: usize,
    memory: u64,
    ranks: usize,
    threads: usize,
    /// kiln's version and [`METHOD`]: another way of measuring is another calibration.
    method: String,
}

/// The way [`run`] measures; changed whenever it does.
const METHOD: u32 = 5;

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Entry {
    key: Key,
    calibration: Calibration,
}

fn key(ranks: usize, threads: usize) -> Key {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string());
    Key {
        cpu,
        cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        memory: physical_memory(),
        ranks,
        threads,
        method: format!("kiln {} method {METHOD}", env!("CARGO_PKG_VERSION")),
    }
}

fn read_cache(path: &Path) -> Vec<Entry> {
    std::fs::read(path)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default()
}

/// Keeps `entry` in the file at `path` (replacing its key's), written whole to a file beside
/// it and renamed over it, so that a planner reading it meanwhile reads the old or the new
/// whole. A cache that cannot be written is no error: the next run measures again.
fn write_cache(path: &Path, entry: Entry) {
    let mut entries = read_cache(path);
    entries.retain(|e| e.key != entry.key);
    entries.push(entry);
    let Ok(bytes) = serde_json::to_vec_pretty(&entries) else {
        return;
    };
    if let Some(dir) = path.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    let tmp = path.with_extension(format!("json.{}", std::process::id()));
    if std::fs::write(&tmp, bytes).is_ok() && std::fs::rename(&tmp, path).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}

/// What one of `ranks` ranks as threads of this machine gets: read from [`cache_path`]'s
/// file when this machine was calibrated for as many ranks before, else measured (about two
/// seconds, three with several ranks) and kept there. The kernels run in a pool of the
/// threads `kiln train` gives each rank, and where the ranks' threads outnumber the cores,
/// the rates are divided by how many share each core. Calibrating once per machine keeps the
/// plans of one sitting comparable: measured afresh, the same layout's plan moved by ~10%
/// from call to call on a shared VM.
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
    let key = key(ranks, threads);
    let path = cache_path();
    let cached = match (&path, RECALIBRATE.load(Ordering::Relaxed)) {
        (Some(path), false) => read_cache(path)
            .into_iter()
            .find(|e| e.key == key)
            .map(|e| e.calibration),
        _ => None,
    };
    let c = cached.unwrap_or_else(|| {
        let c = measure_now(ranks, threads);
        if let Some(path) = &path {
            write_cache(
                path,
                Entry {
                    key,
                    calibration: c,
                },
            );
        }
        c
    });
    DONE.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .push((ranks, c));
    c
}

fn measure_now(ranks: usize, threads: usize) -> Calibration {
    // Memory first, one rank's on all cores and then the ranks' own, before any product:
    // right after a calibration's products, Flex's f32 add of 16 MiB ran 4x slower for over a
    // second (9.6 ms against 2.4 ms; small adds not slowed; cause not found), which priced the
    // elementwise work of a step at twice what the step took, or made a rank's memory look 4x
    // slower than one rank's on all cores (and the plan of ZeRO-1 on 2 ranks 85% slow). The
    // first calibration of a process is clear of it; a later one (another number of ranks in
    // the same process) may not be.
    let all = (ranks > 1).then(|| {
        kiln_shard::threads::with_own_pool(kiln_shard::threads::per_rank(1).unwrap_or(1), streams)
    });
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let oversubscribed = ((ranks * threads) as f64 / cores as f64).max(1.0);
    let mut c = kiln_shard::threads::with_own_pool(threads, || run(streams()));
    c.matmul_f32 /= oversubscribed;
    c.matmul_half /= oversubscribed;
    c.mem_bw /= oversubscribed;
    c.mem_bw_half /= oversubscribed;
    c.op_overhead *= oversubscribed;
    if let Some(all) = all {
        // Memory: one rank's own rates (each rank's in turn when the others compute), and how
        // far they fall when several stream at once, for the plan to weigh by how much of its
        // step each rank streams ([`crate::Profile::mem_contention`]); the same for the
        // 16-bit kernels (conversions as much as memory). Capping each rank at its share of
        // the machine's rate (one rank's on all cores) priced every layout of 2 ranks 20-50%
        // slow.
        c.mem_contention = c.mem_bw * ranks as f64 / all.mem_bw;
        c.half_contention = c.mem_bw_half * ranks as f64 / all.mem_bw_half;
    }
    c
}

/// Elementwise rates: f32 bytes/s, its rates by size over it, bf16 bytes/s.
struct Streams {
    mem_bw: f64,
    bw_by_size: [f64; 4],
    mem_bw_half: f64,
}

fn streams() -> Streams {
    type B = Flex;
    type S = Shard<Flex>;
    let device = Default::default();
    // Measured before any product (see `measure_now`). Flex's f32 add of tensors of 256 KiB
    // to 16 MiB (the size of a step's activations, served from the heap as theirs are).
    let len = 1 << 22;
    let sizes = [1 << 16, 1 << 19, 1 << 21, len];
    let y = Tensor::<B, 1>::random([len], Distribution::Default, &device);
    let [mut add_small, mut add_medium, mut add_large, mut add] = sizes.map(|n| {
        let x = Tensor::<B, 1>::random([n], Distribution::Default, &device);
        let y = y.clone().slice(0..n);
        move || timed(|| drop(x.clone() + y.clone()))
    });
    // kiln's bf16 elementwise kernels through the decorator, as a step runs them: Flex's
    // same-shape bf16 add streams at ~40% of f32's rate, but a broadcast, a scalar op and a
    // reduction over rows run at 2x to 7x its time per byte (widened and rounded piece by
    // piece, or Flex's scalar loops); one op of each, their mean time per byte. (With the add
    // alone the planner priced a bf16 step as an f32 one: 38% under the measured time.)
    let bf16 = burn::tensor::DType::BF16;
    let x16 = Tensor::<S, 1>::random([len], Distribution::Default, &device).cast(bf16);
    let y16 = Tensor::<S, 1>::random([len], Distribution::Default, &device).cast(bf16);
    let rows = x16.clone().reshape([len / 1024, 1024]);
    let row = Tensor::<S, 2>::random([1, 1024], Distribution::Default, &device).cast(bf16);
    let [
        add,
        add_small,
        add_medium,
        add_large,
        add16,
        broadcast16,
        scalar16,
        sum16,
    ] = medians([
        &mut add,
        &mut add_small,
        &mut add_medium,
        &mut add_large,
        &mut || timed(|| drop(x16.clone() + y16.clone())),
        &mut || timed(|| drop(rows.clone() + row.clone())),
        &mut || timed(|| drop(x16.clone().mul_scalar(1.5))),
        &mut || timed(|| drop(rows.clone().sum_dim(1))),
    ]);
    let mem_bw = 3.0 * (len * 4) as f64 / add;
    let times = [add_small, add_medium, add_large, add];
    let bw_by_size: [f64; 4] =
        std::array::from_fn(|k| (3.0 * (sizes[k] * 4) as f64 / times[k] / mem_bw).max(1.0));
    let bytes = (len * 2) as f64;
    let seconds_per_byte = [
        add16 / (3.0 * bytes),
        broadcast16 / (2.0 * bytes),
        scalar16 / (2.0 * bytes),
        sum16 / bytes,
    ];
    let mem_bw_half = seconds_per_byte.len() as f64 / seconds_per_byte.iter().sum::<f64>();
    Streams {
        mem_bw,
        bw_by_size,
        mem_bw_half,
    }
}

/// The products, the op overhead and a message's latency, with the `streams` measured before.
fn run(streams: Streams) -> Calibration {
    type B = Flex;
    type S = Shard<Flex>;
    let device = Default::default();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let Streams {
        mem_bw,
        bw_by_size,
        mem_bw_half,
    } = streams;

    // The products: f32 at one shape and at the depths of [`crate::Work::flops_by_depth`];
    // kiln's 16-bit matmul on this CPU through the decorator under a bf16 policy (operands
    // narrowed, the product computed and widened as a training step does); and the time of a
    // small op through `Autodiff<Shard<Flex>>`, 2000 in a row.
    let (m, k, n) = (512, 1024, 1024);
    let a = Tensor::<B, 2>::random([m, k], Distribution::Default, &device);
    let b = Tensor::<B, 2>::random([k, n], Distribution::Default, &device);
    let deep = [32, 128, 512, 2048].map(|depth| {
        (
            Tensor::<B, 2>::random([512, depth], Distribution::Default, &device),
            Tensor::<B, 2>::random([depth, 512], Distribution::Default, &device),
        )
    });
    let a16 = Tensor::<S, 2>::random([m, k], Distribution::Default, &device);
    let b16 = Tensor::<S, 2>::random([k, n], Distribution::Default, &device);
    type K = Autodiff<Shard<Flex>>;
    let ops = 2000;
    let small = Tensor::<K, 1>::random([16], Distribution::Default, &device);
    let product = |(a, b): &(Tensor<B, 2>, Tensor<B, 2>)| {
        let _ = a.clone().matmul(b.clone()).into_data();
    };
    let [f32_product, d32, d128, d512, d2048, half_product, chain] = medians([
        &mut || timed(|| product(&(a.clone(), b.clone()))),
        &mut || timed(|| product(&deep[0])),
        &mut || timed(|| product(&deep[1])),
        &mut || timed(|| product(&deep[2])),
        &mut || timed(|| product(&deep[3])),
        &mut || {
            timed(|| {
                kiln_shard::autocast(kiln_shard::Precision::BF16, || {
                    let _ = a16.clone().matmul(b16.clone()).into_data();
                })
            })
        },
        &mut || {
            let mut v = small.clone().require_grad();
            let t = timed(|| {
                for _ in 0..ops {
                    v = v.clone().mul_scalar(1.0001);
                }
            });
            // Untimed, the graph taken apart by a backward pass: autodiff's bookkeeping is
            // one for the process, and the nodes of chains merely dropped stay in it until a
            // backward pass, which then walks them all (the 40,000 of a calibration's rounds
            // made the simulated step that follows 12x slower).
            let _ = v.sum().backward();
            t
        },
    ]);
    let matmul_f32 = 2.0 * (m * k * n) as f64 / f32_product;
    let depth_efficiency = [(32, d32), (128, d128), (512, d512), (2048, d2048)]
        .map(|(depth, t)| (2.0 * (512 * 512 * depth) as f64 / t / matmul_f32).min(1.0));
    let matmul_half = 2.0 * (m * k * n) as f64 / half_product;
    let op_overhead = chain / ops as f64;

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
        bw_by_size,
        mem_contention: 0.0,
        half_contention: 0.0,
        mem_bw_half,
        op_overhead,
        message_latency,
        measured_at: now(),
    }
}

/// Seconds since the Unix epoch.
pub(crate) fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
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

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(ranks: usize, rate: f64) -> Entry {
        Entry {
            key: key(ranks, 1),
            calibration: Calibration {
                cores: 2,
                matmul_f32: rate,
                depth_efficiency: [0.5, 1.0, 1.0, 1.0],
                matmul_half: rate / 2.0,
                mem_bw: 1e10,
                mem_contention: 1.5,
                half_contention: 1.2,
                bw_by_size: [1.2, 1.1, 1.0, 1.0],
                mem_bw_half: 2e9,
                op_overhead: 1e-6,
                message_latency: 3e-5,
                measured_at: 1_800_000_000,
            },
        }
    }

    #[test]
    fn the_cache_keeps_one_calibration_per_key_and_reads_back_what_it_kept() {
        let dir = std::env::temp_dir().join(format!("kiln-cal-{}", std::process::id()));
        let path = dir.join("nested").join("calibration.json");
        assert!(read_cache(&path).is_empty(), "no file: nothing cached");
        write_cache(&path, entry(1, 1e11));
        write_cache(&path, entry(2, 5e10));
        write_cache(&path, entry(1, 2e11));
        let kept = read_cache(&path);
        assert_eq!(kept.len(), 2, "{kept:?}");
        let one = kept.iter().find(|e| e.key.ranks == 1).unwrap();
        assert_eq!(
            one.calibration,
            entry(1, 2e11).calibration,
            "the newer replaced it"
        );
        assert_eq!(
            kept.iter()
                .find(|e| e.key.ranks == 2)
                .unwrap()
                .calibration
                .matmul_f32,
            5e10
        );
        // Another way of measuring is another key: not read as this one.
        let mut other = key(1, 1);
        other.method.push('x');
        assert!(kept.iter().all(|e| e.key != other));
        // A damaged file reads as empty (measured again), not as an error.
        std::fs::write(&path, b"{ not json").unwrap();
        assert!(read_cache(&path).is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
