//! The pipeline's bubble, measured: per stage, time computing and time waiting for neighbours,
//! and the idle share of the whole schedule beside the textbook (p-1)/(v·m + p-1); and the
//! activation bytes a stage holds at its peak under GPipe and 1F1B.
//!
//! The textbook figure assumes stages of equal cost. Each row also replays the schedule with
//! every pass taking its mean time over the timed steps, communication free
//! (`Pipeline::bubble`, `Schedule::simulate_with`): "replayed" is the bubble these stages leave under this schedule
//! in theory, so that measured against textbook splits into the stages' imbalance (replayed
//! against textbook: the cut) and the pipeline's own overhead (measured against replayed:
//! hand-overs, waking, copies).
//!
//! Part 1 runs GPT-2 with real compute on 2 stages (this machine's 2 cores). Part 2 measures
//! the schedule itself at 4 and 8 stages, more than the cores: each stage's pass is a fixed
//! delay (`Pipeline::with_delay`) around a model whose own compute is negligible, so the
//! stages sleep instead of competing for cores; the stages are processes joined by TCP.
//!
//!     cargo run --release -p kiln-pipe --example pipeline_bench
//!     (or bash scripts/bench-pipeline.sh)

use burn::optim::{AdamWConfig, Optimizer};
use burn::tensor::{Int, Tensor, TensorData};
use kiln::shard::account::{MemKind, RankAlloc, attribute_to_rank};
use kiln::shard::{ShardedOptimizer, StepConfig};
use kiln::{Flex, Train};
use kiln_comm::{LocalGroup, ProcessGroup};
use kiln_model::causal_lm_loss;
use kiln_pipe::{Bubble, Pipeline, PipelineConfig, ScheduleKind, Split, StageTimes, Tally};
use std::sync::Arc;
use std::time::Duration;

#[global_allocator]
static ALLOC: RankAlloc = RankAlloc;

type AB = Train<Flex>;
const VOCAB: usize = 256;

fn gpt2(layers: usize, d: usize, seq: usize) -> kiln_gpt2::Gpt2<AB> {
    gpt2_with_vocab(layers, d, seq, VOCAB)
}

/// GPT-2 with a vocabulary of `vocab` tokens (the batches use the first 256).
fn gpt2_with_vocab(layers: usize, d: usize, seq: usize, vocab: usize) -> kiln_gpt2::Gpt2<AB> {
    kiln_gpt2::Gpt2Config::new(vocab, seq, d, layers, 4).init(&Default::default())
}

fn tokens(rows: usize, seq: usize, step: usize, mb: usize, shift: usize) -> Tensor<AB, 2, Int> {
    let v: Vec<i64> = (0..rows * seq)
        .map(|i| ((i * 7 + step * 13 + mb * 31 + shift) % VOCAB) as i64)
        .collect();
    Tensor::from_data(TensorData::new(v, [rows, seq]), &Default::default())
}

/// What one configuration measured, averaged over the timed steps.
struct Measured {
    /// The bubble, its references and the stages' mean times (`Pipeline::bubble`).
    bubble: Bubble,
    /// Per stage: peak activation bytes in a step.
    activations: Vec<usize>,
    /// Per stage: bytes of parameters and of AdamW state.
    held: Vec<(usize, usize)>,
}

/// One rank's run: the pipeline's bubble (the same on every rank); the stage's peak
/// activation bytes; the bytes of its parameters and of its AdamW state at the end.
type RankRun = (Bubble, usize, usize, usize);

/// `steps` steps (the first not timed) of this rank's stage.
#[allow(clippy::too_many_arguments)]
fn run_rank(
    world: Arc<dyn ProcessGroup>,
    model: kiln_gpt2::Gpt2<AB>,
    m: usize,
    schedule: ScheduleKind,
    rows: usize,
    seq: usize,
    steps: usize,
    delay: Option<(Duration, Duration)>,
    measured: bool,
) -> RankRun {
    attribute_to_rank(world.rank());
    let split = if measured {
        Split::Costs(
            kiln_pipe::measure_costs(
                &model,
                tokens(rows, seq, 0, 0, 0),
                |logits| causal_lm_loss(logits, tokens(rows, seq, 0, 0, 1)),
                world.as_ref(),
                3,
            )
            .unwrap(),
        )
    } else {
        Split::Balanced
    };
    let config = PipelineConfig {
        stages: world.world_size(),
        microbatches: m,
        schedule,
        split,
    };
    let (mut pipe, mut model) = Pipeline::new(model, world.clone(), &config).unwrap();
    if world.rank() == 0 && delay.is_none() {
        let placement = pipe.placement().to_string();
        println!("  {}", placement.trim_end().replace('\n', "; "));
    }
    if let Some((f, b)) = delay {
        pipe = pipe.with_delay(f, b);
    }
    let mut optim = ShardedOptimizer::<_, Flex>::new(AdamWConfig::new().init::<AB, _>());
    let mut tally = Tally::default();
    let mut activations = 0;
    for step in 0..steps {
        world.barrier().unwrap();
        let (next, stats, s) = pipe
            .step(
                model,
                &mut optim,
                1e-3,
                &StepConfig::default(),
                |mb| tokens(rows, seq, step, mb, 0),
                |logits, mb| {
                    causal_lm_loss(logits, tokens(rows, seq, step, mb, 1)).div_scalar(m as f64)
                },
            )
            .expect("a pipelined step");
        model = next;
        if step > 0 {
            tally.add(&s);
        }
        if let Some(mem) = stats.memory {
            activations = activations.max(mem.peak_of(MemKind::Activations));
        }
    }
    let params = kiln::shard::account::param_bytes::<Flex, AB, _>(&model);
    let state = kiln::shard::account::record_bytes::<AB, _>(optim.to_record());
    (pipe.bubble(&tally).unwrap(), activations, params, state)
}

/// The pipeline's numbers from every rank's.
fn summarize(per_rank: Vec<RankRun>) -> Measured {
    Measured {
        activations: per_rank.iter().map(|r| r.1).collect(),
        held: per_rank.iter().map(|r| (r.2, r.3)).collect(),
        bubble: per_rank.into_iter().next().expect("a rank").0,
    }
}

/// A `p`-stage pipeline with stages as threads of this process.
#[allow(clippy::too_many_arguments)]
fn measure(
    make: &(dyn Fn() -> kiln_gpt2::Gpt2<AB> + Sync),
    p: usize,
    m: usize,
    schedule: ScheduleKind,
    rows: usize,
    seq: usize,
    steps: usize,
    measured: bool,
) -> Measured {
    let per_rank = kiln::shard::threads::spawn_ranks(p, |world: LocalGroup| {
        run_rank(
            Arc::new(world),
            make(),
            m,
            schedule,
            rows,
            seq,
            steps,
            None,
            measured,
        )
    })
    .unwrap();
    summarize(per_rank)
}

/// The delay-mode model: GPT-2 with 16 blocks of width 8 (its compute is negligible).
fn tiny() -> kiln_gpt2::Gpt2<AB> {
    gpt2(16, 8, 8)
}

/// A `p`-stage pipeline with stages as processes (this program again, joined by TCP), in delay
/// mode, or with part 1's real compute when both delays are zero (one Rayon thread per
/// process): as `kiln launch` runs stages, each with an autodiff graph registry and an
/// allocator of its own.
fn measure_processes(
    p: usize,
    m: usize,
    schedule: ScheduleKind,
    steps: usize,
    delay: (Duration, Duration),
) -> Measured {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let children: Vec<_> = (0..p)
        .map(|rank| {
            std::process::Command::new(std::env::current_exe().unwrap())
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("WORLD_SIZE", p.to_string())
                .env("LOCAL_WORLD_SIZE", p.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("RAYON_NUM_THREADS", "1")
                .env(
                    "KILN_BENCH_CHILD",
                    format!(
                        "{m} {schedule} {steps} {} {}",
                        delay.0.as_micros(),
                        delay.1.as_micros()
                    ),
                )
                .stdout(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let per_rank: Vec<RankRun> = children
        .into_iter()
        .map(|c| {
            let out = c.wait_with_output().unwrap();
            assert!(out.status.success(), "a stage process failed");
            let text = String::from_utf8(out.stdout).unwrap();
            let (mut act, mut params, mut state) = (0, 0, 0);
            let mut bubble = Bubble {
                measured: 0.0,
                textbook: 0.0,
                replayed: 0.0,
                stages: Vec::new(),
                steps: 0,
            };
            for line in text.lines() {
                let f: Vec<&str> = line.split_whitespace().collect();
                let num = |i: usize| f[i].parse::<f64>().unwrap();
                match f.first() {
                    Some(&"BUBBLE") => {
                        (bubble.measured, bubble.textbook) = (num(1), num(2));
                        (bubble.replayed, bubble.steps) = (num(3), f[4].parse().unwrap());
                    }
                    Some(&"STAGE") => bubble.stages.push(StageTimes {
                        compute: num(1),
                        waiting: num(2),
                        wall: num(3),
                    }),
                    Some(&"ACT") => {
                        act = f[1].parse().unwrap();
                        params = f[2].parse().unwrap();
                        state = f[3].parse().unwrap();
                    }
                    _ => {}
                }
            }
            (bubble, act, params, state)
        })
        .collect();
    summarize(per_rank)
}

/// A stage process of `measure_processes`.
fn child(spec: &str) {
    let f: Vec<&str> = spec.split_whitespace().collect();
    let (m, schedule, steps): (usize, ScheduleKind, usize) = (
        f[0].parse().unwrap(),
        f[1].parse().unwrap(),
        f[2].parse().unwrap(),
    );
    let delay = (
        Duration::from_micros(f[3].parse().unwrap()),
        Duration::from_micros(f[4].parse().unwrap()),
    );
    let world: Arc<dyn ProcessGroup> = Arc::new(kiln_comm::TcpGroup::from_env().unwrap());
    // No delay: the real-compute model of part 1.
    let (bubble, act, params, state) = if delay == (Duration::ZERO, Duration::ZERO) {
        run_rank(
            world,
            gpt2(8, 128, 128),
            m,
            schedule,
            4,
            128,
            steps,
            None,
            false,
        )
    } else {
        run_rank(world, tiny(), m, schedule, 1, 8, steps, Some(delay), false)
    };
    println!(
        "BUBBLE {} {} {} {}",
        bubble.measured, bubble.textbook, bubble.replayed, bubble.steps
    );
    for s in &bubble.stages {
        println!("STAGE {} {} {}", s.compute, s.waiting, s.wall);
    }
    println!("ACT {act} {params} {state}");
}

fn report(what: &str, r: &Measured) {
    let b = &r.bubble;
    println!(
        "{what}: bubble {:.3} measured, {:.3} in theory ({:+.0}%), {:.3} replayed ({:+.0}%)",
        b.measured,
        b.textbook,
        100.0 * (b.measured - b.textbook) / b.textbook,
        b.replayed,
        100.0 * (b.measured - b.replayed) / b.replayed
    );
    for (stage, s) in b.stages.iter().enumerate() {
        println!(
            "    stage {stage}: compute {:.1} ms, waiting {:.1} ms, schedule {:.1} ms per step; peak activations {:.2} MiB",
            s.compute * 1e3,
            s.waiting * 1e3,
            s.wall * 1e3,
            r.activations[stage] as f64 / (1 << 20) as f64
        );
    }
}

fn main() {
    // The heap as the `kiln` binary keeps it (GPipe's activations otherwise cost page faults
    // every step).
    kiln::shard::threads::keep_freed_memory();
    if let Ok(spec) = std::env::var("KILN_BENCH_CHILD") {
        return child(&spec);
    }
    let (layers, d, seq, rows) = (8, 128, 128, 4);
    let make = || gpt2(layers, d, seq);
    println!(
        "== Part 1: GPT-2 {layers} layers x d={d}, micro-batches of {rows} x {seq} tokens, real compute, 2 stages (threads), 5 steps (first untimed)"
    );
    let mut peaks = Vec::new();
    for (m, schedule, measured) in [
        (2, ScheduleKind::OneFOneB, false),
        (4, ScheduleKind::GPipe, false),
        (4, ScheduleKind::OneFOneB, false),
        (4, ScheduleKind::Interleaved { chunks: 2 }, false),
        (8, ScheduleKind::GPipe, false),
        (8, ScheduleKind::OneFOneB, false),
        (8, ScheduleKind::Interleaved { chunks: 2 }, false),
        // Cut by each unit's measured forward and backward time instead of its parameter count.
        (4, ScheduleKind::GPipe, true),
        (4, ScheduleKind::OneFOneB, true),
        (8, ScheduleKind::GPipe, true),
        (8, ScheduleKind::OneFOneB, true),
        (8, ScheduleKind::Interleaved { chunks: 2 }, true),
    ] {
        let r = measure(&make, 2, m, schedule, rows, seq, 5, measured);
        let split = if measured {
            ", split by measured time"
        } else {
            ""
        };
        report(&format!("p 2, m {m}, {schedule}{split}"), &r);
        if m == 8 && !measured && schedule != (ScheduleKind::Interleaved { chunks: 2 }) {
            peaks.push((schedule, r.activations));
        }
    }
    // The same at m = 8 with the two stages as processes (before kiln patched burn-autodiff's
    // clean-up, stage threads of one process computed unequally under 1F1B and processes did
    // not).
    println!("-- the same at m = 8, stages as processes (one Rayon thread each)");
    for schedule in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
        let r = measure_processes(2, 8, schedule, 5, (Duration::ZERO, Duration::ZERO));
        report(&format!("p 2, m 8, {schedule}, processes"), &r);
    }
    // A large vocabulary: the tied head's matmul costs several blocks' compute, while the
    // embedding holds as many parameters and costs a gather. Balancing parameter counts puts
    // as many blocks beside each; balancing measured time moves blocks off the head's stage.
    let vocab = 8192;
    let wide = || gpt2_with_vocab(layers, d, seq, vocab);
    println!("-- the same model with a vocabulary of {vocab} (tied head)");
    for (schedule, measured) in [
        (ScheduleKind::GPipe, false),
        (ScheduleKind::GPipe, true),
        (ScheduleKind::OneFOneB, false),
        (ScheduleKind::OneFOneB, true),
    ] {
        let r = measure(&wide, 2, 8, schedule, rows, seq, 4, measured);
        let split = if measured {
            "split by measured time"
        } else {
            "split by parameter count"
        };
        report(&format!("p 2, m 8, {schedule}, vocab {vocab}, {split}"), &r);
    }
    // What a stage holds against one device (the same model as a 1-stage pipeline).
    let one = measure(&make, 1, 8, ScheduleKind::OneFOneB, rows, seq, 2, false);
    let two = measure(&make, 2, 8, ScheduleKind::OneFOneB, rows, seq, 2, false);
    let (p1, s1) = one.held[0];
    for (stage, (p, s)) in two.held.iter().enumerate() {
        println!(
            "held by stage {stage} of 2: parameters {:.2} MiB ({:.2} of one device's {:.2} MiB), AdamW state {:.2} MiB ({:.2} of {:.2} MiB)",
            *p as f64 / (1 << 20) as f64,
            *p as f64 / p1 as f64,
            p1 as f64 / (1 << 20) as f64,
            *s as f64 / (1 << 20) as f64,
            *s as f64 / s1 as f64,
            s1 as f64 / (1 << 20) as f64
        );
    }
    if let [(_, gpipe), (_, one)] = &peaks[..] {
        for stage in 0..2 {
            println!(
                "peak activations, stage {stage}, m 8: 1F1B {:.2} MiB = {:.2} x GPipe's {:.2} MiB (p/m = {:.2})",
                one[stage] as f64 / (1 << 20) as f64,
                one[stage] as f64 / gpipe[stage] as f64,
                gpipe[stage] as f64 / (1 << 20) as f64,
                2.0 / 8.0
            );
        }
    }
    let (f, b) = (Duration::from_millis(20), Duration::from_millis(40));
    println!(
        "\n== Part 2: the schedule itself: each stage's forward of a micro-batch takes {} ms, its backward {} ms (a delay; the model's own compute is negligible); stages as processes",
        f.as_millis(),
        b.as_millis()
    );
    for p in [4, 8] {
        for (m, schedule) in [
            (8, ScheduleKind::GPipe),
            (8, ScheduleKind::OneFOneB),
            (8, ScheduleKind::Interleaved { chunks: 2 }),
            (16, ScheduleKind::OneFOneB),
        ] {
            let r = measure_processes(p, m, schedule, 3, (f, b)).bubble;
            println!(
                "p {p}, m {m}, {schedule}: bubble {:.3} measured, {:.3} in theory ({:+.0}%); step {:.0} ms (ideal {:.0} ms)",
                r.measured,
                r.textbook,
                100.0 * (r.measured - r.textbook) / r.textbook,
                r.stages.iter().map(|s| s.wall).fold(0.0, f64::max) * 1e3,
                (f + b).as_secs_f64()
                    * 1e3
                    * (m as f64 + (p as f64 - 1.0) / schedule.chunks() as f64)
            );
        }
    }
}
