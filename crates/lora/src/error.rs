//! What goes wrong with adapters, named in the terms of the model and the files.

use std::path::PathBuf;

/// An adapter error.
#[derive(Debug, thiserror::Error)]
pub enum LoraError {
    /// A target pattern selects no weight.
    #[error(
        "LoRA target '{pattern}' matches no weight of the model; its modules include: {}",
        examples.join(", ")
    )]
    NoMatch {
        /// The pattern.
        pattern: String,
        /// Some module paths that exist.
        examples: Vec<String>,
    },
    /// A selected parameter is not a matrix.
    #[error("LoRA adapts matrices; the weight of '{module}' has shape {dims:?}")]
    NotMatrix {
        /// The module.
        module: String,
        /// Its weight's shape.
        dims: Vec<usize>,
    },
    /// The rank does not fit a target.
    #[error(
        "LoRA rank r = {r} does not fit '{module}' (weight {dims:?}): r must be between 1 and the \
         smaller dimension"
    )]
    Rank {
        /// The rank asked for.
        r: usize,
        /// The module.
        module: String,
        /// Its weight's shape.
        dims: Vec<usize>,
    },
    /// A dropout that is not a probability below 1.
    #[error("LoRA dropout {0}: it must be a probability in [0, 1)")]
    Dropout(f64),
    /// An adapter file does not fit the model.
    #[error("{path}: {what}")]
    Mismatch {
        /// The adapter directory or file.
        path: PathBuf,
        /// What does not fit (keys and shapes named).
        what: String,
    },
    /// A PEFT setting kiln does not implement.
    #[error("{path}: {what} is not supported by kiln's LoRA")]
    Unsupported {
        /// The adapter config.
        path: PathBuf,
        /// The setting.
        what: String,
    },
    /// Reading or writing a file.
    #[error(transparent)]
    Hf(#[from] kiln_hf::HfError),
    /// A training step of the verification failed (a collective).
    #[error(transparent)]
    Step(#[from] kiln_shard::ShardError),
    /// A file system error.
    #[error("cannot {op} {path}: {source}")]
    Io {
        /// What was attempted.
        op: &'static str,
        /// The path.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
}
