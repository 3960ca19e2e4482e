//! The one error type of kiln's Hugging Face layer.

use std::path::PathBuf;

/// What can go wrong reading or writing a Hugging Face model directory.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HfError {
    /// A file the model directory must hold is not there.
    #[error("{} is missing ({what})", path.display())]
    MissingFile {
        /// The file looked for.
        path: PathBuf,
        /// What the file is for.
        what: &'static str,
    },
    /// Reading or writing a file failed (the operating system's error is the source).
    #[error("cannot {op} {}", path.display())]
    Io {
        /// `read` or `write`.
        op: &'static str,
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A `tokenizer.json` the `tokenizers` crate cannot read.
    #[error("cannot read the tokenizer {}: {reason}", path.display())]
    Tokenizer {
        /// The file.
        path: PathBuf,
        /// The parser's reason.
        reason: String,
    },
    /// `config.json` is not valid JSON or lacks a required field (the parser's error is the
    /// source).
    #[error("invalid config {}", path.display())]
    ConfigParse {
        /// The config file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: serde_json::Error,
    },
    /// `config.json` parses but asks for something this implementation does not do.
    #[error("unsupported config {}: {reason}", path.display())]
    UnsupportedConfig {
        /// The config file (empty when the config was built in code).
        path: PathBuf,
        /// What is unsupported, with the values.
        reason: String,
    },
    /// A safetensors file is malformed.
    #[error("invalid safetensors file {}: {reason}", path.display())]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// The cause, as the safetensors crate words it.
        reason: String,
    },
    /// The model has a parameter the file does not hold.
    #[error("tensor '{name}' is missing from {} (the model expects shape {expected:?})", path.display())]
    MissingTensor {
        /// The Hugging Face tensor name.
        name: String,
        /// The file.
        path: PathBuf,
        /// The shape the model expects, in the file's layout.
        expected: Vec<usize>,
    },
    /// A tensor in the file has another shape than the model's parameter.
    #[error(
        "tensor '{name}' in {} has shape {found:?} but the model expects {expected:?}",
        path.display()
    )]
    ShapeMismatch {
        /// The Hugging Face tensor name.
        name: String,
        /// The file.
        path: PathBuf,
        /// The shape the model expects, in the file's layout.
        expected: Vec<usize>,
        /// The shape in the file.
        found: Vec<usize>,
    },
    /// A tensor has an element type that cannot be read as the expected kind.
    #[error("tensor '{name}' in {} has dtype {dtype} but {expected} is expected", path.display())]
    Dtype {
        /// The tensor name.
        name: String,
        /// The file.
        path: PathBuf,
        /// The dtype in the file.
        dtype: String,
        /// What was expected (e.g. "a float type (F32, F16, BF16, F64)").
        expected: &'static str,
    },
    /// A `__metadata__` entry is absent or not a number.
    #[error("metadata '{key}' of {} is {found}", path.display())]
    Metadata {
        /// The metadata key.
        key: String,
        /// The file.
        path: PathBuf,
        /// What was found instead ("missing" or the unparsable value).
        found: String,
    },
    /// `config.json` names a `model_type` no kiln model implements.
    #[error("model_type '{model_type}' in {} is not supported (supported: {supported})", path.display())]
    UnsupportedModel {
        /// The `model_type` found.
        model_type: String,
        /// The config file.
        path: PathBuf,
        /// The supported types, comma-separated.
        supported: String,
    },
    /// Setting up parallel training for the check failed (sharding, communication).
    #[error("parallel setup: {0}")]
    Parallel(String),
    /// A config given as JSON (a fresh model's sizes, a snapshot's manifest) that the model
    /// cannot read or run.
    #[error("an invalid {model_type} config: {reason}")]
    InvalidConfig {
        /// The family.
        model_type: String,
        /// Why.
        reason: String,
    },
}

/// Why a model cannot run a config it read: the reason, with the values (a model's `validate`
/// returns it; [`HfError::UnsupportedConfig`] names the file).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Unsupported(pub String);
