//! The contract between kiln and a model, apart from any file format or strategy:
//!
//! - [`CausalLm`]: a decoder-only language model (token ids in, logits out), with
//!   [`causal_lm_loss`] and [`generate`]; the attention helpers kiln's models share;
//! - [`Staged`]: a model as a chain of [`Unit`]s, so that a pipeline can cut it into stages.
//!
//! kiln's sharding needs nothing from a model; a pipeline needs [`Staged`], the training job
//! [`CausalLm`]. The pipeline and LoRA crates depend on this crate, not on the Hugging Face file
//! formats (`kiln-hf`).
//!
//! ```
//! use kiln_model::Unit;
//!
//! let block = Unit::new("h.1", &["transformer.h.1"]);
//! assert!(block.uses("transformer.h.1.attn.c_attn.weight"));
//! assert!(!block.uses("transformer.h.10.attn.c_attn.weight"));
//! ```
#![warn(missing_docs)]

mod lm;
pub mod staged;

pub use lm::{
    CausalLm, GenerateConfig, Sampling, attention_softmax, causal_lm_loss, causal_mask, generate,
    generate_with, masked_scores, tied_logits,
};
pub use staged::{Carry, Staged, Unit};
