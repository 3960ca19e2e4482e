//! The Llama family's Hugging Face `config.json`.

use kiln_hf::{HfError, Unsupported};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// RoPE settings: transformers 5 writes `rope_parameters`, older versions `rope_theta` and
/// `rope_scaling` (whose type key is `type` or `rope_type`).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct RopeParameters {
    /// Base of the rotary frequencies.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_theta: Option<f64>,
    /// `default` is the only one implemented (no llama3/yarn/linear scaling).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_type: Option<String>,
    /// The older spelling of `rope_type`.
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    pub legacy_type: Option<String>,
}

fn default_positions() -> usize {
    2048
}
fn default_eps() -> f64 {
    1e-6
}
fn default_act() -> String {
    "silu".into()
}

/// The fields of a Llama `config.json` the model uses (others are ignored).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LlamaConfig {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Hidden size.
    pub hidden_size: usize,
    /// SwiGLU hidden size.
    pub intermediate_size: usize,
    /// Number of decoder layers.
    pub num_hidden_layers: usize,
    /// Number of query heads.
    pub num_attention_heads: usize,
    /// Number of key/value heads (grouped-query attention); all heads when absent.
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// Per-head size; `hidden_size / num_attention_heads` when absent.
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// Longest sequence trained for (RoPE itself has no limit; informational).
    #[serde(default = "default_positions")]
    pub max_position_embeddings: usize,
    /// RMSNorm epsilon.
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    /// Pre-transformers-5 RoPE base.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_theta: Option<f64>,
    /// transformers-5 RoPE settings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_parameters: Option<RopeParameters>,
    /// Pre-transformers-5 RoPE scaling (must be absent or `default`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<RopeParameters>,
    /// The head shares the token embedding.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Biases on q/k/v/o projections.
    #[serde(default)]
    pub attention_bias: bool,
    /// Biases on the MLP projections.
    #[serde(default)]
    pub mlp_bias: bool,
    /// Must be `silu`.
    #[serde(default = "default_act")]
    pub hidden_act: String,
}

impl LlamaConfig {
    /// Reads `dir/config.json` and validates it.
    ///
    /// # Errors
    /// As [`kiln_hf::read_config`], and [`HfError::UnsupportedConfig`] from [`Self::validate`].
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self, HfError> {
        kiln_hf::read_validated_config(dir, Self::validate)
    }

    /// Number of key/value heads.
    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// Per-head size.
    pub fn head_size(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// RoPE base: `rope_parameters.rope_theta`, else `rope_theta`, else 10000.
    pub fn theta(&self) -> f64 {
        self.rope_parameters
            .as_ref()
            .and_then(|r| r.rope_theta)
            .or(self.rope_theta)
            .unwrap_or(10_000.0)
    }

    /// Checks what the model implements: heads, GQA groups, even head size, default RoPE, SiLU.
    ///
    /// # Errors
    /// The reason, with the values.
    pub fn validate(&self) -> Result<(), Unsupported> {
        let (heads, kv) = (self.num_attention_heads, self.kv_heads());
        if heads == 0 || kv == 0 || !heads.is_multiple_of(kv) {
            return Err(Unsupported(format!(
                "num_attention_heads({heads}) is not a multiple of num_key_value_heads({kv})"
            )));
        }
        if self.head_size() == 0 || !self.head_size().is_multiple_of(2) {
            return Err(Unsupported(format!(
                "head_dim({}) must be even and > 0",
                self.head_size()
            )));
        }
        for rope in [&self.rope_parameters, &self.rope_scaling]
            .into_iter()
            .flatten()
        {
            let kind = rope.rope_type.as_ref().or(rope.legacy_type.as_ref());
            if let Some(kind) = kind
                && kind != "default"
            {
                return Err(Unsupported(format!(
                    "rope type '{kind}' (only 'default' RoPE is implemented)"
                )));
            }
        }
        if self.hidden_act != "silu" {
            return Err(Unsupported(format!(
                "hidden_act '{}' (only 'silu')",
                self.hidden_act
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> LlamaConfig {
        serde_json::from_str(json).expect("valid config")
    }

    const BASE: &str = r#""vocab_size": 8, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2"#;

    #[test]
    fn theta_from_either_spelling() {
        assert_eq!(parse(&format!("{{{BASE}}}")).theta(), 10_000.0);
        assert_eq!(
            parse(&format!(r#"{{{BASE}, "rope_theta": 5e5}}"#)).theta(),
            5e5
        );
        let v5 = parse(&format!(
            r#"{{{BASE}, "rope_parameters": {{"rope_theta": 1e6, "rope_type": "default"}}}}"#
        ));
        assert_eq!(v5.theta(), 1e6);
        assert_eq!(v5.validate(), Ok(()));
    }

    #[test]
    fn scaled_rope_and_bad_groups_are_rejected() {
        let scaled = parse(&format!(
            r#"{{{BASE}, "rope_scaling": {{"type": "llama3", "factor": 8.0}}}}"#
        ));
        assert!(
            scaled
                .validate()
                .expect_err("llama3")
                .0
                .contains("'llama3'")
        );
        let gqa = parse(&format!(r#"{{{BASE}, "num_key_value_heads": 3}}"#));
        assert!(
            gqa.validate()
                .expect_err("2 heads, 3 kv heads")
                .0
                .contains("num_attention_heads(2)")
        );
    }
}
