//! The Llama modules, their fields named as Hugging Face's so that Burn paths are checkpoint names.

use crate::LlamaConfig;
use burn::module::{Initializer, Module};
use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig, RmsNorm, RmsNormConfig};
use burn::tensor::activation::silu;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use kiln_hf::{HfNaming, HfTensorName};
use kiln_model::{
    Carry, CausalLm, Staged, Unit, attention_softmax, causal_mask, masked_scores, tied_logits,
};
use std::ops::Range;

/// Llama initialisation: N(0, 0.02) (`initializer_range`).
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

/// Rotary position embedding tables, computed as transformers' default RoPE does: in float32,
/// `inv_freq[i] = 1 / theta^(2i / head_dim)`, angle `= position * inv_freq`, both halves of the head
/// rotated by the same frequencies (`rotate_half`, not interleaved pairs).
#[derive(Debug, Clone, Copy)]
pub struct Rope {
    theta: f64,
    head_dim: usize,
    /// Query heads.
    heads: usize,
    /// Key/value heads.
    kv_heads: usize,
}

impl Rope {
    /// `(cos, sin)` for positions `0..seq`, each `seq * head_dim` values, position-major.
    fn angles(&self, seq: usize) -> (Vec<f64>, Vec<f64>) {
        let half = self.head_dim / 2;
        let theta = self.theta as f32;
        let inv_freq: Vec<f32> = (0..half)
            .map(|i| 1.0 / theta.powf((2 * i) as f32 / self.head_dim as f32))
            .collect();
        let mut cos = Vec::with_capacity(seq * self.head_dim);
        let mut sin = Vec::with_capacity(seq * self.head_dim);
        for pos in 0..seq {
            for j in 0..self.head_dim {
                let angle = f64::from(pos as f32 * inv_freq[j % half]);
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        (cos, sin)
    }

    /// The tables for a projection of `heads` heads, its outputs then multiplied by `scale`.
    fn tables<B: Backend>(
        &self,
        (cos, sin): &(Vec<f64>, Vec<f64>),
        heads: usize,
        scale: f64,
        device: &B::Device,
    ) -> RopeTables<B> {
        let d = self.head_dim;
        let seq = cos.len() / d;
        // Position-major, then head, as the projection's `[batch, seq, heads * head_dim]`:
        // one position's values made on the host, repeated over the heads on the device.
        let row = |table: &[f64]| {
            let values: Vec<f32> = table.iter().map(|&v| (v * scale) as f32).collect();
            Tensor::<B, 3>::from_data(TensorData::new(values, [seq, 1, d]), device)
                .repeat_dim(1, heads)
                .reshape([1, seq * heads * d])
        };
        // `x · R = rotate_half(x) = cat(-x2, x1)`: a signed permutation.
        let half = d / 2;
        let mut rotation = vec![0f32; d * d];
        for j in 0..half {
            rotation[(j + half) * d + j] = -1.0;
            rotation[j * d + j + half] = 1.0;
        }
        RopeTables {
            cos: row(cos),
            sin: row(sin),
            rotation: Tensor::from_data(TensorData::new(rotation, [d, d]), device),
            head_dim: d,
        }
    }
}

/// One forward's RoPE for one projection: `scale (x cos + rotate_half(x) sin)`.
///
/// Applied to the projection's contiguous `[batch, seq, heads * head_dim]` output, before the heads
/// are split: with cos and sin repeated over the heads and flattened to one row, both products run
/// as Flex's SIMD row broadcast (`[1, 1, seq, head_dim]` against transposed heads walks them
/// element by element, after a copy). `rotate_half` is one small matmul by a signed permutation
/// (exact: one product per output, the rest zeros) in place of two slices, a negation and a cat,
/// whose backward would allocate and fill full-size zeros per slice. The attention scale is folded
/// into the tables (exact when it is a power of two, as for head sizes 4, 16, 64, 256).
struct RopeTables<B: Backend> {
    cos: Tensor<B, 2>,
    sin: Tensor<B, 2>,
    rotation: Tensor<B, 2>,
    head_dim: usize,
}

impl<B: Backend> RopeTables<B> {
    fn apply(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let shape = x.dims();
        let [batch, seq, width] = shape;
        let d = self.head_dim;
        let rotated = x
            .clone()
            .reshape([batch * seq * width / d, d])
            .matmul(self.rotation.clone())
            .reshape([batch, seq * width]);
        // In the projection's dtype (transformers casts cos and sin to it): f32 tables would
        // promote compute-dtype queries and keys to f32 under mixed precision.
        let dtype = x.dtype();
        let table = |t: &Tensor<B, 2>| match t.dtype() == dtype {
            true => t.clone(),
            false => t.clone().cast(dtype),
        };
        (x.reshape([batch, seq * width]) * table(&self.cos) + rotated * table(&self.sin))
            .reshape(shape)
    }
}

/// Grouped-query self-attention with rotary positions.
#[derive(Module, Debug)]
pub struct Attention<B: Backend> {
    /// Query projection `[hidden, heads * head_dim]`.
    pub q_proj: Linear<B>,
    /// Key projection `[hidden, kv_heads * head_dim]`.
    pub k_proj: Linear<B>,
    /// Value projection `[hidden, kv_heads * head_dim]`.
    pub v_proj: Linear<B>,
    /// Output projection `[heads * head_dim, hidden]`.
    pub o_proj: Linear<B>,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
}

impl<B: Backend> Attention<B> {
    fn forward(
        &self,
        x: Tensor<B, 3>,
        rope: &AttentionRope<B>,
        mask: &Tensor<B, 2>,
    ) -> Tensor<B, 3> {
        let [batch, seq, _] = x.dims();
        let (h, kv, d) = (self.n_heads, self.n_kv_heads, self.head_dim);
        let group = h / kv;
        // Views: the matmuls read the transposed heads through their strides.
        let split =
            |t: Tensor<B, 3>, heads: usize| t.reshape([batch, seq, heads, d]).swap_dims(1, 2);
        let q = split(rope.q.apply(self.q_proj.forward(x.clone())), h);
        let k = split(rope.k.apply(self.k_proj.forward(x.clone())), kv);
        let v = split(self.v_proj.forward(x), kv);
        let scores = if group == 1 {
            q.matmul(k.swap_dims(2, 3))
        } else {
            // Query head i reads key/value head i / group (transformers' `repeat_kv`). A key/value
            // head's `group` query heads are adjacent: as `[batch, kv, group * seq, d]` (one copy of
            // q) one matmul per key/value head serves its whole group, and keys and values are
            // never repeated.
            q.reshape([batch, kv, group * seq, d])
                .matmul(k.swap_dims(2, 3))
                .reshape([batch, h, seq, seq])
        };
        let probs = attention_softmax(masked_scores(scores, mask));
        let out = if group == 1 {
            probs.matmul(v)
        } else {
            probs
                .reshape([batch, kv, group * seq, seq])
                .matmul(v)
                .reshape([batch, h, seq, d])
        };
        self.o_proj
            .forward(out.swap_dims(1, 2).reshape([batch, seq, h * d]))
    }
}

/// One forward's RoPE tables for queries (with the attention scale) and keys.
struct AttentionRope<B: Backend> {
    q: RopeTables<B>,
    k: RopeTables<B>,
}

/// SwiGLU feed-forward: `down(silu(gate(x)) * up(x))`.
#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    /// Gate projection.
    pub gate_proj: Linear<B>,
    /// Up projection.
    pub up_proj: Linear<B>,
    /// Down projection.
    pub down_proj: Linear<B>,
}

impl<B: Backend> Mlp<B> {
    fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let gate = silu(self.gate_proj.forward(x.clone()));
        self.down_proj.forward(gate * self.up_proj.forward(x))
    }
}

/// A pre-norm decoder layer.
#[derive(Module, Debug)]
pub struct DecoderLayer<B: Backend> {
    /// Attention.
    pub self_attn: Attention<B>,
    /// The MLP.
    pub mlp: Mlp<B>,
    /// Norm before attention.
    pub input_layernorm: RmsNorm<B>,
    /// Norm before the MLP.
    pub post_attention_layernorm: RmsNorm<B>,
}

/// Embedding, layers and the final norm (HF `LlamaModel`).
#[derive(Module, Debug)]
pub struct LlamaModel<B: Backend> {
    /// Token embedding `[vocab, hidden]`.
    pub embed_tokens: Embedding<B>,
    /// The layers.
    pub layers: Vec<DecoderLayer<B>>,
    /// Final norm.
    pub norm: RmsNorm<B>,
    rope: Rope,
}

/// A Llama-family causal LM (HF `LlamaForCausalLM`).
#[derive(Module, Debug)]
pub struct Llama<B: Backend> {
    /// The body.
    pub model: LlamaModel<B>,
    /// The head `[hidden, vocab]`; `None` when tied to `embed_tokens`.
    pub lm_head: Option<Linear<B>>,
}

impl LlamaConfig {
    /// A model with random weights (lazily initialised, so loading weights right after costs no
    /// random init).
    ///
    /// # Panics
    /// If the config does not [`validate`](Self::validate).
    pub fn init<B: Backend>(&self, device: &B::Device) -> Llama<B> {
        if let Err(reason) = self.validate() {
            panic!("invalid Llama config: {reason}");
        }
        let (hidden, d) = (self.hidden_size, self.head_size());
        let (h, kv) = (self.num_attention_heads, self.kv_heads());
        let norm = || {
            RmsNormConfig::new(hidden)
                .with_epsilon(self.rms_norm_eps)
                .init(device)
        };
        let (attn_bias, mlp_bias) = (self.attention_bias, self.mlp_bias);
        let layers = (0..self.num_hidden_layers)
            .map(|_| DecoderLayer {
                self_attn: Attention {
                    q_proj: linear(hidden, h * d, attn_bias, device),
                    k_proj: linear(hidden, kv * d, attn_bias, device),
                    v_proj: linear(hidden, kv * d, attn_bias, device),
                    o_proj: linear(h * d, hidden, attn_bias, device),
                    n_heads: h,
                    n_kv_heads: kv,
                    head_dim: d,
                },
                mlp: Mlp {
                    gate_proj: linear(hidden, self.intermediate_size, mlp_bias, device),
                    up_proj: linear(hidden, self.intermediate_size, mlp_bias, device),
                    down_proj: linear(self.intermediate_size, hidden, mlp_bias, device),
                },
                input_layernorm: norm(),
                post_attention_layernorm: norm(),
            })
            .collect();
        Llama {
            model: LlamaModel {
                embed_tokens: EmbeddingConfig::new(self.vocab_size, hidden)
                    .with_initializer(INIT)
                    .init(device),
                layers,
                norm: norm(),
                rope: Rope {
                    theta: self.theta(),
                    head_dim: d,
                    heads: h,
                    kv_heads: kv,
                },
            },
            lm_head: (!self.tie_word_embeddings)
                .then(|| linear(hidden, self.vocab_size, false, device)),
        }
    }
}

/// `[1, 1, seq, seq]`: 0 where a position may attend, `f32::MIN` above the diagonal (finite, as
/// transformers' eager mask, so that no `inf - inf` can appear).
impl<B: Backend> Llama<B> {
    /// Logits `[batch, seq, vocab]` for `input_ids` `[batch, seq]`.
    pub fn forward(&self, input_ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let units = self.model.layers.len() + 2;
        self.forward_units(0..units, Carry::Tokens(input_ids))
            .hidden()
    }

    /// The rotary tables and the causal mask for sequences of `seq` tokens.
    fn position_tables(&self, seq: usize, device: &B::Device) -> (AttentionRope<B>, Tensor<B, 2>) {
        let m = &self.model;
        let angles = m.rope.angles(seq);
        let rope = AttentionRope {
            q: m.rope.tables(
                &angles,
                m.rope.heads,
                1.0 / (m.rope.head_dim as f64).sqrt(),
                device,
            ),
            k: m.rope.tables(&angles, m.rope.kv_heads, 1.0, device),
        };
        let mask = causal_mask::<B>(seq, device).reshape([1, seq * seq]);
        (rope, mask)
    }
}

/// Units: the embedding, one per decoder layer, and the head (the final norm with `lm_head`, or
/// with `embed_tokens` when tied).
impl<B: Backend> Staged<B> for Llama<B> {
    fn units(&self) -> Vec<Unit> {
        let layers = self.model.layers.len();
        let head = match self.lm_head {
            Some(_) => "lm_head",
            None => "model.embed_tokens",
        };
        std::iter::once(Unit::new("embed", &["model.embed_tokens"]))
            .chain(
                (0..layers)
                    .map(|i| Unit::new(format!("layers.{i}"), &[&format!("model.layers.{i}")])),
            )
            .chain(std::iter::once(Unit::new("head", &["model.norm", head])))
            .collect()
    }

    fn forward_units(&self, units: Range<usize>, x: Carry<B>) -> Carry<B> {
        let m = &self.model;
        let layers = m.layers.len();
        assert!(
            units.end <= layers + 2,
            "Llama has {} units, asked for {units:?}",
            layers + 2
        );
        let mut x = x;
        let mut tables = None;
        for unit in units {
            x = Carry::Hidden(if unit == 0 {
                m.embed_tokens.forward(x.tokens())
            } else if unit <= layers {
                let x = x.hidden();
                let (rope, mask) =
                    tables.get_or_insert_with(|| self.position_tables(x.dims()[1], &x.device()));
                let layer = &m.layers[unit - 1];
                let attn =
                    layer
                        .self_attn
                        .forward(layer.input_layernorm.forward(x.clone()), rope, mask);
                let x = x + attn;
                x.clone() + layer.mlp.forward(layer.post_attention_layernorm.forward(x))
            } else {
                let x = m.norm.forward(x.hidden());
                match &self.lm_head {
                    Some(head) => head.forward(x),
                    None => tied_logits(x, m.embed_tokens.weight.val()),
                }
            });
        }
        x
    }
}

impl<B: Backend> CausalLm<B> for Llama<B> {
    fn forward(&self, input_ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        Llama::forward(self, input_ids)
    }

    fn vocab_size(&self) -> usize {
        self.model.embed_tokens.weight.dims()[0]
    }

    fn max_seq_len(&self) -> Option<usize> {
        None
    }
}

impl<B: Backend> HfNaming for Llama<B> {
    /// Burn paths are the checkpoint names, except RMSNorm's `gamma` (HF `weight`). Projection and
    /// head weights are PyTorch `nn.Linear`, `[out, in]`: transposed.
    fn hf_tensor(burn_path: &str) -> HfTensorName {
        let name = match burn_path.strip_suffix(".gamma") {
            Some(prefix) => format!("{prefix}.weight"),
            None => burn_path.to_string(),
        };
        HfTensorName {
            transposed: name.ends_with("_proj.weight") || name == "lm_head.weight",
            name,
        }
    }

    /// `k_proj.bias` of every layer, when the config has attention biases.
    fn zero_gradient_parts(&self) -> Vec<(String, std::ops::Range<usize>)> {
        self.model
            .layers
            .iter()
            .enumerate()
            .filter_map(|(i, layer)| {
                let bias = layer.self_attn.k_proj.bias.as_ref()?;
                Some((
                    format!("model.layers.{i}.self_attn.k_proj.bias"),
                    0..bias.dims()[0],
                ))
            })
            .collect()
    }
}
