//! Hardware profiles: what a device computes and moves per second.
//!
//! The GPU profiles are the vendors' published dense peaks (no sparsity) and link speeds, with
//! one efficiency factor each (the share of peak that training kernels reach, see
//! [`Profile::efficiency`]); "cpu" is this machine, calibrated by micro-benchmarks
//! ([`calibrate_cpu`]).

use serde::Serialize;

/// A device and its links.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Profile {
    /// The name `--gpu` takes.
    pub name: String,
    /// What it is.
    pub description: String,
    /// Bytes of device memory per rank.
    pub memory: f64,
    /// Bytes of every rank's memory the runtime takes before the job's tensors (CUDA context,
    /// allocator reserve).
    pub reserved: f64,
    /// Dense f32 FLOP/s (a matmul in f32; no TF32).
    pub peak_f32: f64,
    /// Dense bf16/f16 FLOP/s (tensor cores).
    pub peak_half: f64,
    /// The share of the peak a contraction reaches by the depth of its contracted dimension
    /// (below 64, 256, 1024, and more: [`crate::Work::flops_by_depth`]).
    pub depth_efficiency: [f64; 4],
    /// Device memory bandwidth, bytes/s.
    pub mem_bw: f64,
    /// How far the ranks sharing this machine's memory slow each other when all stream from
    /// it at once: one rank's rate alone (`mem_bw`) times the ranks sharing it, over the
    /// machine's (0 where each has its own memory: GPUs, one rank). A rank streaming while
    /// `k` others do runs at `mem_bw / max(1, contention (k + 1) / sharing)`.
    pub mem_contention: f64,
    /// The same for the 16-bit elementwise kernels (`mem_bw_half`).
    pub half_contention: f64,
    /// The rate of f32 elementwise ops by the bytes each moves (the buckets of
    /// [`crate::Work::bytes_by_size`]), as a multiple of `mem_bw`: 1 on GPUs, above 1 on a CPU
    /// whose caches hold the smaller working sets.
    pub bw_by_size: [f64; 4],
    /// The rate of elementwise ops on 16-bit data, bytes/s (the bandwidth on GPUs; on CPUs
    /// Flex converts each element, much slower).
    pub mem_bw_half: f64,
    /// Bandwidth between ranks of one node, bytes/s per rank and direction.
    pub intra_bw: f64,
    /// Latency of a message between ranks of one node, seconds.
    pub intra_lat: f64,
    /// Bandwidth between nodes, bytes/s per rank and direction.
    pub inter_bw: f64,
    /// Latency of a message between nodes, seconds.
    pub inter_lat: f64,
    /// Time per op beyond its arithmetic (dispatch, kernel launch), seconds.
    pub op_overhead: f64,
    /// Ranks per node.
    pub per_node: usize,
    /// The share of the peaks (FLOP/s and bandwidth) that a training step's kernels reach.
    pub efficiency: f64,
    /// Where the efficiency comes from.
    pub efficiency_source: String,
    /// Ranks that share this device's memory (ranks as threads of one machine), else 1. The
    /// rates above are one rank's.
    pub sharing: usize,
}

const GB: f64 = 1e9;
const GIB: f64 = (1u64 << 30) as f64;
const T: f64 = 1e12;

/// GPU efficiency: the share of peak that Burn's CUDA kernels reached in kiln's one measurement
/// on an H200 (README, 2026-12-04: GPT-2 124M's shape, 8 x 1024 tokens, f32: 18.7k tokens/s,
/// about 0.33x PyTorch eager), taken as 0.35 of peak for the whole step; PyTorch eager on the
/// same GPU reaches torchtitan's published 33-39% MFU.
const GPU_EFFICIENCY: f64 = 0.35;
const GPU_SOURCE: &str = "0.35: torchtitan's published MFU for Llama 3.1 8B on 8 H100 \
    (33-39%), the order kiln's one H200 measurement reached; not calibrated on this GPU";

#[allow(clippy::too_many_arguments)]
fn gpu(
    name: &str,
    description: &str,
    memory_gib: f64,
    f32_tflops: f64,
    half_tflops: f64,
    mem_tbs: f64,
    intra_gbs: f64,
    inter_gbs: f64,
) -> Profile {
    Profile {
        name: name.into(),
        description: description.into(),
        memory: memory_gib * GIB,
        reserved: 1.0 * GIB,
        peak_f32: f32_tflops * T,
        peak_half: half_tflops * T,
        // Not measured on GPUs: the efficiency factor stands for all depths.
        depth_efficiency: [1.0; 4],
        bw_by_size: [1.0; 4],
        mem_contention: 0.0,
        half_contention: 0.0,
        mem_bw: mem_tbs * T,
        mem_bw_half: mem_tbs * T,
        intra_bw: intra_gbs * GB,
        intra_lat: 10e-6,
        inter_bw: inter_gbs * GB,
        inter_lat: 20e-6,
        op_overhead: 8e-6,
        per_node: 8,
        efficiency: GPU_EFFICIENCY,
        efficiency_source: GPU_SOURCE.into(),
        sharing: 1,
    }
}

/// The shipped GPU profiles (published dense peaks; NVLink per direction; one 400 Gb/s NIC
/// per GPU for H100/H200, 200 Gb/s for A100 and L40S).
pub fn gpus() -> Vec<Profile> {
    vec![
        gpu(
            "h100",
            "NVIDIA H100 SXM 80 GB (NVLink 4)",
            80.0,
            67.0,
            989.0,
            3.35,
            450.0,
            50.0,
        ),
        gpu(
            "h100-pcie",
            "NVIDIA H100 PCIe 80 GB (PCIe 5)",
            80.0,
            51.0,
            756.0,
            2.0,
            64.0,
            50.0,
        ),
        gpu(
            "h200",
            "NVIDIA H200 SXM 141 GB (NVLink 4)",
            141.0,
            67.0,
            989.0,
            4.8,
            450.0,
            50.0,
        ),
        gpu(
            "a100-40gb",
            "NVIDIA A100 SXM 40 GB (NVLink 3)",
            40.0,
            19.5,
            312.0,
            1.555,
            300.0,
            25.0,
        ),
        gpu(
            "a100-80gb",
            "NVIDIA A100 SXM 80 GB (NVLink 3)",
            80.0,
            19.5,
            312.0,
            2.039,
            300.0,
            25.0,
        ),
        gpu(
            "l40s",
            "NVIDIA L40S 48 GB (PCIe 4, no NVLink)",
            48.0,
            91.6,
            362.0,
            0.864,
            32.0,
            25.0,
        ),
    ]
}

/// The profile named `name` (`cpu`: this machine, calibrated, for `ranks` ranks as threads).
///
/// # Errors
/// An unknown name, with the list.
pub fn profile(name: &str, ranks: usize) -> Result<Profile, String> {
    if name == "cpu" {
        return Ok(calibrate_cpu(ranks));
    }
    let all = gpus();
    let alias = match name {
        "h100-sxm" => "h100",
        "a100" => "a100-80gb",
        n => n,
    };
    all.iter()
        .find(|p| p.name == alias)
        .cloned()
        .ok_or_else(|| {
            let names: Vec<String> = all.iter().map(|p| p.name.clone()).collect();
            format!(
                "unknown GPU profile '{name}': kiln knows {}, and cpu (this machine)",
                names.join(", ")
            )
        })
}

/// This machine's CPU, measured: f32 matmul FLOP/s and memory bandwidth on all its cores
/// (Burn's Flex, as kiln runs it), the time of a small op through kiln's decorator, and a
/// message between ranks as threads. `ranks` ranks as threads share the cores.
pub fn calibrate_cpu(ranks: usize) -> Profile {
    let c = crate::calibrate::measure(ranks);
    let memory = crate::calibrate::physical_memory() as f64;
    let age = crate::calibrate::now().saturating_sub(c.measured_at);
    let when = match age {
        a if a < 60 => "now".to_string(),
        a if a < 7200 => format!("{} min ago", a / 60),
        a if a < 172_800 => format!("{} h ago", a / 3600),
        a => format!("{} days ago", a / 86400),
    };
    let kept = match crate::calibrate::cache_path() {
        Some(p) => format!("kept in {}; --recalibrate measures again", p.display()),
        None => "not kept".into(),
    };
    Profile {
        name: "cpu".into(),
        description: format!(
            "this machine: {} cores, {:.1} GiB (calibrated {when} per rank of {}: f32 matmul \
             {:.1} GFLOP/s, bf16 {:.1} GFLOP/s, memory {:.1} GB/s alone ({:.2}x slower when \
             all ranks stream), bf16 elementwise {:.1} GB/s, {:.1} us per op; {kept})",
            c.cores,
            memory / GIB,
            ranks.max(1),
            c.matmul_f32 / 1e9,
            c.matmul_half / 1e9,
            c.mem_bw / 1e9,
            c.mem_contention.max(1.0),
            c.mem_bw_half / 1e9,
            c.op_overhead * 1e6
        ),
        // Ranks as threads share the machine's memory: the plan checks their sum.
        memory,
        reserved: 0.0,
        peak_f32: c.matmul_f32,
        peak_half: c.matmul_half,
        depth_efficiency: c.depth_efficiency,
        bw_by_size: c.bw_by_size,
        mem_contention: c.mem_contention,
        half_contention: c.half_contention,
        mem_bw: c.mem_bw,
        mem_bw_half: c.mem_bw_half,
        intra_bw: c.mem_bw / 2.0,
        intra_lat: c.message_latency,
        inter_bw: 1.25 * GB,
        inter_lat: 50e-6,
        op_overhead: c.op_overhead,
        per_node: ranks.max(1),
        efficiency: 1.0,
        efficiency_source: "1.0: the peaks are this machine's measured rates".into(),
        sharing: ranks.max(1),
    }
}
