//! Which model: the one place kiln turns a `model_type` into a model.
//!
//! [`ModelType`] names a family (from a recipe or a `config.json`), [`ModelConfig`] holds its
//! config, and [`with_model_type!`](crate::with_model_type) runs code with the family's Burn
//! module type: `kiln verify-hf` and `kiln train` both dispatch through it.

use kiln_gpt2::Gpt2Config;
use kiln_hf::{HfError, config_path, model_type};
use kiln_llama::LlamaConfig;
use serde_json::json;
use std::path::Path;

/// A model family kiln implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ModelType {
    /// GPT-2 (`kiln-gpt2`).
    Gpt2,
    /// Llama (`kiln-llama`).
    Llama,
}

impl ModelType {
    /// Every family, in order.
    pub const ALL: [ModelType; 2] = [ModelType::Gpt2, ModelType::Llama];

    /// The Hugging Face `model_type`.
    pub fn name(self) -> &'static str {
        match self {
            ModelType::Gpt2 => "gpt2",
            ModelType::Llama => "llama",
        }
    }

    /// The accepted names, comma-separated.
    pub fn names() -> String {
        Self::ALL.map(Self::name).join(", ")
    }

    /// The weights LoRA adapts when none are named: the attention projections (PEFT's
    /// defaults for these families).
    pub fn default_lora_targets(self) -> &'static [&'static str] {
        match self {
            ModelType::Gpt2 => &["c_attn", "attn.c_proj"],
            ModelType::Llama => &["q_proj", "k_proj", "v_proj", "o_proj"],
        }
    }

    /// The family a `model_type` names.
    pub fn from_name(name: &str) -> Option<ModelType> {
        Self::ALL.into_iter().find(|t| t.name() == name)
    }

    /// The family of a Hugging Face directory (its `config.json`'s `model_type`).
    ///
    /// # Errors
    /// A missing or invalid config; [`HfError::UnsupportedModel`] for a family kiln does not
    /// implement.
    pub fn of_dir(dir: impl AsRef<Path>) -> Result<ModelType, HfError> {
        let dir = dir.as_ref();
        let name = model_type(dir)?;
        Self::from_name(&name).ok_or_else(|| HfError::UnsupportedModel {
            model_type: name,
            path: config_path(dir),
            supported: Self::names(),
        })
    }
}

impl std::fmt::Display for ModelType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A model family and its config.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelConfig {
    /// GPT-2.
    Gpt2(Gpt2Config),
    /// Llama.
    Llama(LlamaConfig),
}

/// The sizes of a model made from scratch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sizes {
    /// Token ids the model embeds.
    pub vocab: usize,
    /// Hidden size.
    pub dim: usize,
    /// Transformer blocks.
    pub layers: usize,
    /// Attention heads.
    pub heads: usize,
    /// The longest sequence.
    pub context: usize,
}

impl ModelConfig {
    /// The config of a Hugging Face directory.
    ///
    /// # Errors
    /// As [`ModelType::of_dir`]; a config the family cannot run.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<ModelConfig, HfError> {
        let dir = dir.as_ref();
        Ok(match ModelType::of_dir(dir)? {
            ModelType::Gpt2 => ModelConfig::Gpt2(Gpt2Config::from_dir(dir)?),
            ModelType::Llama => ModelConfig::Llama(LlamaConfig::from_dir(dir)?),
        })
    }

    /// A fresh model of `kind` and `sizes` (Llama's MLP is 4 x `dim`).
    ///
    /// # Errors
    /// Sizes the family cannot run.
    pub fn fresh(kind: ModelType, sizes: Sizes) -> Result<ModelConfig, HfError> {
        let config = match kind {
            ModelType::Gpt2 => json!({
                "model_type": "gpt2",
                "vocab_size": sizes.vocab,
                "n_positions": sizes.context,
                "n_embd": sizes.dim,
                "n_layer": sizes.layers,
                "n_head": sizes.heads,
            }),
            ModelType::Llama => json!({
                "model_type": "llama",
                "vocab_size": sizes.vocab,
                "hidden_size": sizes.dim,
                "intermediate_size": 4 * sizes.dim,
                "num_hidden_layers": sizes.layers,
                "num_attention_heads": sizes.heads,
                "max_position_embeddings": sizes.context,
            }),
        };
        ModelConfig::from_json(kind, &config)
    }

    /// A config from its family and JSON (as a snapshot's manifest stores it).
    ///
    /// # Errors
    /// An invalid config, or one the family cannot run.
    pub fn from_json(kind: ModelType, config: &serde_json::Value) -> Result<ModelConfig, HfError> {
        let invalid = |reason: String| HfError::InvalidConfig {
            model_type: kind.name().to_string(),
            reason,
        };
        let unsupported = |e: kiln_hf::Unsupported| invalid(e.0);
        Ok(match kind {
            ModelType::Gpt2 => {
                let c: Gpt2Config =
                    serde_json::from_value(config.clone()).map_err(|e| invalid(e.to_string()))?;
                c.validate().map_err(unsupported)?;
                ModelConfig::Gpt2(c)
            }
            ModelType::Llama => {
                let c: LlamaConfig =
                    serde_json::from_value(config.clone()).map_err(|e| invalid(e.to_string()))?;
                c.validate().map_err(unsupported)?;
                ModelConfig::Llama(c)
            }
        })
    }

    /// The family.
    pub fn kind(&self) -> ModelType {
        match self {
            ModelConfig::Gpt2(_) => ModelType::Gpt2,
            ModelConfig::Llama(_) => ModelType::Llama,
        }
    }

    /// The config as JSON.
    pub fn to_json(&self) -> serde_json::Value {
        match self {
            ModelConfig::Gpt2(c) => serde_json::to_value(c),
            ModelConfig::Llama(c) => serde_json::to_value(c),
        }
        .expect("configs serialise")
    }

    /// The longest sequence the model was configured for.
    pub fn max_positions(&self) -> usize {
        match self {
            ModelConfig::Gpt2(c) => c.n_positions,
            ModelConfig::Llama(c) => c.max_position_embeddings,
        }
    }

    /// Megatron's tensor-parallel split of the family, as a `parallel.tp_plan`: GPT-2's fused
    /// `c_attn` by columns in three blocks (q, k, v), `c_fc` by columns, both `c_proj` by rows;
    /// Llama's q/k/v/gate/up by columns, o/down by rows.
    pub fn tp_plan(&self) -> &'static str {
        match self {
            ModelConfig::Gpt2(_) => "c_attn=colwise/3,c_fc=colwise,c_proj=rowwise",
            ModelConfig::Llama(_) => {
                "q_proj=colwise,k_proj=colwise,v_proj=colwise,gate_proj=colwise,\
                 up_proj=colwise,o_proj=rowwise,down_proj=rowwise"
            }
        }
    }

    /// Whether `tp` ranks can split the model by [`tp_plan`](Self::tp_plan): whole heads (and
    /// KV heads) and MLP units per rank.
    ///
    /// # Errors
    /// The first size `tp` does not divide, named.
    pub fn check_tp(&self, tp: usize) -> Result<(), String> {
        let sizes: Vec<(&str, usize)> = match self {
            ModelConfig::Gpt2(c) => vec![
                ("n_head", c.n_head),
                ("the MLP's inner size", c.n_inner.unwrap_or(4 * c.n_embd)),
            ],
            ModelConfig::Llama(c) => vec![
                ("num_attention_heads", c.num_attention_heads),
                (
                    "num_key_value_heads",
                    c.num_key_value_heads.unwrap_or(c.num_attention_heads),
                ),
                ("intermediate_size", c.intermediate_size),
            ],
        };
        match sizes.iter().find(|(_, n)| tp == 0 || !n.is_multiple_of(tp)) {
            Some((name, n)) => Err(format!(
                "{name} ({n}) is not a multiple of tp ({tp}): each tensor-parallel rank holds \
                 an equal share of whole heads and MLP units"
            )),
            None => Ok(()),
        }
    }

    /// The number of token ids the model embeds.
    pub fn vocab_size(&self) -> usize {
        match self {
            ModelConfig::Gpt2(c) => c.vocab_size,
            ModelConfig::Llama(c) => c.vocab_size,
        }
    }
}

/// Runs `$body` with `$model` the Burn module type of the family `$kind` (a [`ModelType`]) and
/// `$config` its config (from a [`ModelConfig`] when given one):
///
/// ```
/// use kiln_zoo::{ModelType, with_model_type};
/// let n = with_model_type!(ModelType::Llama, M => std::any::type_name::<M<kiln::Train<kiln::Flex>>>().len());
/// assert!(n > 0);
/// ```
#[macro_export]
macro_rules! with_model_type {
    ($kind:expr, $model:ident => $body:expr) => {
        match $kind {
            $crate::ModelType::Gpt2 => {
                #[allow(dead_code)]
                type $model<X> = $crate::__models::Gpt2<X>;
                $body
            }
            $crate::ModelType::Llama => {
                #[allow(dead_code)]
                type $model<X> = $crate::__models::Llama<X>;
                $body
            }
        }
    };
    ($config:expr, $model:ident, $c:ident => $body:expr) => {
        match $config {
            $crate::ModelConfig::Gpt2($c) => {
                #[allow(dead_code)]
                type $model<X> = $crate::__models::Gpt2<X>;
                $body
            }
            $crate::ModelConfig::Llama($c) => {
                #[allow(dead_code)]
                type $model<X> = $crate::__models::Llama<X>;
                $body
            }
        }
    };
}
