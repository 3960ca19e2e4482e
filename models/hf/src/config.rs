//! `config.json`: reading it into a model's serde config, and its `model_type`.

use crate::HfError;
use serde::de::DeserializeOwned;
use std::path::{Path, PathBuf};

/// The config file of a Hugging Face model directory.
pub const CONFIG_FILE: &str = "config.json";
/// The weights file of a Hugging Face model directory (single-file checkpoints).
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// The PyTorch reference numbers of a kiln parity fixture.
pub const REFERENCE_FILE: &str = "reference.safetensors";

/// `dir/config.json`.
pub fn config_path(dir: impl AsRef<Path>) -> PathBuf {
    dir.as_ref().join(CONFIG_FILE)
}

/// Reads `dir/config.json` into `C` (unknown fields are ignored, as transformers does).
///
/// # Errors
/// [`HfError::MissingFile`] when there is no config.json, [`HfError::Io`] when it cannot be read,
/// [`HfError::ConfigParse`] when it is not valid JSON for `C`.
pub fn read_config<C: DeserializeOwned>(dir: impl AsRef<Path>) -> Result<C, HfError> {
    let path = config_path(dir);
    if !path.is_file() {
        return Err(HfError::MissingFile {
            path,
            what: "the model's Hugging Face config",
        });
    }
    let text = std::fs::read_to_string(&path).map_err(|source| HfError::Io {
        op: "read",
        path: path.clone(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|source| HfError::ConfigParse { path, source })
}

#[derive(serde::Deserialize)]
struct ModelType {
    model_type: String,
}

/// The `model_type` field of `dir/config.json` (e.g. `gpt2`, `llama`).
///
/// # Errors
/// As [`read_config`].
pub fn model_type(dir: impl AsRef<Path>) -> Result<String, HfError> {
    read_config::<ModelType>(dir).map(|m| m.model_type)
}

/// Writes `config` to `dir/config.json` with `model_type` and `architectures: [architecture]`
/// added, which transformers' `AutoModelForCausalLM` needs.
///
/// # Errors
/// [`HfError::Io`] when the file cannot be written.
///
/// # Panics
/// If `C` does not serialize to a JSON object.
pub fn write_config<C: serde::Serialize>(
    dir: impl AsRef<Path>,
    config: &C,
    model_type: &str,
    architecture: &str,
) -> Result<(), HfError> {
    let path = config_path(dir);
    let mut value = serde_json::to_value(config).expect("a config serializes to JSON");
    let object = value
        .as_object_mut()
        .expect("a config serializes to a JSON object");
    object.insert("model_type".into(), model_type.into());
    object.insert("architectures".into(), serde_json::json!([architecture]));
    let text = serde_json::to_string_pretty(&value).expect("a JSON value serializes");
    std::fs::write(&path, text + "\n").map_err(|source| HfError::Io {
        op: "write",
        path,
        source,
    })
}

/// [`read_config`] followed by the model's own check, whose message becomes
/// [`HfError::UnsupportedConfig`] naming the file.
///
/// # Errors
/// As [`read_config`], and [`HfError::UnsupportedConfig`] when `validate` refuses the config.
pub fn read_validated_config<C: DeserializeOwned>(
    dir: impl AsRef<Path>,
    validate: impl FnOnce(&C) -> Result<(), crate::Unsupported>,
) -> Result<C, HfError> {
    let config: C = read_config(&dir)?;
    validate(&config).map_err(|reason| HfError::UnsupportedConfig {
        path: config_path(&dir),
        reason: reason.0,
    })?;
    Ok(config)
}
