//! GPT-2's Hugging Face `config.json`.

use kiln_hf::{HfError, Unsupported};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The GELU variant of the MLP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gelu {
    /// `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x³)))`: HF `gelu_new`, `gelu_pytorch_tanh`,
    /// `gelu_fast` (GPT-2's own).
    Tanh,
    /// `x Φ(x)` with the exact error function: HF `gelu`.
    Erf,
}

fn default_activation() -> String {
    "gelu_new".into()
}
fn default_eps() -> f64 {
    1e-5
}
fn yes() -> bool {
    true
}

/// The fields of GPT-2's `config.json` the model uses (others are ignored).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Gpt2Config {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Number of learned positions (the longest sequence).
    pub n_positions: usize,
    /// Hidden size.
    pub n_embd: usize,
    /// Number of blocks.
    pub n_layer: usize,
    /// Number of attention heads.
    pub n_head: usize,
    /// MLP hidden size (`4 n_embd` when null).
    #[serde(default)]
    pub n_inner: Option<usize>,
    /// `gelu_new` (GPT-2), `gelu_pytorch_tanh`, `gelu_fast` or `gelu`.
    #[serde(default = "default_activation")]
    pub activation_function: String,
    /// LayerNorm epsilon.
    #[serde(default = "default_eps")]
    pub layer_norm_epsilon: f64,
    /// Divide attention scores by `sqrt(head_dim)`.
    #[serde(default = "yes")]
    pub scale_attn_weights: bool,
    /// Also divide attention scores of block `i` by `i + 1`.
    #[serde(default)]
    pub scale_attn_by_inverse_layer_idx: bool,
    /// The head shares the token embedding (HF default); otherwise `lm_head.weight` is its own.
    #[serde(default = "yes")]
    pub tie_word_embeddings: bool,
}

impl Gpt2Config {
    /// GPT-2 of these sizes with the rest as Hugging Face's GPT-2 has it (`4 n_embd` MLP,
    /// `gelu_new`, epsilon 1e-5, scores scaled by `sqrt(head_dim)`, tied embeddings).
    pub fn new(
        vocab_size: usize,
        n_positions: usize,
        n_embd: usize,
        n_layer: usize,
        n_head: usize,
    ) -> Self {
        Gpt2Config {
            vocab_size,
            n_positions,
            n_embd,
            n_layer,
            n_head,
            n_inner: None,
            activation_function: default_activation(),
            layer_norm_epsilon: default_eps(),
            scale_attn_weights: true,
            scale_attn_by_inverse_layer_idx: false,
            tie_word_embeddings: true,
        }
    }

    /// Reads `dir/config.json` and validates it.
    ///
    /// # Errors
    /// As [`kiln_hf::read_config`], and [`HfError::UnsupportedConfig`] from [`Self::validate`].
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self, HfError> {
        kiln_hf::read_validated_config(dir, Self::validate)
    }

    /// Checks what the model needs: heads divide the hidden size, a known activation.
    ///
    /// # Errors
    /// The reason, with the values.
    pub fn validate(&self) -> Result<(), Unsupported> {
        if self.n_head == 0 || !self.n_embd.is_multiple_of(self.n_head) {
            return Err(Unsupported(format!(
                "n_embd({}) is not a multiple of n_head({})",
                self.n_embd, self.n_head
            )));
        }
        self.gelu().map(|_| ())
    }

    /// The MLP's GELU variant.
    ///
    /// # Errors
    /// For an activation other than the GELUs.
    pub fn gelu(&self) -> Result<Gelu, Unsupported> {
        match self.activation_function.as_str() {
            "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => Ok(Gelu::Tanh),
            "gelu" => Ok(Gelu::Erf),
            other => Err(Unsupported(format!(
                "activation_function '{other}' (supported: gelu_new, gelu_pytorch_tanh, gelu_fast, gelu)"
            ))),
        }
    }

    /// MLP hidden size.
    pub fn inner_size(&self) -> usize {
        self.n_inner.unwrap_or(4 * self.n_embd)
    }
}
