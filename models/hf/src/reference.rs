//! The PyTorch reference numbers of a parity fixture (`reference.safetensors`, see
//! `shared/fixtures/README.md`), with the optimizer settings read from its `__metadata__`.

use crate::{HfError, SafetensorsFile};
use burn::tensor::TensorData;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// PyTorch `AdamW` settings (no schedule, no clipping), as stored in the fixture's metadata.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWSettings {
    /// Learning rate.
    pub lr: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Added to the bias-corrected `sqrt(v)`.
    pub eps: f64,
    /// Decoupled weight decay (`p -= lr * wd * p`).
    pub weight_decay: f64,
    /// Number of steps taken.
    pub steps: usize,
}

/// What PyTorch computed for a model directory.
#[derive(Debug, Clone)]
pub struct Reference {
    /// The file it was read from.
    pub path: PathBuf,
    /// Token ids `[batch, seq]` (i64).
    pub input_ids: TensorData,
    /// Next-token targets `[batch, seq]` (i64).
    pub labels: TensorData,
    /// Logits of the initial weights `[batch, seq, vocab]`.
    pub logits: TensorData,
    /// Mean cross-entropy of `logits` vs `labels`.
    pub loss_init: f32,
    /// L2 norm of each parameter's gradient of `loss_init`, by checkpoint name.
    pub grad_norms: BTreeMap<String, f32>,
    /// The loss before each optimizer step (`optimizer.steps` of them).
    pub train_losses: Vec<f32>,
    /// Every parameter after the steps, by checkpoint name.
    pub final_weights: BTreeMap<String, TensorData>,
    /// The optimizer that took the steps.
    pub optimizer: AdamWSettings,
}

impl Reference {
    /// Reads `path` (a `reference.safetensors`).
    ///
    /// # Errors
    /// [`HfError::MissingFile`], [`HfError::Safetensors`], [`HfError::MissingTensor`] for one of
    /// `input_ids`, `labels`, `logits`, `loss_init`, `train_losses`, [`HfError::Metadata`] for an
    /// absent or unparsable optimizer setting, [`HfError::ShapeMismatch`] when `train_losses` does
    /// not hold `steps` values or `labels` differs in shape from `input_ids`.
    pub fn read(path: impl AsRef<Path>) -> Result<Self, HfError> {
        let file = SafetensorsFile::open(path, "the PyTorch reference numbers")?;
        let optimizer = AdamWSettings {
            lr: file.metadata_number("lr")?,
            beta1: file.metadata_number("beta1")?,
            beta2: file.metadata_number("beta2")?,
            eps: file.metadata_number("eps")?,
            weight_decay: file.metadata_number("weight_decay")?,
            steps: file.metadata_number("steps")?,
        };
        let input_ids = file.int("input_ids")?;
        let labels = file.int("labels")?;
        if labels.shape != input_ids.shape {
            return Err(HfError::ShapeMismatch {
                name: "labels".into(),
                path: file.path().to_path_buf(),
                expected: input_ids.shape.to_vec(),
                found: labels.shape.to_vec(),
            });
        }
        let train_losses = file
            .float("train_losses", Some(&[optimizer.steps]))?
            .to_vec::<f32>()
            .expect("float() returns f32");
        let mut grad_norms = BTreeMap::new();
        let mut final_weights = BTreeMap::new();
        for name in file.names() {
            if let Some(param) = name.strip_prefix("grad_norm.") {
                grad_norms.insert(param.to_string(), file.scalar(&name)?);
            } else if let Some(param) = name.strip_prefix("final.") {
                final_weights.insert(param.to_string(), file.float(&name, None)?);
            }
        }
        Ok(Self {
            path: file.path().to_path_buf(),
            logits: file.float("logits", None)?,
            loss_init: file.scalar("loss_init")?,
            input_ids,
            labels,
            grad_norms,
            train_losses,
            final_weights,
            optimizer,
        })
    }
}
