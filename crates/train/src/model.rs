//! Which model a run trains: GPT-2 or Llama, from the recipe's sizes or a Hugging Face directory.

use crate::ModelRecipe;
use crate::error::{Result, TrainError, fail};
use kiln_gpt2::Gpt2Config;
use kiln_llama::LlamaConfig;
use serde_json::json;

/// The vocabulary kiln's byte tokenizer needs.
pub const BYTE_VOCAB: usize = 256;

/// A model architecture and its config.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelSpec {
    /// GPT-2.
    Gpt2(Gpt2Config),
    /// Llama.
    Llama(LlamaConfig),
}

impl ModelSpec {
    /// The model a recipe asks for, to learn `tokenizer`'s tokens: a fresh model gets its
    /// vocabulary.
    ///
    /// # Errors
    /// An unknown kind, an unreadable or unsupported checkpoint config, a model vocabulary
    /// smaller than the tokenizer's.
    pub fn from_recipe(m: &ModelRecipe, tokenizer: &kiln_hf::Tokenizer) -> Result<ModelSpec> {
        let tokens = tokenizer.vocab_size();
        let spec = match &m.from {
            Some(dir) => {
                let kind = kiln_hf::model_type(dir)?;
                match kind.as_str() {
                    "gpt2" => ModelSpec::Gpt2(Gpt2Config::from_dir(dir)?),
                    "llama" => ModelSpec::Llama(LlamaConfig::from_dir(dir)?),
                    other => fail!(
                        Model,
                        "{} has model_type '{other}'; kiln trains gpt2 and llama",
                        kiln_hf::config_path(dir).display()
                    ),
                }
            }
            None => {
                let config = match m.kind.as_str() {
                    "gpt2" => json!({
                        "model_type": "gpt2",
                        "vocab_size": tokens,
                        "n_positions": m.context,
                        "n_embd": m.dim,
                        "n_layer": m.layers,
                        "n_head": m.heads,
                    }),
                    "llama" => json!({
                        "model_type": "llama",
                        "vocab_size": tokens,
                        "hidden_size": m.dim,
                        "intermediate_size": 4 * m.dim,
                        "num_hidden_layers": m.layers,
                        "num_attention_heads": m.heads,
                        "max_position_embeddings": m.context,
                    }),
                    other => fail!(Model, "model.kind = '{other}': expected gpt2 or llama"),
                };
                ModelSpec::from_json(&m.kind, &config)?
            }
        };
        let vocab = spec.vocab_size();
        if vocab < tokens {
            fail!(
                Model,
                "the model's vocabulary has {vocab} tokens; the tokenizer {} needs at least {tokens}",
                tokenizer.describe()
            );
        }
        Ok(spec)
    }

    /// A model from its kind and config JSON (as a snapshot's manifest stores it).
    ///
    /// # Errors
    /// An unknown kind or an invalid config.
    pub fn from_json(kind: &str, config: &serde_json::Value) -> Result<ModelSpec> {
        Ok(match kind {
            "gpt2" => {
                let c: Gpt2Config = serde_json::from_value(config.clone())
                    .map_err(|e| TrainError::Model(format!("an invalid GPT-2 config: {e}")))?;
                c.validate().map_err(TrainError::Model)?;
                ModelSpec::Gpt2(c)
            }
            "llama" => {
                let c: LlamaConfig = serde_json::from_value(config.clone())
                    .map_err(|e| TrainError::Model(format!("an invalid Llama config: {e}")))?;
                c.validate().map_err(TrainError::Model)?;
                ModelSpec::Llama(c)
            }
            other => fail!(Model, "unknown model kind '{other}' (gpt2, llama)"),
        })
    }

    /// `gpt2` or `llama`.
    pub fn kind(&self) -> &'static str {
        match self {
            ModelSpec::Gpt2(_) => "gpt2",
            ModelSpec::Llama(_) => "llama",
        }
    }

    /// The config as JSON.
    pub fn config_json(&self) -> serde_json::Value {
        match self {
            ModelSpec::Gpt2(c) => serde_json::to_value(c),
            ModelSpec::Llama(c) => serde_json::to_value(c),
        }
        .expect("configs serialise")
    }

    /// The longest sequence the model was configured for.
    pub fn max_positions(&self) -> usize {
        match self {
            ModelSpec::Gpt2(c) => c.n_positions,
            ModelSpec::Llama(c) => c.max_position_embeddings,
        }
    }

    /// The number of token ids the model embeds.
    pub fn vocab_size(&self) -> usize {
        match self {
            ModelSpec::Gpt2(c) => c.vocab_size,
            ModelSpec::Llama(c) => c.vocab_size,
        }
    }
}
