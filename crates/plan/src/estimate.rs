//! From a simulated step to memory, time and cost on a hardware profile.

use crate::group::{Collective, Event, Kind, What};
use crate::profile::Profile;
use crate::shapes::{Phase, Phases, Work};
use crate::simulate::{RoleRun, Simulated};
use kiln_pipe::{Schedule, ScheduleKind};
use kiln_shard::account::MemKind;
use serde::Serialize;

/// One rank's memory at its step's peak, by part (bytes).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Memory {
    /// The most bytes held at once during the step (what must fit), plus the profile's
    /// reserve.
    pub peak: f64,
    /// Parameters (this rank's part).
    pub params: f64,
    /// Gradients the optimizer receives (this rank's part).
    pub grads: f64,
    /// Optimizer state (this rank's part).
    pub optimizer: f64,
    /// Everything held when the step began (parameters, optimizer state, data).
    pub held_before: f64,
    /// Activations: the forward's peak above the step's start.
    pub activations: f64,
    /// The backward's peak above the step's start (gradients, recomputed activations).
    pub backward: f64,
    /// Whole parameters gathered from shards (ZeRO-3, hybrid), at their peak.
    pub gathered: f64,
    /// Communication buffers at their peak.
    pub comm: f64,
    /// The runtime's reserve (CUDA context), counted in `peak`.
    pub reserved: f64,
}

/// One simulated role's step on the profile.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RolePlan {
    /// The rank simulated.
    pub rank: usize,
    /// Its pipeline stage.
    pub stage: usize,
    /// Its memory.
    pub memory: Memory,
    /// Its work in the step.
    pub work: Work,
    /// Seconds of compute: forward, backward, the rest (optimizer).
    pub compute_s: [f64; 3],
    /// Seconds the compute thread waited on collectives it issued.
    pub comm_blocking_s: f64,
    /// Seconds of collectives issued by communication threads (overlapping compute).
    pub comm_overlapped_s: f64,
    /// Of those, the seconds not hidden behind compute.
    pub comm_exposed_s: f64,
    /// Bytes of collectives in the step, by kind (all-reduce, all-gather, reduce-scatter,
    /// broadcast, send).
    pub comm_bytes: [f64; 5],
    /// The rank's own step time (its timeline replayed, before pipeline bubbles).
    pub step_s: f64,
}

/// A layout's plan on a profile.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Plan {
    /// The profile's name.
    pub profile: String,
    /// Ranks (GPUs).
    pub world: usize,
    /// Whether every rank's peak fits its memory.
    pub fits: bool,
    /// The largest peak over ranks, bytes.
    pub peak: f64,
    /// Seconds per step.
    pub step_s: f64,
    /// The pipeline's bubble (idle share), when pipelined.
    pub bubble: Option<f64>,
    /// Tokens per step (all ranks).
    pub tokens_per_step: f64,
    /// Tokens per second per rank.
    pub tokens_per_s_per_gpu: f64,
    /// FLOPs executed (recomputation included) over the peak of the step's compute dtype.
    pub flop_utilisation: f64,
    /// The roles, in stage order.
    pub roles: Vec<RolePlan>,
    /// Seconds the simulation took.
    pub simulated_in_s: f64,
}

/// The time a collective takes on the profile (ring algorithms, NCCL's cost model:
/// latency per step plus bytes over bandwidth).
pub fn comm_time(c: &Collective, p: &Profile) -> f64 {
    let n = c.ranks.max(1) as f64;
    let (bw, lat) = match c.inter_node {
        true => (p.inter_bw, p.inter_lat),
        false => (p.intra_bw, p.intra_lat),
    };
    let bw = bw * p.efficiency.max(0.5);
    let b = c.bytes as f64;
    match c.kind {
        Kind::AllReduce => 2.0 * (n - 1.0) * lat + 2.0 * (n - 1.0) / n * b / bw,
        Kind::AllGather | Kind::ReduceScatter => (n - 1.0) * lat + (n - 1.0) / n * b / bw,
        Kind::Broadcast => n.log2().ceil() * lat + b / bw,
        Kind::Send => lat + b / bw,
    }
}

/// Seconds of compute for `w` on the profile, by one rank whose memory no other rank streams
/// from meanwhile.
pub fn compute_time(w: &Work, p: &Profile) -> f64 {
    compute_time_shared(w, p, Slowdown::NONE)
}

/// How many times slower than alone a rank moves bytes while others share its memory.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Slowdown {
    /// f32 elementwise bytes beyond the caches (the buckets of 8 MiB and more).
    f32: f64,
    /// 16-bit elementwise bytes.
    half: f64,
}

impl Slowdown {
    const NONE: Slowdown = Slowdown {
        f32: 1.0,
        half: 1.0,
    };
}

/// Seconds of compute for `w`, its elementwise bytes moved `slowdown` times slower than alone.
fn compute_time_shared(w: &Work, p: &Profile, slowdown: Slowdown) -> f64 {
    let e = p.efficiency;
    // The contractions' share of the peak, weighted by their FLOPs at each depth.
    let total: f64 = w.flops_by_depth.iter().sum();
    let depth = match total > 0.0 {
        true => {
            total
                / w.flops_by_depth
                    .iter()
                    .zip(p.depth_efficiency)
                    .map(|(f, d)| f / d.max(1e-3))
                    .sum::<f64>()
        }
        false => 1.0,
    };
    let (cached, beyond) = elementwise_bytes(w, p);
    let elementwise = cached + beyond * slowdown.f32;
    (w.flops_f32 / (p.peak_f32 * e) + w.flops_half / (p.peak_half * e)) / depth
        + (elementwise + w.contraction_bytes) / (p.mem_bw * e)
        + w.bytes_half * slowdown.half / (p.mem_bw_half * e)
        + w.ops as f64 * p.op_overhead
}

fn kind_index(k: Kind) -> usize {
    match k {
        Kind::AllReduce => 0,
        Kind::AllGather => 1,
        Kind::ReduceScatter => 2,
        Kind::Broadcast => 3,
        Kind::Send => 4,
    }
}

fn memory(r: &RoleRun, p: &Profile) -> Memory {
    let s = &r.memory.step;
    let kind = |k: MemKind| s.peak_of(k) as f64;
    Memory {
        peak: s.peak as f64 + p.reserved,
        params: s.params as f64,
        grads: s.grads as f64,
        optimizer: r.memory.optimizer as f64,
        held_before: s.held_before as f64,
        activations: kind(MemKind::Activations),
        backward: kind(MemKind::Backward),
        gathered: kind(MemKind::Gathered),
        comm: kind(MemKind::Comm),
        reserved: p.reserved,
    }
}

/// Replays one role's step on the profile: compute between events, collectives issued by the
/// compute thread waited for, those of communication threads queued one after another and
/// overlapping compute; the step ends when both are done.
fn replay(r: &RoleRun, p: &Profile) -> RolePlan {
    let events: &[Event] = &r.events;
    let first = events.first().map(|e| e.phases).unwrap_or_default();
    let last = events.last().map(|e| e.phases).unwrap_or_default();
    let phases: Phases = last.since(&first);
    let slowdown = contention(&phases.total(), p);
    let compute_time = |w: &Work, p: &Profile| compute_time_shared(w, p, slowdown);
    let compute_s = [
        compute_time(&phases.of(Phase::Forward), p),
        compute_time(&phases.of(Phase::Backward), p),
        compute_time(&phases.of(Phase::Other), p),
    ];
    let (mut t, mut queue_free) = (0.0f64, 0.0f64);
    let (mut blocking, mut overlapped) = (0.0, 0.0);
    let mut comm_bytes = [0.0; 5];
    let mut prev = first.total();
    for e in events {
        t += compute_time(&e.at.since(&prev), p);
        prev = e.at;
        if let What::Comm(c) = e.what {
            let d = comm_time(&c, p);
            comm_bytes[kind_index(c.kind)] += c.bytes as f64;
            match c.blocking {
                true => {
                    t += d;
                    blocking += d;
                }
                false => {
                    queue_free = queue_free.max(t) + d;
                    overlapped += d;
                }
            }
        }
    }
    let end = t.max(queue_free);
    RolePlan {
        rank: r.rank,
        stage: r.stage,
        memory: memory(r, p),
        work: phases.total(),
        compute_s,
        comm_blocking_s: blocking,
        comm_overlapped_s: overlapped,
        comm_exposed_s: end - t,
        comm_bytes,
        step_s: end,
    }
}

/// `w`'s f32 elementwise bytes, each divided by its working set's rate over memory's (so at
/// memory's rate they take as long): those the caches hold (below 8 MiB, and any not bucketed,
/// none from the shape backend) and those beyond them, which ranks sharing memory slow.
fn elementwise_bytes(w: &Work, p: &Profile) -> (f64, f64) {
    let at = |k: usize| w.bytes_by_size[k] / p.bw_by_size[k].max(1e-3);
    let unbucketed = (w.bytes - w.bytes_by_size.iter().sum::<f64>()).max(0.0);
    (at(0) + at(1) + unbucketed, at(2) + at(3))
}

/// How much slower a rank doing `w` streams from memory for the other ranks sharing it
/// (ranks as threads of one machine), on average: each of the `sharing - 1` others streams
/// for the share `s` of its step that this rank's own streaming takes (the ranks do the same
/// work, their ops not in step), so `k` of them stream at once with the binomial's
/// probability, and a byte moved then costs `max(1, contention (k + 1) / sharing)` times
/// its time alone (the profile's contention of f32 streams, and of its 16-bit kernels).
/// Full contention (every rank streaming all the time) priced a ZeRO step of 2 ranks 20-50%
/// slow: their matrix products leave memory to each other.
fn contention(w: &Work, p: &Profile) -> Slowdown {
    let others = p.sharing.saturating_sub(1);
    if others == 0 || (p.mem_contention <= 0.0 && p.half_contention <= 0.0) {
        return Slowdown::NONE;
    }
    let alone = compute_time(w, p);
    let streamed = elementwise_bytes(w, p).1 / (p.mem_bw * p.efficiency)
        + w.bytes_half / (p.mem_bw_half * p.efficiency);
    let s = match alone > 0.0 {
        true => (streamed / alone).clamp(0.0, 1.0),
        false => return Slowdown::NONE,
    };
    let n = p.sharing as f64;
    let expected = |contention: f64| {
        let mut choose = 1.0;
        (0..=others)
            .map(|k| {
                if k > 0 {
                    choose *= (others - k + 1) as f64 / k as f64;
                }
                let prob = choose * s.powi(k as i32) * (1.0 - s).powi((others - k) as i32);
                prob * (contention * (k + 1) as f64 / n).max(1.0)
            })
            .sum()
    };
    Slowdown {
        f32: expected(p.mem_contention),
        half: expected(p.half_contention),
    }
}

/// What the plan needs of the recipe besides the simulation.
#[derive(Debug, Clone, Copy)]
pub struct Layout {
    /// Sequences per step over all ranks.
    pub batch_size: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Pipeline stages.
    pub pp: usize,
    /// Micro-batches per step.
    pub microbatches: usize,
    /// The pipeline's schedule.
    pub schedule: ScheduleKind,
    /// Whether contractions compute in 16 bits.
    pub half: bool,
}

/// The plan of a simulated job on profile `p`.
///
/// # Errors
/// A pipeline schedule that cannot be built for these stages and micro-batches.
pub fn estimate(sim: &Simulated, layout: &Layout, p: &Profile) -> Result<Plan, String> {
    let roles: Vec<RolePlan> = sim.roles.iter().map(|r| replay(r, p)).collect();
    let (step_s, bubble) = match layout.pp > 1 {
        false => (roles.iter().map(|r| r.step_s).fold(0.0, f64::max), None),
        true => pipelined(&roles, layout)?,
    };
    let peak = roles.iter().map(|r| r.memory.peak).fold(0.0, f64::max);
    // Ranks as threads of one machine share its memory; GPUs each have their own.
    let fits = match p.sharing > 1 {
        true => {
            let per_stage = (sim.world / layout.pp.max(1)) as f64;
            roles.iter().map(|r| r.memory.peak * per_stage).sum::<f64>() <= p.memory
        }
        false => peak <= p.memory,
    };
    let tokens_per_step = (layout.batch_size * layout.seq_len) as f64;
    let per_stage = (sim.world / layout.pp.max(1)) as f64;
    let flops: f64 = roles.iter().map(|r| r.work.flops() * per_stage).sum();
    let peak_flops = match layout.half {
        true => p.peak_half,
        false => p.peak_f32,
    };
    Ok(Plan {
        profile: p.name.clone(),
        world: sim.world,
        fits,
        peak,
        step_s,
        bubble,
        tokens_per_step,
        tokens_per_s_per_gpu: tokens_per_step / step_s / sim.world as f64,
        flop_utilisation: flops / (step_s * sim.world as f64 * peak_flops),
        roles,
        simulated_in_s: sim.elapsed.as_secs_f64(),
    })
}

/// A pipeline's step: every stage's forward and backward per micro-batch (its replayed pass
/// time split by its forward and backward compute) played out by the schedule, then the
/// slowest stage's work outside the passes (the optimizer step).
fn pipelined(roles: &[RolePlan], layout: &Layout) -> Result<(f64, Option<f64>), String> {
    let p = roles.len();
    let m = layout.microbatches.max(1) as f64;
    let schedule =
        Schedule::new(layout.schedule, p, layout.microbatches.max(1)).map_err(|e| e.to_string())?;
    let costs: Vec<(f64, f64)> = roles
        .iter()
        .map(|r| {
            let [f, b, _] = r.compute_s;
            let passes = (r.step_s - r.compute_s[2]).max(0.0);
            let share = if f + b > 0.0 { f / (f + b) } else { 0.5 };
            (passes * share / m, passes * (1.0 - share) / m)
        })
        .collect();
    let v = schedule.chunks() / p.max(1);
    let timeline = schedule
        .simulate_with(|a| {
            let (kiln_pipe::Action::Forward { chunk, .. }
            | kiln_pipe::Action::Backward { chunk, .. }) = *a;
            let (f, b) = costs[chunk % p];
            match a {
                kiln_pipe::Action::Forward { .. } => f / v as f64,
                kiln_pipe::Action::Backward { .. } => b / v as f64,
            }
        })
        .map_err(|e| e.to_string())?;
    let rest = roles.iter().map(|r| r.compute_s[2]).fold(0.0, f64::max);
    Ok((timeline.makespan + rest, Some(timeline.bubble())))
}

/// What a token budget costs on a plan.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Cost {
    /// Tokens to train on.
    pub tokens: f64,
    /// Steps that takes.
    pub steps: f64,
    /// Wall-clock hours.
    pub hours: f64,
    /// GPU-hours (hours x ranks).
    pub gpu_hours: f64,
    /// Price, at `price` per GPU-hour (when given).
    pub price: Option<f64>,
}

/// The cost of training on `tokens` tokens with `plan`.
pub fn cost(plan: &Plan, tokens: f64, price: Option<f64>) -> Cost {
    let steps = (tokens / plan.tokens_per_step).ceil();
    let hours = steps * plan.step_s / 3600.0;
    let gpu_hours = hours * plan.world as f64;
    Cost {
        tokens,
        steps,
        hours,
        gpu_hours,
        price: price.map(|p| p * gpu_hours),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cpu(sharing: usize, contention: f64) -> Profile {
        let mut p = crate::profile::profile("h100", 1).unwrap();
        p.sharing = sharing;
        p.mem_contention = contention;
        p.half_contention = 0.0;
        p.mem_bw = 1e9;
        p.bw_by_size = [2.0, 2.0, 1.0, 1.0];
        p.op_overhead = 0.0;
        p.efficiency = 1.0;
        p
    }

    #[test]
    fn ranks_sharing_memory_slow_each_other_by_how_much_of_their_step_they_stream() {
        // Only streaming from memory beyond the caches, nothing else: the other rank streams
        // all the time, so every byte is moved with both streaming.
        let mut w = Work {
            bytes: 1e9,
            ..Work::default()
        };
        w.bytes_by_size[3] = 1e9;
        let f32_of = |w: &Work, p: &Profile| contention(w, p).f32;
        assert!((f32_of(&w, &cpu(2, 2.0)) - 2.0).abs() < 1e-12);
        assert!((f32_of(&w, &cpu(2, 1.5)) - 1.5).abs() < 1e-12);
        // The machine serves both at their own rate: no slowdown.
        assert_eq!(f32_of(&w, &cpu(2, 0.8)), 1.0);
        // One rank, or memory of its own (a GPU): none.
        assert_eq!(contention(&w, &cpu(1, 2.0)), Slowdown::NONE);
        assert_eq!(contention(&w, &cpu(2, 0.0)), Slowdown::NONE);
        // One second of products at the profile's peak and one of streaming: the other rank
        // streams half the time, 1.5x on average.
        let p = cpu(2, 2.0);
        let mut half = w;
        half.flops_f32 = p.peak_f32;
        half.flops_by_depth[3] = p.peak_f32;
        assert!(
            (f32_of(&half, &p) - 1.5).abs() < 1e-9,
            "{:?}",
            contention(&half, &p)
        );
        // Four ranks, each streaming half its time: k others of 3 at once, binomial(3, 1/2);
        // a byte costs max(1, 2 (k + 1) / 4): 1, 1, 1.5, 2 for k = 0..3.
        let p4 = cpu(4, 2.0);
        let expected = (1.0 + 3.0 * 1.0 + 3.0 * 1.5 + 2.0) / 8.0;
        assert!((f32_of(&half, &p4) - expected).abs() < 1e-9);
        // 16-bit kernels by their own contention, the streaming share counting their time.
        let mut p16 = cpu(2, 0.0);
        p16.half_contention = 1.6;
        p16.mem_bw_half = 1e9;
        let w16 = Work {
            bytes_half: 1e9,
            ..Work::default()
        };
        let s = contention(&w16, &p16);
        assert!((s.half - 1.6).abs() < 1e-12 && s.f32 == 1.0, "{s:?}");
        let t = compute_time_shared(&w16, &p16, s);
        assert!((t - 1.6).abs() < 1e-12, "{t}");
        // Working sets the caches hold are not slowed, and do not count as streaming.
        let mut cached = Work {
            bytes: 1e9,
            ..Work::default()
        };
        cached.bytes_by_size[0] = 1e9;
        assert_eq!(contention(&cached, &p).f32, 1.0);
        let both = Slowdown {
            f32: 2.0,
            half: 1.0,
        };
        let t = compute_time_shared(&cached, &p, both);
        assert!((t - 0.5).abs() < 1e-12, "{t}");
        assert!((compute_time_shared(&w, &p, both) - 2.0).abs() < 1e-12);
    }
}
