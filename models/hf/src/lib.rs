//! Hugging Face formats for kiln's models, and parity with PyTorch.
//!
//! - [`load_weights`] / [`save_weights`]: safetensors checkpoints in Hugging Face names and layouts
//!   for any Burn module that says, through [`HfNaming`], which checkpoint tensor each parameter is.
//!   The key decision: one naming table per model serves loading, saving, gradient norms and final
//!   weights, and errors name the checkpoint tensor with both shapes (see [`weights`] for why the
//!   `safetensors` crate is used directly rather than `burn-store`).
//! - [`read_config`]: a model's serde config from `config.json`.
//! - [`ByteTokenizer`]: vocab 256, any UTF-8 text.
//! - [`Reference`] and [`verify::verify_model`]: PyTorch's numbers for a fixture directory and the
//!   comparison against them (forward, loss, gradient norms, AdamW training, final weights).
//!
//! The models themselves live in `kiln-gpt2` and `kiln-llama`; `kiln-zoo` picks one by `model_type`.
//!
//! ```
//! use kiln_hf::ByteTokenizer;
//!
//! let ids = ByteTokenizer.encode("kiln ☃");
//! assert_eq!(ids.len(), 8); // the snowman is three bytes
//! assert_eq!(ByteTokenizer.decode(&ids), "kiln ☃");
//! ```
#![warn(missing_docs)]

mod config;
mod error;
mod pretrained;
mod reference;
mod safetensors_file;
mod tokenizer;
pub mod verify;
pub mod weights;

pub use config::{
    CONFIG_FILE, REFERENCE_FILE, WEIGHTS_FILE, config_path, model_type, read_config,
    read_validated_config, write_config,
};
pub use error::{HfError, Unsupported};
pub use pretrained::Pretrained;
pub use reference::{AdamWSettings, Reference};
pub use safetensors_file::SafetensorsFile;
pub use tokenizer::{ByteTokenizer, TOKENIZER_FILE, Tokenizer};
pub use weights::{
    HfGrads, HfNaming, HfTensorName, hf_grad_norms, hf_grads, hf_tensors, load_weights,
    load_weights_named, save_weights, save_weights_as, torch_dtype_name, write_tensors,
    write_tensors_as,
};
