//! What a run tells the person watching it: events from rank 0 ([`Event`]) to a [`Report`],
//! and the wording of every line.
//!
//! The library prints nothing itself. The `kiln` command's report draws a progress bar on a
//! terminal and prints [`RunInfo::step_line`] at [`RunInfo::prints_line_at`] otherwise; a program
//! that calls [`train_rank`](crate::train_rank) without a report of its own gets [`Log`], the
//! the same lines as `tracing` events at `info` level.

use crate::Summary;
use std::path::{Path, PathBuf};

/// The run about to start (the first event).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct RunInfo {
    /// `gpt2` or `llama`.
    pub model_kind: String,
    /// Parameters of the whole model.
    pub params: usize,
    /// What trains, when only part of the model does (LoRA adapters).
    pub trains: Option<String>,
    /// The pipeline: stages, micro-batches, schedule and what each stage runs.
    pub pipeline: Option<String>,
    /// Tensor parallelism: ranks and which parameters are split how.
    pub tensor_parallel: Option<String>,
    /// The strategy, as the recipe names it.
    pub strategy: String,
    /// The rematerialisation mode (`train.remat`).
    pub remat: String,
    /// The precision (`train.precision`).
    pub precision: String,
    /// Ranks of the job.
    pub world_size: usize,
    /// Tokens of one step over all ranks.
    pub tokens_per_step: usize,
    /// The corpus, described.
    pub data: String,
    /// Unigram entropy of the training split (nats).
    pub unigram_entropy: f64,
    /// The best achievable loss, when known (the synthetic corpus).
    pub floor: Option<f64>,
    /// The snapshot the run continues, if any.
    pub resumed: Option<Resumed>,
    /// The run directory.
    pub out: PathBuf,
    /// The step the run starts after (0, or the snapshot's).
    pub first_step: usize,
    /// The step this job stops at (`--stop-after`, or `total_steps`).
    pub last_step: usize,
    /// `train.steps`: the schedule's length.
    pub total_steps: usize,
    /// `output.progress_lines`: how many step lines a run prints when it draws no bar.
    pub progress_lines: usize,
}

/// The snapshot a run continues.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Resumed {
    /// Its directory.
    pub dir: PathBuf,
    /// The world size that wrote it.
    pub world_size: usize,
    /// The strategy that wrote it.
    pub strategy: String,
}

/// One training step, as the person watching sees it (what the step itself measured is
/// [`kiln_shard::StepStats`]).
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct Progress {
    /// The step (1-based).
    pub step: usize,
    /// The global training loss.
    pub loss: f64,
    /// The learning rate it ran at.
    pub lr: f64,
    /// Tokens per second since the run (re)started.
    pub tokens_per_s: f64,
    /// Seconds since the run (re)started.
    pub elapsed_s: f64,
    /// Seconds to `train.steps` at the rate so far.
    pub eta_s: f64,
}

/// What happened, in the order it happens.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub enum Event<'a> {
    /// The run starts.
    Started(&'a RunInfo),
    /// A training step ended.
    Step(&'a Progress),
    /// A validation loss was computed.
    Validated {
        /// After this step.
        step: usize,
        /// The mean loss over the validation batches.
        loss: f64,
    },
    /// A snapshot was written.
    Saved {
        /// Of this step.
        step: usize,
        /// Its directory.
        dir: &'a Path,
    },
    /// The run ended.
    Finished {
        /// What it did.
        summary: &'a Summary,
        /// Seconds since it (re)started.
        elapsed_s: f64,
    },
}

/// Receives a run's events (on rank 0 only).
pub trait Report {
    /// One event.
    fn report(&mut self, event: Event<'_>);
}

/// Reports nothing.
#[derive(Debug, Clone, Copy, Default)]
pub struct Silent;

impl Report for Silent {
    fn report(&mut self, _: Event<'_>) {}
}

/// Reports through `tracing`, at `info` level: the lines a run without a bar prints (step lines
/// at the `output.progress_lines` cadence).
#[derive(Debug, Clone, Default)]
pub struct Log {
    info: Option<RunInfo>,
}

impl Report for Log {
    fn report(&mut self, event: Event<'_>) {
        match event {
            Event::Started(info) => {
                for line in info.start_lines() {
                    tracing::info!("{line}");
                }
                self.info = Some(info.clone());
            }
            Event::Step(s) => {
                if let Some(info) = self.info.as_ref().filter(|i| i.prints_line_at(s.step)) {
                    tracing::info!("{}", info.step_line(s));
                }
            }
            Event::Validated { step, loss } => tracing::info!("{}", validated_line(step, loss)),
            Event::Saved { step, dir } => tracing::info!("{}", saved_line(step, dir)),
            Event::Finished { summary, elapsed_s } => {
                if let Some(info) = &self.info {
                    for line in info.summary_lines(summary, elapsed_s) {
                        tracing::info!("{line}");
                    }
                }
            }
        }
    }
}

impl RunInfo {
    /// What is trained, on what, and from where.
    pub fn start_lines(&self) -> Vec<String> {
        let mut lines = vec![
            format!(
                "kiln {}: {} with {} parameters, {}{} on {} rank(s), {} tokens per step",
                if self.trains.is_some() {
                    "finetune"
                } else {
                    "train"
                },
                self.model_kind,
                human(self.params as f64),
                self.strategy,
                match self.remat.as_str() {
                    "off" => String::new(),
                    r => format!(" with remat {r}"),
                } + &match self.precision.as_str() {
                    "f32" => String::new(),
                    p => format!(" in {p} (f32 masters)"),
                },
                self.world_size,
                self.tokens_per_step
            ),
            format!(
                "data: {}; unigram entropy {:.3} nats{}",
                self.data,
                self.unigram_entropy,
                self.floor
                    .map(|f| format!(", best achievable loss {f:.3} nats"))
                    .unwrap_or_default()
            ),
            match &self.resumed {
                Some(r) => format!(
                    "resuming from {} (step {} of {}, written by {} rank(s) under {})",
                    r.dir.display(),
                    self.first_step,
                    self.total_steps,
                    r.world_size,
                    r.strategy
                ),
                None => format!("output: {}", self.out.display()),
            },
        ];
        if let Some(tp) = &self.tensor_parallel {
            lines.insert(1, tp.clone());
        }
        if let Some(pipeline) = &self.pipeline {
            lines.insert(1, pipeline.clone());
        }
        if let Some(trains) = &self.trains {
            lines.insert(1, trains.clone());
        }
        lines
    }

    /// Whether a run without a bar prints step `step`'s line: the first step run, every
    /// `(total_steps - first_step) / progress_lines` steps, and the last of the schedule.
    pub fn prints_line_at(&self, step: usize) -> bool {
        let every = (self.total_steps - self.first_step)
            .div_ceil(self.progress_lines.max(1))
            .max(1);
        step == self.first_step + 1 || step.is_multiple_of(every) || step == self.total_steps
    }

    /// `step     40/300 ( 13%) loss 2.1234 lr 3.00e-3 8.7k tok/s elapsed 0:05 ETA 0:31`.
    pub fn step_line(&self, s: &Progress) -> String {
        format!(
            "step {:>6}/{} ({:>3}%) loss {:.4} lr {:.2e} {} tok/s elapsed {} ETA {}",
            s.step,
            self.total_steps,
            100 * s.step / self.total_steps.max(1),
            s.loss,
            s.lr,
            human(s.tokens_per_s),
            clock(s.elapsed_s),
            clock(s.eta_s)
        )
    }

    /// The closing lines: steps and throughput, losses against the corpus' references, the
    /// snapshot, the metrics log and the sample.
    pub fn summary_lines(&self, s: &Summary, elapsed_s: f64) -> Vec<String> {
        let mut lines = vec!["---".to_string()];
        if s.losses.is_empty() {
            lines.push(format!(
                "no steps to run: the snapshot is at step {} (raise train.steps to continue)",
                s.first_step
            ));
        } else {
            lines.push(format!(
                "trained steps {}..{} in {} ({} tok/s)",
                s.first_step + 1,
                s.last_step,
                clock(elapsed_s),
                human(s.tokens_per_s)
            ));
            if self.world_size > 1 {
                lines.push(format!(
                    "waiting on collectives: {:.0}% of rank 0's step time",
                    100.0 * s.comm_wait
                ));
            }
            if let Some(b) = &s.bubble {
                lines.push(bubble_line(b));
            }
            if let Some(tp) = &s.tensor_parallel {
                let sp = match tp.all_gathers + tp.reduce_scatters {
                    0 => String::new(),
                    _ => format!(
                        ", {} all-gathers ({} bytes) and {} reduce-scatters ({} bytes) of \
                         sequence parallelism",
                        tp.all_gathers,
                        tp.all_gather_bytes,
                        tp.reduce_scatters,
                        tp.reduce_scatter_bytes
                    ),
                };
                lines.push(format!(
                    "tensor parallel, rank 0's last step: {} all-reduces of partial sums ({} \
                     bytes){sp}; {} split tensors formed whole{}",
                    tp.all_reduces,
                    tp.all_reduce_bytes,
                    tp.total_gathers(),
                    match tp.gathers.is_empty() {
                        true => String::new(),
                        false => format!(" (no rule for these ops yet: {:?})", tp.gathers),
                    }
                ));
            }
        }
        lines.extend(memory_lines(&s.memory));
        if let (Some(first), Some(last)) = (s.losses.first(), s.losses.last()) {
            lines.push(format!("training loss {first:.4} -> {last:.4}"));
        }
        if let Some(scale) = s.loss_scale {
            lines.push(format!(
                "f16 loss scale {scale} at the end; {} step(s) skipped for non-finite gradients",
                s.skipped_steps
            ));
        }
        if let Some(v) = s.val_loss {
            let reference = match self.floor {
                Some(f) => format!(
                    " (unigram entropy {:.3}, best achievable {f:.3}: {:.0}% of the learnable gap closed)",
                    self.unigram_entropy,
                    100.0 * (self.unigram_entropy - v) / (self.unigram_entropy - f)
                ),
                None => format!(" (unigram entropy {:.3})", self.unigram_entropy),
            };
            let before = s
                .val_loss_before
                .map(|b| format!("{b:.4} (before) -> "))
                .unwrap_or_default();
            lines.push(format!("validation loss {before}{v:.4}{reference}"));
        }
        if let Some(dir) = &s.snapshot {
            lines.push(format!("snapshot: {}", dir.display()));
        }
        lines.push(format!(
            "metrics: {}",
            self.out.join("metrics.jsonl").display()
        ));
        for (what, path) in &s.outputs {
            lines.push(format!("{what}: {}", path.display()));
        }
        if let Some(sample) = &s.sample_before {
            lines.push(format!("sample before (prompt|generated):\n{sample}"));
        }
        if let Some(sample) = &s.sample {
            lines.push(format!("sample (prompt|generated):\n{sample}"));
        }
        lines
    }
}

/// A pipelined run's bubble beside its two references, and each stage's mean step: the
/// replayed figure tells a cut of unequal stages (replayed above the textbook) from the
/// pipeline's own overhead (measured above replayed).
pub fn bubble_line(b: &kiln_pipe::Bubble) -> String {
    let stages: Vec<String> = b
        .stages
        .iter()
        .enumerate()
        .map(|(i, s)| {
            format!(
                "stage {i} computes {:.0} ms, waits {:.0} ms",
                s.compute * 1e3,
                s.waiting * 1e3
            )
        })
        .collect();
    format!(
        "pipeline bubble: {:.3} of the stages' time over {} steps ({:.3} for stages of equal cost, \
         {:.3} for these stages' measured passes); per step, {}",
        b.measured,
        b.steps,
        b.textbook,
        b.replayed,
        stages.join(", ")
    )
}

/// The memory table of the summary: each rank's most demanding step (up to 8 ranks; beyond,
/// the rank with the highest peak and the one with the lowest).
pub fn memory_lines(memory: &[crate::RankMemory]) -> Vec<String> {
    use kiln_shard::account::MemKind;
    if memory.is_empty() {
        return Vec::new();
    }
    let shown: Vec<&crate::RankMemory> = if memory.len() <= 8 {
        memory.iter().collect()
    } else {
        let by_peak = |m: &&crate::RankMemory| m.step.peak;
        let hi = memory.iter().max_by_key(by_peak);
        let lo = memory.iter().min_by_key(by_peak);
        hi.into_iter().chain(lo).collect()
    };
    let mut lines = vec![
        "memory per rank, its step with the highest heap peak (model state | step's rise by kind):"
            .to_string(),
    ];
    for m in shown {
        let s = &m.step;
        lines.push(format!(
            "  rank {}: peak {} = held {} + rise {} | params {}, grads {}, optimizer {} | activations {}, backward {}, gathered {}, comm {}",
            s.rank,
            bytes(s.peak),
            bytes(s.held_before),
            bytes(s.rise()),
            bytes(s.params),
            bytes(s.grads),
            bytes(m.optimizer),
            bytes(s.peak_of(MemKind::Activations)),
            bytes(s.peak_of(MemKind::Backward)),
            bytes(s.peak_of(MemKind::Gathered)),
            bytes(s.peak_of(MemKind::Comm)),
        ));
    }
    lines
}

/// Bytes with a binary unit: `512 B`, `1.5 KiB`, `12.3 MiB`, `2.00 GiB`.
pub fn bytes(n: usize) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut v = n as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    let digits = if v < 10.0 {
        2
    } else if v < 100.0 {
        1
    } else {
        0
    };
    format!("{v:.digits$} {}", UNITS[unit])
}

/// `step 40: validation loss 1.4061`.
pub fn validated_line(step: usize, loss: f64) -> String {
    format!("step {step}: validation loss {loss:.4}")
}

/// `step 40: snapshot runs/kiln/snapshots/step-00000040`.
pub fn saved_line(step: usize, dir: &Path) -> String {
    format!("step {step}: snapshot {}", dir.display())
}

/// `12.3k`.
pub fn human(v: f64) -> String {
    if v >= 1e6 {
        format!("{:.2}M", v / 1e6)
    } else if v >= 1e3 {
        format!("{:.1}k", v / 1e3)
    } else {
        format!("{v:.0}")
    }
}

/// `1:02:03` or `2:03`.
pub fn clock(secs: f64) -> String {
    let s = secs.max(0.0).round() as u64;
    if s >= 3600 {
        format!("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
    } else {
        format!("{}:{:02}", s / 60, s % 60)
    }
}

/// A size in bytes as a recipe writes it: whole GiB, MiB or KiB where it divides, else bytes
/// (`kiln::parse_size` reads it back exactly).
pub fn size(bytes: usize) -> String {
    for (unit, scale) in [("GiB", 1usize << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)] {
        if bytes >= scale && bytes.is_multiple_of(scale) {
            return format!("{}{unit}", bytes / scale);
        }
    }
    bytes.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(first_step: usize, total_steps: usize, progress_lines: usize) -> RunInfo {
        RunInfo {
            model_kind: "gpt2".into(),
            params: 121_000,
            trains: None,
            pipeline: None,
            tensor_parallel: None,
            strategy: "zero3".into(),
            remat: "off".into(),
            precision: "f32".into(),
            world_size: 2,
            tokens_per_step: 1024,
            data: "synthetic".into(),
            unigram_entropy: 3.109,
            floor: Some(1.371),
            resumed: None,
            out: "runs/kiln".into(),
            first_step,
            last_step: total_steps,
            total_steps,
            progress_lines,
        }
    }

    #[test]
    fn lines_come_at_the_first_step_every_interval_and_the_end() {
        let at: Vec<usize> = (1..=300)
            .filter(|&s| info(0, 300, 4).prints_line_at(s))
            .collect();
        assert_eq!(at, [1, 75, 150, 225, 300]);
        let at: Vec<usize> = (101..=110)
            .filter(|&s| info(100, 110, 4).prints_line_at(s))
            .collect();
        assert_eq!(at, [101, 102, 105, 108, 110]);
    }

    #[test]
    fn a_step_line_reads_as_before() {
        let s = Progress {
            step: 75,
            loss: 2.123_44,
            lr: 3e-3,
            tokens_per_s: 8_712.0,
            elapsed_s: 9.2,
            eta_s: 27.6,
        };
        assert_eq!(
            info(0, 300, 4).step_line(&s),
            "step     75/300 ( 25%) loss 2.1234 lr 3.00e-3 8.7k tok/s elapsed 0:09 ETA 0:28"
        );
        assert_eq!(clock(3723.0), "1:02:03");
        assert_eq!(human(1.5e6), "1.50M");
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(1536), "1.50 KiB");
        assert_eq!(bytes(123 << 20), "123 MiB");
    }
}
