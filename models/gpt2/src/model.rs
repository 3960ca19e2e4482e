//! The GPT-2 modules, their fields named as Hugging Face's so that Burn paths are checkpoint names.

use crate::{Gelu, Gpt2Config};
use burn::module::{Initializer, Module};
use burn::nn::{Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::tensor::activation::{gelu, sigmoid};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};
use kiln_hf::{HfNaming, HfTensorName};
use kiln_model::{
    Carry, CausalLm, Staged, Unit, attention_softmax, causal_mask, masked_scores, tied_logits,
};
use std::ops::Range;

/// GPT-2 initialisation: N(0, 0.02) (biases too; Hugging Face zeroes them, which only matters for
/// training from scratch).
const INIT: Initializer = Initializer::Normal {
    mean: 0.0,
    std: 0.02,
};

fn linear<B: Backend>(d_in: usize, d_out: usize, bias: bool, device: &B::Device) -> Linear<B> {
    LinearConfig::new(d_in, d_out)
        .with_bias(bias)
        .with_initializer(INIT)
        .init(device)
}

/// Causal self-attention with fused QKV projection (`c_attn`: `[n_embd, 3 n_embd]`).
#[derive(Module, Debug)]
pub struct Attention<B: Backend> {
    /// Fused query, key, value projection.
    pub c_attn: Linear<B>,
    /// Output projection.
    pub c_proj: Linear<B>,
    n_head: usize,
    /// Multiplies the scores: `1/sqrt(head_dim)`, further `/(layer + 1)` when configured.
    scale: f64,
}

impl<B: Backend> Attention<B> {
    fn forward(&self, x: Tensor<B, 3>, mask: &Tensor<B, 2>) -> Tensor<B, 3> {
        let [batch, seq, d] = x.dims();
        let h = self.n_head;
        // `[batch, seq, 3d]` is contiguous, so viewing it as `[batch, 3h, seq, head_dim]` copies
        // nothing; q, k, v are then views that the matmuls read through their strides (slicing the
        // last dimension first would force a copy per reshape).
        let qkv = self
            .c_attn
            .forward(x)
            .reshape([batch, seq, 3 * h, d / h])
            .swap_dims(1, 2);
        let head = |i: usize| qkv.clone().narrow(1, i * h, h);
        // Scaling q (`seq x head_dim`) is cheaper than scaling the scores (`seq x seq`).
        let q = head(0).mul_scalar(self.scale);
        let scores = masked_scores(q.matmul(head(1).swap_dims(2, 3)), mask);
        let out = attention_softmax(scores).matmul(head(2));
        self.c_proj
            .forward(out.swap_dims(1, 2).reshape([batch, seq, d]))
    }
}

/// The feed-forward block.
#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    /// Up projection.
    pub c_fc: Linear<B>,
    /// Down projection.
    pub c_proj: Linear<B>,
    tanh_gelu: bool,
}

/// HF `gelu_new`, `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x³)))`, written as
/// `x sigmoid(2 sqrt(2/pi) x (1 + 0.044715 x²))` (the same function: `(1 + tanh(z)) / 2 =
/// sigmoid(2z)`): six ops instead of nine, and sigmoid, whose backward is fused, costs an `exp` where
/// `tanh` costs libm's much slower `tanhf`. (Burn's `gelu_approximate` computes `x³` with `powf`,
/// which is undefined for negative `x` on some backends.)
fn gelu_tanh<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    const TWICE_SQRT_2_OVER_PI: f64 =
        2.0 * core::f64::consts::FRAC_2_SQRT_PI * core::f64::consts::FRAC_1_SQRT_2;
    let z = x
        .clone()
        .square()
        .mul_scalar(TWICE_SQRT_2_OVER_PI * 0.044715)
        .add_scalar(TWICE_SQRT_2_OVER_PI)
        * x.clone();
    x * sigmoid(z)
}

impl<B: Backend> Mlp<B> {
    fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let h = self.c_fc.forward(x);
        let h = if self.tanh_gelu {
            gelu_tanh(h)
        } else {
            gelu(h)
        };
        self.c_proj.forward(h)
    }
}

/// A pre-norm transformer block.
#[derive(Module, Debug)]
pub struct Block<B: Backend> {
    /// Norm before attention.
    pub ln_1: LayerNorm<B>,
    /// Attention.
    pub attn: Attention<B>,
    /// Norm before the MLP.
    pub ln_2: LayerNorm<B>,
    /// The MLP.
    pub mlp: Mlp<B>,
}

impl<B: Backend> Block<B> {
    fn forward(&self, x: Tensor<B, 3>, mask: &Tensor<B, 2>) -> Tensor<B, 3> {
        let x = x.clone() + self.attn.forward(self.ln_1.forward(x), mask);
        x.clone() + self.mlp.forward(self.ln_2.forward(x))
    }
}

/// Embeddings, blocks and the final norm (HF `GPT2Model`).
#[derive(Module, Debug)]
pub struct Gpt2Transformer<B: Backend> {
    /// Token embedding `[vocab, n_embd]` (also the head when tied).
    pub wte: Embedding<B>,
    /// Learned positions `[n_positions, n_embd]`.
    pub wpe: Embedding<B>,
    /// The blocks.
    pub h: Vec<Block<B>>,
    /// Final norm.
    pub ln_f: LayerNorm<B>,
}

/// GPT-2 with its language-model head (HF `GPT2LMHeadModel`).
#[derive(Module, Debug)]
pub struct Gpt2<B: Backend> {
    /// The body.
    pub transformer: Gpt2Transformer<B>,
    /// An untied head `[n_embd, vocab]`; `None` when the head is `wte` (the usual case).
    pub lm_head: Option<Linear<B>>,
    n_positions: usize,
}

impl Gpt2Config {
    /// A model with random weights (lazily initialised, so loading weights right after costs no
    /// random init).
    ///
    /// # Panics
    /// If the config does not [`validate`](Self::validate).
    pub fn init<B: Backend>(&self, device: &B::Device) -> Gpt2<B> {
        if let Err(reason) = self.validate() {
            panic!("invalid GPT-2 config: {reason}");
        }
        let d = self.n_embd;
        let head_dim = (d / self.n_head) as f64;
        let tanh_gelu = self.gelu().expect("validated") == Gelu::Tanh;
        let norm = || {
            LayerNormConfig::new(d)
                .with_epsilon(self.layer_norm_epsilon)
                .init(device)
        };
        let h = (0..self.n_layer)
            .map(|layer| {
                let mut scale = if self.scale_attn_weights {
                    1.0 / head_dim.sqrt()
                } else {
                    1.0
                };
                if self.scale_attn_by_inverse_layer_idx {
                    scale /= (layer + 1) as f64;
                }
                Block {
                    ln_1: norm(),
                    attn: Attention {
                        c_attn: linear(d, 3 * d, true, device),
                        c_proj: linear(d, d, true, device),
                        n_head: self.n_head,
                        scale,
                    },
                    ln_2: norm(),
                    mlp: Mlp {
                        c_fc: linear(d, self.inner_size(), true, device),
                        c_proj: linear(self.inner_size(), d, true, device),
                        tanh_gelu,
                    },
                }
            })
            .collect();
        let embedding = |n| {
            EmbeddingConfig::new(n, d)
                .with_initializer(INIT)
                .init(device)
        };
        Gpt2 {
            transformer: Gpt2Transformer {
                wte: embedding(self.vocab_size),
                wpe: embedding(self.n_positions),
                h,
                ln_f: norm(),
            },
            lm_head: (!self.tie_word_embeddings).then(|| linear(d, self.vocab_size, false, device)),
            n_positions: self.n_positions,
        }
    }
}

/// `[1, 1, seq, seq]`: 0 where a position may attend, `f32::MIN` above the diagonal (as HF's eager
/// attention; finite so that no `inf - inf` can appear).
impl<B: Backend> Gpt2<B> {
    /// Logits `[batch, seq, vocab]` for `input_ids` `[batch, seq]`.
    ///
    /// # Panics
    /// If `seq` exceeds `n_positions`.
    pub fn forward(&self, input_ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let units = self.transformer.h.len() + 2;
        self.forward_units(0..units, Carry::Tokens(input_ids))
            .hidden()
    }

    /// The embedding unit: token plus position embeddings.
    fn embed(&self, input_ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let [batch, seq] = input_ids.dims();
        assert!(
            seq <= self.n_positions,
            "GPT-2 forward: sequence length {seq} exceeds n_positions({})",
            self.n_positions
        );
        let device = input_ids.device();
        let t = &self.transformer;
        let positions = Tensor::<B, 1, Int>::arange(0..seq as i64, &device).reshape([1, seq]);
        // Flattened, the positions are one row added to every sequence: Flex's SIMD broadcast
        // (`[1, seq, d]` against `[batch, seq, d]` walks both element by element).
        let d = t.wpe.weight.dims()[1];
        (t.wte.forward(input_ids).reshape([batch, seq * d])
            + t.wpe.forward(positions).reshape([1, seq * d]))
        .reshape([batch, seq, d])
    }

    /// The head unit: the final norm and the (tied or untied) projection to the vocabulary.
    fn head(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let t = &self.transformer;
        let x = t.ln_f.forward(x);
        match &self.lm_head {
            Some(head) => head.forward(x),
            None => tied_logits(x, t.wte.weight.val()),
        }
    }
}

/// Units: the embeddings, one per block, and the head (the final norm with `lm_head`, or with
/// `wte` when tied).
impl<B: Backend> Staged<B> for Gpt2<B> {
    fn units(&self) -> Vec<Unit> {
        let blocks = self.transformer.h.len();
        let head = match self.lm_head {
            Some(_) => "lm_head",
            None => "transformer.wte",
        };
        std::iter::once(Unit::new("embed", &["transformer.wte", "transformer.wpe"]))
            .chain(
                (0..blocks).map(|i| Unit::new(format!("h.{i}"), &[&format!("transformer.h.{i}")])),
            )
            .chain(std::iter::once(Unit::new(
                "head",
                &["transformer.ln_f", head],
            )))
            .collect()
    }

    fn forward_units(&self, units: Range<usize>, x: Carry<B>) -> Carry<B> {
        let blocks = self.transformer.h.len();
        assert!(
            units.end <= blocks + 2,
            "GPT-2 has {} units, asked for {units:?}",
            blocks + 2
        );
        let mut x = x;
        let mut mask = None;
        for unit in units {
            x = Carry::Hidden(if unit == 0 {
                self.embed(x.tokens())
            } else if unit <= blocks {
                let x = x.hidden();
                let mask = mask.get_or_insert_with(|| {
                    let seq = x.dims()[1];
                    causal_mask::<B>(seq, &x.device()).reshape([1, seq * seq])
                });
                self.transformer.h[unit - 1].forward(x, mask)
            } else {
                self.head(x.hidden())
            });
        }
        x
    }
}

impl<B: Backend> CausalLm<B> for Gpt2<B> {
    fn forward(&self, input_ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        Gpt2::forward(self, input_ids)
    }

    fn vocab_size(&self) -> usize {
        self.transformer.wte.weight.dims()[0]
    }

    fn max_seq_len(&self) -> Option<usize> {
        Some(self.n_positions)
    }
}

impl<B: Backend> HfNaming for Gpt2<B> {
    /// Burn paths are the checkpoint names, except LayerNorm's `gamma`/`beta` (HF `weight`/`bias`).
    /// HF's Conv1D stores `[in, out]`, Burn's layout: nothing is transposed but an untied
    /// `lm_head` (an `nn.Linear`).
    fn hf_tensor(burn_path: &str) -> HfTensorName {
        let name = if let Some(prefix) = burn_path.strip_suffix(".gamma") {
            format!("{prefix}.weight")
        } else if let Some(prefix) = burn_path.strip_suffix(".beta") {
            format!("{prefix}.bias")
        } else {
            burn_path.to_string()
        };
        HfTensorName {
            transposed: name == "lm_head.weight",
            name,
        }
    }

    /// The key third of each block's fused QKV bias (`c_attn.bias[n_embd..2 n_embd]`).
    fn zero_gradient_parts(&self) -> Vec<(String, std::ops::Range<usize>)> {
        let d = self.transformer.wte.weight.dims()[1];
        (0..self.transformer.h.len())
            .map(|i| (format!("transformer.h.{i}.attn.c_attn.bias"), d..2 * d))
            .collect()
    }
}
