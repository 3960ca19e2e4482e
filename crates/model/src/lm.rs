//! Causal language models: the forward contract, the loss, and generation.

use burn::tensor::activation::log_softmax;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, ElementConversion, IndexingUpdateOp, Int, Tensor, TensorData};
use kiln_comm::hash::SplitMix64;

/// The additive causal attention mask `[1, 1, seq, seq]`: 0 where a position may attend, the
/// most negative float above the diagonal.
pub fn causal_mask<B: Backend>(seq: usize, device: &B::Device) -> Tensor<B, 4> {
    let values: Vec<f32> = (0..seq * seq)
        .map(|i| if i % seq > i / seq { f32::MIN } else { 0.0 })
        .collect();
    Tensor::from_data(TensorData::new(values, [1, 1, seq, seq]), device)
}

/// `scores + mask` for scores `[batch, heads, seq, seq]` and the mask `[1, seq * seq]`. Flex adds a
/// broadcast operand with its SIMD kernel only when the operand is one row repeated (`[1, 1, seq,
/// seq]` against 4-d scores walks both element by element); flattened, the mask is that row.
pub fn masked_scores<B: Backend>(scores: Tensor<B, 4>, mask: &Tensor<B, 2>) -> Tensor<B, 4> {
    let shape = scores.dims();
    let [batch, heads, rows, cols] = shape;
    // In the scores' dtype: an f32 mask would promote compute-dtype scores to f32 under mixed
    // precision (f32::MIN rounds to -inf in bf16 and f16: the same zero weight).
    let mask = match scores.dtype() {
        dtype if dtype != mask.dtype() => mask.clone().cast(dtype),
        _ => mask.clone(),
    };
    (scores.reshape([batch * heads, rows * cols]) + mask).reshape(shape)
}

/// Softmax over the last dimension of attention scores. Burn 0.21's autodiff has no softmax node of
/// its own: it differentiates the default `exp(x - max) / sum`, whose division costs four
/// score-sized ops backward. Multiplying by the reciprocal of the sums costs two; the backend's
/// fused softmax serves whenever nothing is differentiated.
pub fn attention_softmax<B: Backend>(scores: Tensor<B, 4>) -> Tensor<B, 4> {
    if !B::ad_enabled(&scores.device()) {
        return burn::tensor::activation::softmax(scores, 3);
    }
    let max = scores.clone().detach().max_dim(3);
    let exp = (scores - max).exp();
    let inv_sum = exp.clone().sum_dim(3).recip();
    exp * inv_sum
}

/// Logits of a head tied to the token embedding: `x [batch, seq, d] · embeddingᵀ`.
pub fn tied_logits<B: Backend>(x: Tensor<B, 3>, embedding: Tensor<B, 2>) -> Tensor<B, 3> {
    let [batch, seq, d] = x.dims();
    let [vocab, _] = embedding.dims();
    x.reshape([batch * seq, d])
        .matmul(embedding.transpose())
        .reshape([batch, seq, vocab])
}

/// A decoder-only language model.
pub trait CausalLm<B: Backend> {
    /// Logits `[batch, seq, vocab]` of the next token at every position of `input_ids`
    /// `[batch, seq]` (causal: position `t` sees positions `0..=t`).
    fn forward(&self, input_ids: Tensor<B, 2, Int>) -> Tensor<B, 3>;

    /// The vocabulary size.
    fn vocab_size(&self) -> usize;

    /// The longest sequence the model accepts (GPT-2's learned positions), `None` if unbounded.
    fn max_seq_len(&self) -> Option<usize>;
}

/// Mean token cross-entropy of `logits` `[batch, seq, vocab]` against `labels` `[batch, seq]` (the
/// next-token targets, already shifted), over all positions: PyTorch's
/// `cross_entropy(logits.reshape(-1, V), labels.reshape(-1))`. Returns shape `[1]`.
///
/// The loss runs in f32 whatever the logits' dtype (autocast's f32 list). When gradients are
/// taken (an autodiff backend) and the logits are bf16 (mixed precision), it is fused: the
/// loss and its gradient with respect to the logits, `(softmax - onehot) / rows`, are computed
/// together, a block of rows at a time in f32 ([`fused_cross_entropy`]), so what backward
/// keeps is that gradient in bf16, half the bytes of the f32 tensor the composed log-softmax
/// keeps (`exp`'s), and the loss forms no f32 tensor larger than a block (autocast's cast to
/// f32 copies the logits whole; on Flex, kiln's decorator also takes the dot product and
/// writes the gradient's blocks without f32 or whole-size copies). f32 logits keep the composed path: there the gradient would cost as much as
/// what it keeps, and its in-place ops peak lower.
///
/// # Panics
/// If the batch and sequence dimensions of `logits` and `labels` differ.
pub fn causal_lm_loss<B: Backend>(logits: Tensor<B, 3>, labels: Tensor<B, 2, Int>) -> Tensor<B, 1> {
    let [batch, seq, vocab] = logits.dims();
    assert_eq!(
        labels.dims(),
        [batch, seq],
        "causal_lm_loss: labels {:?} do not match logits {:?}",
        labels.dims(),
        [batch, seq, vocab]
    );
    let logits = logits.reshape([batch * seq, vocab]);
    let labels = labels.reshape([batch * seq, 1]);
    if B::ad_enabled(&logits.device()) && logits.dtype() == DType::BF16 {
        // `None` where a logit is infinite (see `fused_cross_entropy`).
        if let Some(loss) = fused_cross_entropy(logits.clone(), labels.clone()) {
            return loss;
        }
    }
    composed_cross_entropy(logits, labels)
}

/// Mean cross-entropy of `logits` `[rows, vocab]` against `labels` `[rows, 1]`, composed of
/// `log_softmax` (in f32 for half-precision logits) and `gather`.
fn composed_cross_entropy<B: Backend>(
    logits: Tensor<B, 2>,
    labels: Tensor<B, 2, Int>,
) -> Tensor<B, 1> {
    let logits = match logits.dtype() {
        DType::F32 | DType::F64 => logits,
        _ => logits.cast(DType::F32),
    };
    log_softmax(logits, 1).gather(1, labels).mean().neg()
}

/// The most f32 values a block of [`fused_cross_entropy`] holds: 4 MiB.
const LOSS_BLOCK_VALUES: usize = 1 << 20;

/// Mean cross-entropy of `logits` `[rows, vocab]` (bf16; any float dtype with f32's range)
/// against `labels` `[rows, 1]`, whose backward is the gradient computed here in forward.
///
/// The rows are taken in blocks (an eighth of them, at most [`LOSS_BLOCK_VALUES`] values): each
/// block widened to f32, its log-sum-exp, the picked logits, and `(softmax - onehot) / rows`,
/// which is rounded to the logits' dtype into `grad` (detached, written in place). The loss is
/// their mean value plus `s - s.detach()`, zero in value, for `s = logits · grad` (one dot
/// product): its gradient with respect to the logits is `grad` times the incoming gradient,
/// and autodiff keeps only `grad` for it, the logits' size in their dtype. Values are those of
/// the composed `log_softmax` in f32 up to rounding; the gradient reaching the logits is the
/// f32 gradient rounded to their dtype, as autocast's cast rounds it. The incoming gradient
/// reaches `s` through a cast to bf16, so it is rounded too: exact when it is 1 (the trainer's
/// loss) or a power of two (a loss divided by 2, 4 or 8 micro-batches); a loss divided by 3
/// scales every gradient it gives by 0.333984 instead of 1/3 (+0.2%, within bf16's rounding
/// of each value). f16 logits keep the composed path: their range cannot hold `grad` before
/// a loss scale multiplies it.
///
/// `s` is read once on the host (a synchronisation, as reading the loss is): a logit of
/// `-inf` (a vocabulary mask in bf16) times its zero gradient makes it NaN, and then this is
/// `None` and the caller takes the composed loss, which stays finite there.
fn fused_cross_entropy<B: Backend>(
    logits: Tensor<B, 2>,
    labels: Tensor<B, 2, Int>,
) -> Option<Tensor<B, 1>> {
    let [rows, vocab] = logits.dims();
    let device = logits.device();
    let dtype = logits.dtype();
    let values = logits.clone().detach();
    let mut grad = Tensor::<B, 2>::zeros([rows, vocab], (&device, dtype));
    let mut total = Tensor::<B, 1>::zeros([1], (&device, DType::F32));
    let block = rows
        .div_ceil(8)
        .min((LOSS_BLOCK_VALUES / vocab.max(1)).max(1))
        .max(1);
    let minus_one = |n: usize| Tensor::<B, 2>::full([n, 1], -1.0, (&device, DType::F32));
    for start in (0..rows).step_by(block) {
        let end = (start + block).min(rows);
        let picks = labels.clone().slice([start..end, 0..1]);
        let x = values
            .clone()
            .slice([start..end, 0..vocab])
            .cast(DType::F32);
        let shifted = x.clone() - x.max_dim(1);
        let exp = shifted.clone().exp();
        let sum = exp.clone().sum_dim(1);
        let picked = shifted.gather(1, picks.clone());
        total = total + (sum.clone().log() - picked).sum();
        let block_grad = (exp * sum.recip())
            .scatter(1, picks, minus_one(end - start), IndexingUpdateOp::Add)
            .div_scalar(rows as f64);
        grad = grad.slice_assign([start..end, 0..vocab], block_grad.cast(dtype));
    }
    let loss = total.div_scalar(rows as f64);
    let s = logits
        .reshape([1, rows * vocab])
        .matmul(grad.reshape([rows * vocab, 1]))
        .reshape([1])
        .cast(DType::F32);
    let value: f32 = s.clone().detach().into_scalar().elem();
    value.is_finite().then(|| loss + (s.clone() - s.detach()))
}

/// How the next token is chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Sampling {
    /// The most likely token (the first one on ties, as `torch.argmax`).
    Greedy,
    /// A draw from `softmax(logits / temperature)`, reproducible from `seed`.
    Temperature {
        /// Must be > 0; below 1 sharpens, above 1 flattens.
        temperature: f64,
        /// Seed of the sampler.
        seed: u64,
    },
}

/// Generation settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GenerateConfig {
    /// At most this many new tokens.
    pub max_new_tokens: usize,
    /// How tokens are chosen.
    pub sampling: Sampling,
    /// Stop after generating this token (it is included in the output).
    pub stop_token: Option<u32>,
}

fn argmax(values: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in values.iter().enumerate() {
        if v > values[best] {
            best = i;
        }
    }
    best
}

fn sample(values: &[f32], temperature: f64, rng: &mut SplitMix64) -> usize {
    let max = values.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let weights: Vec<f64> = values
        .iter()
        .map(|&v| ((v as f64 - max) / temperature).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    let mut target = rng.next_f64() * total;
    for (i, w) in weights.iter().enumerate() {
        if target < *w {
            return i;
        }
        target -= w;
    }
    // Rounding left `target` just above the last weight: the last non-zero token.
    weights
        .iter()
        .rposition(|&w| w > 0.0)
        .expect("softmax has a non-zero weight")
}

/// Continues `prompt` (non-empty) by up to `config.max_new_tokens` tokens and returns the new tokens.
/// Each step runs the model on the whole sequence (no KV cache), cropped to the model's
/// [`CausalLm::max_seq_len`] most recent tokens.
///
/// # Panics
/// If `prompt` is empty or a temperature is not > 0.
pub fn generate<B: Backend, M: CausalLm<B>>(
    model: &M,
    prompt: &[u32],
    config: &GenerateConfig,
    device: &B::Device,
) -> Vec<u32> {
    generate_with(prompt, config, model.max_seq_len(), |window| {
        let len = window.len();
        let input =
            Tensor::<B, 2, Int>::from_data(TensorData::new(window.to_vec(), [1, len]), device);
        let logits = model.forward(input);
        let vocab = logits.dims()[2];
        logits
            .slice([0..1, len - 1..len, 0..vocab])
            .into_data()
            .convert::<f32>()
            .to_vec::<f32>()
            .expect("converted to f32")
    })
}

/// [`generate`] with the model given as `next_logits(window)`: the logits of the token after
/// `window` (the last `max_seq_len` tokens so far). A pipeline computes them over its stages;
/// every rank that calls this with the same logits draws the same tokens.
///
/// # Panics
/// If `prompt` is empty, or the temperature is not positive.
pub fn generate_with(
    prompt: &[u32],
    config: &GenerateConfig,
    max_seq_len: Option<usize>,
    mut next_logits: impl FnMut(&[i64]) -> Vec<f32>,
) -> Vec<u32> {
    assert!(!prompt.is_empty(), "generate: the prompt is empty");
    let mut rng = match config.sampling {
        Sampling::Greedy => SplitMix64(0),
        Sampling::Temperature { temperature, seed } => {
            assert!(
                temperature > 0.0,
                "generate: temperature must be > 0, got {temperature}"
            );
            SplitMix64(seed)
        }
    };
    let mut tokens: Vec<u32> = prompt.to_vec();
    let mut new = Vec::with_capacity(config.max_new_tokens);
    for _ in 0..config.max_new_tokens {
        let start = max_seq_len.map_or(0, |max| tokens.len().saturating_sub(max));
        let window: Vec<i64> = tokens[start..].iter().map(|&t| i64::from(t)).collect();
        let last = next_logits(&window);
        let next = match config.sampling {
            Sampling::Greedy => argmax(&last),
            Sampling::Temperature { temperature, .. } => sample(&last, temperature, &mut rng),
        } as u32;
        tokens.push(next);
        new.push(next);
        if config.stop_token == Some(next) {
            break;
        }
    }
    new
}

#[cfg(test)]
mod tests {
    use super::*;

    type TB = burn::backend::Flex;

    #[test]
    fn loss_is_mean_cross_entropy() {
        let device = Default::default();
        // Uniform logits: every token costs ln(V).
        let logits = Tensor::<TB, 3>::zeros([2, 3, 5], &device);
        let labels = Tensor::<TB, 2, Int>::from_data(
            TensorData::new(vec![0i64, 1, 2, 3, 4, 0], [2, 3]),
            &device,
        );
        let loss: f32 = causal_lm_loss(logits, labels.clone()).into_scalar();
        assert!((loss - 5f32.ln()).abs() < 1e-6, "{loss}");
        // One confident, correct position among six: its cost drops to ~0.
        let mut values = vec![0.0f32; 30];
        values[0] = 100.0;
        let logits = Tensor::<TB, 3>::from_data(TensorData::new(values, [2, 3, 5]), &device);
        let loss: f32 = causal_lm_loss(logits, labels).into_scalar();
        assert!((loss - 5.0 * 5f32.ln() / 6.0).abs() < 1e-5, "{loss}");
    }

    /// The fused loss (autodiff, bf16 logits) gives the composed log-softmax's value and
    /// gradient: for row counts whose last block is short (11 rows: blocks of 2; 34: of 5), an
    /// incoming gradient other than 1, labels at both ends of the vocabulary, and a logit of
    /// `-inf` (where `s` is NaN and the composed loss is taken).
    #[test]
    fn fused_loss_is_the_composed_loss() {
        type AD = burn::backend::Autodiff<TB>;
        let device = Default::default();
        for ([b, s, v], masked) in [
            ([1, 11, 50], false),
            ([2, 17, 9], false),
            ([3, 7, 50], false),
            ([1, 1, 9], false),
            ([2, 17, 9], true),
        ] {
            let n = b * s * v;
            let mut values: Vec<f32> = (0..n)
                .map(|i| ((i * 7919 % 113) as f32 - 56.0) * 0.09)
                .collect();
            let labels: Vec<i64> = (0..b * s)
                .map(|i| [0, v - 1, i % v][i % 3] as i64)
                .collect();
            if masked {
                // A logit no label picks (row 0's label is 0).
                values[1] = f32::NEG_INFINITY;
            }
            let labels = Tensor::<AD, 2, Int>::from_data(TensorData::new(labels, [b, s]), &device);
            let run = |fused: bool| {
                let logits =
                    Tensor::<AD, 3>::from_data(TensorData::new(values.clone(), [b, s, v]), &device)
                        .cast(DType::BF16)
                        .require_grad();
                let loss = match fused {
                    true => {
                        let rows = logits.clone().reshape([b * s, v]);
                        let picks = labels.clone().reshape([b * s, 1]);
                        // Fused unless a logit is infinite.
                        let taken = fused_cross_entropy(rows, picks).is_some();
                        assert_eq!(taken, !masked, "{v}");
                        causal_lm_loss(logits.clone(), labels.clone())
                    }
                    false => composed_cross_entropy(
                        logits.clone().reshape([b * s, v]),
                        labels.clone().reshape([b * s, 1]),
                    ),
                };
                let value: f32 = loss.clone().into_scalar();
                let grads = loss.mul_scalar(0.37).backward();
                let grad = logits.grad(&grads).expect("a gradient").cast(DType::F32);
                (value, grad.into_data().to_vec::<f32>().unwrap())
            };
            let (fused, fused_grad) = run(true);
            let (want, want_grad) = run(false);
            assert!(want.is_finite(), "{v}: {want}");
            assert!(
                (fused - want).abs() <= 1e-5 * want.abs().max(1.0),
                "{v}: {fused} vs {want}"
            );
            // Both round the gradient to bf16, the fused one twice (its gradient, then the
            // product by the incoming 0.37, itself rounded): up to 1.04% apart here, values
            // below 1e-5 within the absolute 1e-7.
            for (i, (g, w)) in fused_grad.iter().zip(&want_grad).enumerate() {
                assert!(
                    (g - w).abs() <= 1e-2 * w.abs() + 1e-7,
                    "{v} [{i}]: {g} vs {w}"
                );
            }
        }
    }

    #[test]
    fn argmax_takes_first_on_ties() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, -1.0]), 1);
    }

    #[test]
    fn sampling_is_seeded_and_follows_the_distribution() {
        let logits = [0.0f32, (3.0f64).ln() as f32, f32::NEG_INFINITY];
        let draw = |seed| {
            let mut rng = SplitMix64(seed);
            (0..4000)
                .map(|_| sample(&logits, 1.0, &mut rng))
                .collect::<Vec<_>>()
        };
        let a = draw(7);
        assert_eq!(a, draw(7), "same seed, same tokens");
        assert_ne!(a, draw(8), "another seed, other tokens");
        assert!(
            a.iter().all(|&t| t < 2),
            "a zero-probability token was drawn"
        );
        let ones = a.iter().filter(|&&t| t == 1).count() as f64 / a.len() as f64;
        assert!(
            (ones - 0.75).abs() < 0.03,
            "P(token 1) = {ones}, expected 0.75"
        );
    }
}
