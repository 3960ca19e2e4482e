//! [`Pretrained`]: loading and saving a model in the Hugging Face directory layout, written once
//! for every model.

use crate::{HfError, HfNaming, SafetensorsFile, WEIGHTS_FILE};
use burn::module::Module;
use burn::tensor::backend::Backend;
use std::path::Path;

/// A model stored as a Hugging Face directory (`config.json`, `model.safetensors`).
pub trait Pretrained<B: Backend>: Module<B> + HfNaming + Sized {
    /// What `config.json` holds.
    type Config: serde::Serialize;
    /// The `model_type` written to `config.json`.
    const MODEL_TYPE: &'static str;
    /// The architecture written to `config.json`'s `architectures`, for transformers.
    const ARCHITECTURE: &'static str;

    /// Reads and validates `dir/config.json`.
    ///
    /// # Errors
    /// A missing, invalid or unsupported config.
    fn read_config(dir: &Path) -> Result<Self::Config, HfError>;

    /// A model of `config` with freshly initialised parameters.
    fn from_config(config: &Self::Config, device: &B::Device) -> Self;

    /// Loads `dir/config.json` and `dir/model.safetensors` onto `device`.
    ///
    /// # Errors
    /// A missing or invalid config, a missing weights file, or a missing or mis-shaped tensor
    /// (named, with both shapes).
    fn from_pretrained(dir: impl AsRef<Path>, device: &B::Device) -> Result<Self, HfError> {
        let dir = dir.as_ref();
        Self::from_config(&Self::read_config(dir)?, device).load_safetensors(dir.join(WEIGHTS_FILE))
    }

    /// Replaces every parameter by the tensor of the safetensors file at `path`.
    ///
    /// # Errors
    /// As [`crate::load_weights`].
    fn load_safetensors(self, path: impl AsRef<Path>) -> Result<Self, HfError> {
        let file = SafetensorsFile::open(path, "the model's weights")?;
        crate::load_weights(self, &file)
    }

    /// Writes the weights to `path` in Hugging Face names and shapes.
    ///
    /// # Errors
    /// When the file cannot be written.
    fn save_safetensors(&self, path: impl AsRef<Path>) -> Result<(), HfError> {
        crate::save_weights(self, path)
    }

    /// Writes `dir/config.json` (`config` with `model_type` and `architectures`, for
    /// transformers) and `dir/model.safetensors`, creating `dir`.
    ///
    /// # Errors
    /// When a file cannot be written.
    fn save_pretrained(&self, config: &Self::Config, dir: impl AsRef<Path>) -> Result<(), HfError> {
        self.save_pretrained_as(config, dir, burn::tensor::FloatDType::F32)
    }

    /// [`save_pretrained`](Self::save_pretrained) with the weights in `dtype` (f32, bf16 or
    /// f16), named in `config.json` as `torch_dtype`.
    ///
    /// # Errors
    /// When a file cannot be written.
    fn save_pretrained_as(
        &self,
        config: &Self::Config,
        dir: impl AsRef<Path>,
        dtype: burn::tensor::FloatDType,
    ) -> Result<(), HfError> {
        let dir = dir.as_ref();
        std::fs::create_dir_all(dir).map_err(|source| HfError::Io {
            op: "write",
            path: dir.to_path_buf(),
            source,
        })?;
        crate::write_config(dir, config, Self::MODEL_TYPE, Self::ARCHITECTURE)?;
        let path = crate::config_path(dir);
        let text = std::fs::read_to_string(&path).map_err(|source| HfError::Io {
            op: "read",
            path: path.clone(),
            source,
        })?;
        let mut value: serde_json::Value =
            serde_json::from_str(&text).expect("kiln wrote the config as JSON");
        value["torch_dtype"] = crate::torch_dtype_name(dtype).into();
        let text = serde_json::to_string_pretty(&value).expect("a JSON value serializes");
        std::fs::write(&path, text + "\n").map_err(|source| HfError::Io {
            op: "write",
            path,
            source,
        })?;
        crate::save_weights_as(self, dir.join(WEIGHTS_FILE), dtype)
    }
}
