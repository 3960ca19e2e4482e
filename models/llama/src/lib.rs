//! Llama-family causal LMs for Burn, written single-device and generic over `B: Backend`, loading
//! and saving Hugging Face checkpoints.
//!
//! RMSNorm, rotary positions (configurable theta, transformers' `rotate_half` convention),
//! grouped-query attention, SwiGLU, a tied or untied head. Module fields carry Hugging Face's names,
//! so a parameter's Burn path is its checkpoint name (RMSNorm's `gamma` aside); projection weights
//! are PyTorch `nn.Linear` `[out, in]` in the checkpoint and Burn `[in, out]` in the model, which
//! [`HfNaming`](kiln_hf::HfNaming) records as a transpose.
//!
//! ```no_run
//! use burn::backend::Flex;
//! use kiln_llama::{Llama, LlamaConfig};
//!
//! let dir = "models/hf/tests/fixtures/tiny-llama";
//! let model = Llama::<Flex>::from_pretrained(dir, &Default::default())?;
//! model.save_pretrained(&LlamaConfig::from_dir(dir)?, "/tmp/llama-copy")?;
//! # Ok::<(), kiln_hf::HfError>(())
//! ```
#![warn(missing_docs)]

mod config;
mod model;

pub use config::{LlamaConfig, RopeParameters};
pub use model::{Attention, DecoderLayer, Llama, LlamaModel, Mlp, Rope};

use burn::tensor::backend::Backend;
use kiln_hf::{HfError, SafetensorsFile, WEIGHTS_FILE};
use std::path::Path;

impl<B: Backend> Llama<B> {
    /// Loads `dir/config.json` and `dir/model.safetensors` onto `device`.
    ///
    /// # Errors
    /// A missing or invalid config, a missing weights file, or a missing or mis-shaped tensor
    /// (named, with both shapes).
    pub fn from_pretrained(dir: impl AsRef<Path>, device: &B::Device) -> Result<Self, HfError> {
        let config = LlamaConfig::from_dir(&dir)?;
        config
            .init(device)
            .load_safetensors(dir.as_ref().join(WEIGHTS_FILE))
    }

    /// Replaces every parameter by the tensor of the safetensors file at `path`.
    ///
    /// # Errors
    /// As [`kiln_hf::load_weights`].
    pub fn load_safetensors(self, path: impl AsRef<Path>) -> Result<Self, HfError> {
        let file = SafetensorsFile::open(path, "the model's weights")?;
        kiln_hf::load_weights(self, &file)
    }

    /// Writes the weights to `path` in Hugging Face names and shapes.
    ///
    /// # Errors
    /// When the file cannot be written.
    pub fn save_safetensors(&self, path: impl AsRef<Path>) -> Result<(), HfError> {
        kiln_hf::save_weights(self, path)
    }

    /// Writes `dir/config.json` (`config` with `model_type` and `architectures`, for transformers)
    /// and `dir/model.safetensors`, creating `dir`.
    ///
    /// # Errors
    /// When a file cannot be written.
    pub fn save_pretrained(
        &self,
        config: &LlamaConfig,
        dir: impl AsRef<Path>,
    ) -> Result<(), HfError> {
        let dir = dir.as_ref();
        std::fs::create_dir_all(dir).map_err(|source| HfError::Io {
            op: "write",
            path: dir.to_path_buf(),
            source,
        })?;
        kiln_hf::write_config(dir, config, "llama", "LlamaForCausalLM")?;
        self.save_safetensors(dir.join(WEIGHTS_FILE))
    }
}
