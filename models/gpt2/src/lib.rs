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
//! use kiln_hf::Pretrained;
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
use kiln_hf::{HfError, Pretrained};
use std::path::Path;

impl<B: Backend> Pretrained<B> for Gpt2<B> {
    type Config = Gpt2Config;
    const MODEL_TYPE: &'static str = "gpt2";
    const ARCHITECTURE: &'static str = "GPT2LMHeadModel";

    fn read_config(dir: &Path) -> Result<Gpt2Config, HfError> {
        Gpt2Config::from_dir(dir)
    }

    fn from_config(config: &Gpt2Config, device: &B::Device) -> Self {
        config.init(device)
    }
}
