//! The run's JSONL metrics log (`OUT/metrics.jsonl`, written by rank 0) and its clock.

use crate::error::{IoContext, Result};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The metrics log of one run, and the time since it (re)started.
#[derive(Debug)]
pub struct Metrics {
    started: Instant,
    first_step: usize,
    file: Option<std::fs::File>,
    path: PathBuf,
}

impl Metrics {
    /// The log of a run that starts after step `first_step`, written when `enabled` (rank 0
    /// only). The log at `path` keeps the lines of steps `<= first_step` (a resumed run) and
    /// drops the rest.
    ///
    /// # Errors
    /// The log cannot be written.
    pub fn new(enabled: bool, first_step: usize, path: &Path) -> Result<Metrics> {
        let file = if enabled {
            let kept: String = std::fs::read_to_string(path)
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
            std::fs::write(path, kept).io(|| format!("cannot write {}", path.display()))?;
            Some(
                std::fs::OpenOptions::new()
                    .append(true)
                    .open(path)
                    .io(|| format!("cannot open {}", path.display()))?,
            )
        } else {
            None
        };
        Ok(Metrics {
            started: Instant::now(),
            first_step,
            file,
            path: path.to_path_buf(),
        })
    }

    /// Appends a record (when enabled).
    ///
    /// # Errors
    /// The log cannot be written.
    pub fn record(&mut self, value: serde_json::Value) -> Result<()> {
        if let Some(f) = &mut self.file {
            writeln!(f, "{value}").io(|| format!("cannot write {}", self.path.display()))?;
        }
        Ok(())
    }

    /// Tokens per second since the run (re)started, at step `step`.
    pub fn tokens_per_s(&self, step: usize, tokens_per_step: usize) -> f64 {
        let secs = self.elapsed().max(1e-9);
        ((step - self.first_step) * tokens_per_step) as f64 / secs
    }

    /// Seconds since the run (re)started.
    pub fn elapsed(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }
}
