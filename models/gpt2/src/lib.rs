//! GPT-2 for Burn, written single-device and generic over `B: Backend`, loading and saving Hugging
//! Face checkpoints.
//!
//! Learned positions, pre-norm LayerNorm blocks, GELU (tanh), causal attention with a fused QKV
//! projection, and a head tied to the token embedding. Module fields carry Hugging Face's names, so a
//! parameter's Burn path is its checkpoint name (LayerNorm's `gamma`/`beta` aside); Hugging Face
//! stores GPT-2's linear layers as Conv1D, `[in, out]`, which is Burn's `Linear` layout, so nothing
//! is transposed.
//!
//! ```no_run
//! use burn::backend::Flex;
//! use kiln_gpt2::Gpt2;
//!
//! let dir = "models/hf/tests/fixtures/tiny-gpt2";
//! let model = Gpt2::<Flex>::from_pretrained(dir, &Default::default())?;
//! model.save_pretrained(&kiln_gpt2::Gpt2Config::from_dir(dir)?, "/tmp/gpt2-copy")?;
//! # Ok::<(), kiln_hf::HfError>(())
//! ```
#![warn(missing_docs)]

mod config;
mod model;

pub use config::{Gelu, Gpt2Config};
pub use model::{Attention, Block, Gpt2, Gpt2Transformer, Mlp};

use burn::tensor::backend::Backend;
use kiln_hf::{HfError, SafetensorsFile, WEIGHTS_FILE};
use std::path::Path;

impl<B: Backend> Gpt2<B> {
    /// Loads `dir/config.json` and `dir/model.safetensors` onto `device`.
    ///
    /// # Errors
    /// A missing or invalid config, a missing weights file, or a missing or mis-shaped tensor
    /// (named, with both shapes).
    pub fn from_pretrained(dir: impl AsRef<Path>, device: &B::Device) -> Result<Self, HfError> {
        let config = Gpt2Config::from_dir(&dir)?;
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
        config: &Gpt2Config,
        dir: impl AsRef<Path>,
    ) -> Result<(), HfError> {
        let dir = dir.as_ref();
        std::fs::create_dir_all(dir).map_err(|source| HfError::Io {
            op: "write",
            path: dir.to_path_buf(),
            source,
        })?;
        kiln_hf::write_config(dir, config, "gpt2", "GPT2LMHeadModel")?;
        self.save_safetensors(dir.join(WEIGHTS_FILE))
    }
}
