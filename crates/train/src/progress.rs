//! What a person watching a run sees (rank 0 only): a progress bar on a terminal, periodic lines
//! otherwise (under `kiln launch`, or redirected to a file), and a JSONL metrics log.

use crate::error::{IoContext, Result};
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Progress display and metrics log of one run.
#[derive(Debug)]
pub struct Progress {
    enabled: bool,
    terminal: bool,
    total: usize,
    every: usize,
    started: Instant,
    first_step: usize,
    metrics: Option<std::fs::File>,
    metrics_path: PathBuf,
    pending_line: bool,
}

impl Progress {
    /// Progress of steps `first_step + 1 ..= total`; `enabled` on rank 0 only. The metrics log
    /// `metrics_path` keeps the lines of steps `<= first_step` (a resumed run) and drops the rest.
    ///
    /// # Errors
    /// The metrics log cannot be written.
    pub fn new(
        enabled: bool,
        total: usize,
        first_step: usize,
        lines: usize,
        metrics_path: &Path,
    ) -> Result<Progress> {
        let metrics = if enabled {
            let kept: String = std::fs::read_to_string(metrics_path)
                .unwrap_or_default()
                .lines()
                .filter(|l| {
                    serde_json::from_str::<serde_json::Value>(l)
                        .ok()
                        .and_then(|v| v["step"].as_u64())
                        .is_some_and(|s| s as usize <= first_step)
                })
                .map(|l| format!("{l}\n"))
                .collect();
            std::fs::write(metrics_path, kept)
                .io(|| format!("cannot write {}", metrics_path.display()))?;
            Some(
                std::fs::OpenOptions::new()
                    .append(true)
                    .open(metrics_path)
                    .io(|| format!("cannot open {}", metrics_path.display()))?,
            )
        } else {
            None
        };
        Ok(Progress {
            enabled,
            terminal: std::io::stdout().is_terminal(),
            total,
            every: (total - first_step).div_ceil(lines.max(1)).max(1),
            started: Instant::now(),
            first_step,
            metrics,
            metrics_path: metrics_path.to_path_buf(),
            pending_line: false,
        })
    }

    /// Prints a message on its own line (rank 0).
    pub fn say(&mut self, msg: &str) {
        if !self.enabled {
            return;
        }
        if self.pending_line {
            println!();
            self.pending_line = false;
        }
        println!("{msg}");
    }

    /// Appends a record to the metrics log (rank 0).
    ///
    /// # Errors
    /// The log cannot be written.
    pub fn record(&mut self, value: serde_json::Value) -> Result<()> {
        if let Some(f) = &mut self.metrics {
            writeln!(f, "{value}")
                .io(|| format!("cannot write {}", self.metrics_path.display()))?;
        }
        Ok(())
    }

    /// Tokens per second since the run (re)started.
    pub fn tokens_per_s(&self, step: usize, tokens_per_step: usize) -> f64 {
        let secs = self.started.elapsed().as_secs_f64().max(1e-9);
        ((step - self.first_step) * tokens_per_step) as f64 / secs
    }

    /// Seconds since the run (re)started.
    pub fn elapsed(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    /// Shows step `step` (rank 0).
    pub fn step(&mut self, step: usize, loss: f64, lr: f64, tokens_per_step: usize) {
        if !self.enabled {
            return;
        }
        let done = step - self.first_step;
        let secs = self.started.elapsed().as_secs_f64();
        let eta = secs / done as f64 * (self.total - step) as f64;
        let tps = self.tokens_per_s(step, tokens_per_step);
        if self.terminal {
            const WIDTH: usize = 24;
            let filled = WIDTH * step / self.total;
            print!(
                "\rstep {step:>6}/{} [{}{}] loss {loss:.4} lr {lr:.2e} {} tok/s ETA {}  ",
                self.total,
                "#".repeat(filled),
                ".".repeat(WIDTH - filled),
                human(tps),
                clock(eta)
            );
            let _ = std::io::stdout().flush();
            self.pending_line = true;
            if step == self.total {
                println!();
                self.pending_line = false;
            }
        } else if done == 1 || step.is_multiple_of(self.every) || step == self.total {
            println!(
                "step {step:>6}/{} ({:>3}%) loss {loss:.4} lr {lr:.2e} {} tok/s elapsed {} ETA {}",
                self.total,
                100 * step / self.total,
                human(tps),
                clock(secs),
                clock(eta)
            );
        }
    }
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
