//! What to adapt and how: [`LoraConfig`] and the target patterns.

use serde::{Deserialize, Serialize};

/// Low-rank adapters on chosen weights: `W' = W + (alpha / r) B A`, with `A` `[r, in]` and `B`
/// `[out, r]` as in Hu et al. 2021 and PEFT.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoraConfig {
    /// The adapters' rank.
    pub r: usize,
    /// The scale numerator: updates are scaled by `alpha / r` (by `alpha / sqrt(r)` under
    /// `rslora`).
    pub alpha: f64,
    /// Dropout on the adapters' input while they train (PEFT's `lora_dropout`):
    /// `base(x) + s B A drop(x)`, in `[0, 1)`.
    pub dropout: f64,
    /// Which weights get adapters (see [`matches`]): module paths' last components (`q_proj`),
    /// globs over the module path (`*.attn.c_attn`), or `all-linear`.
    pub targets: Vec<String>,
    /// Rank-stabilised scaling `alpha / sqrt(r)` (Kalajdzievski 2023; PEFT's `use_rslora`).
    pub rslora: bool,
    /// Seeds the draw of the `A` matrices (the same on every rank).
    pub seed: u64,
    /// QLoRA: the base's linear weights (every `Linear` but `lm_head`, and every target)
    /// stored 4-bit (NF4 with double quantisation, see [`crate::quant`]) and dequantised on
    /// use.
    #[serde(default)]
    pub qlora: bool,
}

impl Default for LoraConfig {
    /// r 8, alpha 16, no dropout, attention projections of Llama and GPT-2.
    fn default() -> Self {
        LoraConfig {
            r: 8,
            alpha: 16.0,
            dropout: 0.0,
            targets: ["q_proj", "k_proj", "v_proj", "o_proj", "c_attn"]
                .map(String::from)
                .to_vec(),
            rslora: false,
            seed: 0,
            qlora: false,
        }
    }
}

impl LoraConfig {
    /// The factor the adapters' product is scaled by.
    pub fn scaling(&self) -> f64 {
        if self.rslora {
            self.alpha / (self.r as f64).sqrt()
        } else {
            self.alpha / self.r as f64
        }
    }
}

/// The pattern that targets every `Linear` weight except the output layer (PEFT's
/// `all-linear`).
pub const ALL_LINEAR: &str = "all-linear";

/// Whether `pattern` selects the weight of module `module_path` (dot-separated, e.g.
/// `model.layers.0.self_attn.q_proj`) held by a container of type `container` (Burn's
/// `Struct:Linear`):
/// - `all-linear`: every `Linear` except one named `lm_head` (PEFT leaves the output layer out);
/// - a pattern with `*`: a glob over the whole path, `*` matching any run of characters, dots
///   included;
/// - otherwise PEFT's rule for a list of names: the path equals the pattern or ends with
///   `.pattern`.
pub fn matches(pattern: &str, module_path: &str, container: &str) -> bool {
    if pattern == ALL_LINEAR {
        let last = module_path.rsplit('.').next().unwrap_or(module_path);
        return container == "Struct:Linear" && last != "lm_head";
    }
    if pattern.contains('*') {
        return glob(pattern.as_bytes(), module_path.as_bytes());
    }
    module_path == pattern
        || module_path
            .strip_suffix(pattern)
            .is_some_and(|head| head.ends_with('.'))
}

/// `*`-only glob: the classic two-pointer match with backtracking to the last star.
fn glob(pattern: &[u8], text: &[u8]) -> bool {
    let (mut p, mut t) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while t < text.len() {
        if p < pattern.len() && pattern[p] == b'*' {
            star = Some((p, t));
            p += 1;
        } else if p < pattern.len() && pattern[p] == text[t] {
            p += 1;
            t += 1;
        } else if let Some((sp, st)) = star {
            p = sp + 1;
            t = st + 1;
            star = Some((sp, st + 1));
        } else {
            return false;
        }
    }
    pattern[p..].iter().all(|&c| c == b'*')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_match_whole_components_only() {
        assert!(matches(
            "q_proj",
            "model.layers.0.self_attn.q_proj",
            "Struct:Linear"
        ));
        assert!(matches("c_proj", "transformer.h.1.mlp.c_proj", ""));
        assert!(matches("mlp.c_proj", "transformer.h.1.mlp.c_proj", ""));
        assert!(!matches("proj", "model.layers.0.self_attn.q_proj", ""));
        assert!(matches("lm_head", "lm_head", ""));
    }

    #[test]
    fn globs_span_dots() {
        assert!(matches("*.attn.c_attn", "transformer.h.0.attn.c_attn", ""));
        assert!(matches(
            "*layers.1.*_proj",
            "model.layers.1.mlp.up_proj",
            ""
        ));
        assert!(!matches(
            "*layers.1.*_proj",
            "model.layers.0.mlp.up_proj",
            ""
        ));
        assert!(!matches("*.c_attn", "transformer.h.0.attn.c_attn.x", ""));
    }

    #[test]
    fn all_linear_leaves_the_output_layer() {
        assert!(matches(
            ALL_LINEAR,
            "transformer.h.0.mlp.c_fc",
            "Struct:Linear"
        ));
        assert!(!matches(ALL_LINEAR, "lm_head", "Struct:Linear"));
        assert!(!matches(ALL_LINEAR, "transformer.wte", "Struct:Embedding"));
    }

    #[test]
    fn scaling() {
        let c = LoraConfig {
            r: 4,
            alpha: 8.0,
            ..Default::default()
        };
        assert_eq!(c.scaling(), 2.0);
        assert_eq!(LoraConfig { rslora: true, ..c }.scaling(), 4.0);
    }
}
