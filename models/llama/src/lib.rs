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
//! use kiln_hf::Pretrained;
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
use kiln_hf::{HfError, Pretrained};
use std::path::Path;

impl<B: Backend> Pretrained<B> for Llama<B> {
    type Config = LlamaConfig;
    const MODEL_TYPE: &'static str = "llama";
    const ARCHITECTURE: &'static str = "LlamaForCausalLM";

    fn read_config(dir: &Path) -> Result<LlamaConfig, HfError> {
        LlamaConfig::from_dir(dir)
    }

    fn from_config(config: &LlamaConfig, device: &B::Device) -> Self {
        config.init(device)
    }
}
