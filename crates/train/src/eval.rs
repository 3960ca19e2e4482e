//! Validation and samples: the same fixed batches every time and at every world size, and a
//! sampled continuation of the validation text (every rank runs both: a ZeRO-3 forward
//! gathers parameters).

use crate::Recipe;
use crate::data::{Corpus, SplitMix64, batch, mix};
use crate::error::Result;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::module::AutodiffModule;
use burn::prelude::ElementConversion;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use kiln_comm::{ProcessGroup, ReduceOp};
use kiln_hf::Tokenizer;
use kiln_model::{CausalLm, GenerateConfig, Sampling, causal_lm_loss, generate, generate_with};
use kiln_shard::{Shard, Train};

/// The mean of `value` over the ranks of `group`.
pub(crate) fn all_mean(group: &dyn ProcessGroup, value: f64) -> Result<f64> {
    let mut buf = [value as f32];
    group.all_reduce((&mut buf[..]).into(), ReduceOp::Avg)?;
    Ok(f64::from(buf[0]))
}

/// The logits of the token after a window of token ids (a pipeline's, through its stages).
pub(crate) type NextLogits<'a> = dyn Fn(&[i64]) -> Vec<f32> + 'a;

/// A continuation of the validation text's start, sampled at temperature 0.8 (every rank
/// generates: a ZeRO-3 forward gathers parameters; rank 0 prints).
pub(crate) fn sample_text<B, C, M>(
    model: &M,
    corpus: &Corpus,
    tokenizer: &Tokenizer,
    t: &crate::TrainRecipe,
    precision: kiln_shard::Precision,
    device: &B::Device,
    pipelined: Option<&NextLogits>,
) -> String
where
    B: Backend,
    C: CheckpointStrategy,
    M: AutodiffModule<Train<B, C>>,
    M::InnerModule: CausalLm<Shard<B>>,
{
    // About 24 characters of prompt, whatever the tokenizer.
    let n = match tokenizer {
        Tokenizer::Bytes => 24,
        _ => 8,
    };
    let prompt: Vec<u32> = corpus.validation[..corpus.validation.len().min(n)].to_vec();
    let config = GenerateConfig {
        max_new_tokens: t.sample_chars,
        sampling: Sampling::Temperature {
            temperature: 0.8,
            seed: t.seed,
        },
        stop_token: None,
    };
    let new = kiln_shard::autocast(precision, || {
        let inner = model.valid();
        match pipelined {
            // Through the stages: every stage gets the logits and draws the same token.
            Some(logits) => generate_with(&prompt, &config, inner.max_seq_len(), logits),
            None => generate(&inner, &prompt, &config, device),
        }
    });
    format!("{}|{}", tokenizer.decode(&prompt), tokenizer.decode(&new))
}

pub(crate) fn tensors<AB: Backend>(
    b: &crate::data::Batch,
    device: &AB::Device,
) -> (Tensor<AB, 2, Int>, Tensor<AB, 2, Int>) {
    let shape = [b.rows, b.seq_len];
    (
        Tensor::from_data(TensorData::new(b.inputs.clone(), shape), device),
        Tensor::from_data(TensorData::new(b.targets.clone(), shape), device),
    )
}

/// This rank's rows of the validation batches: `eval_batches` draws from a stream of their own,
/// the same at every evaluation and every world size.
pub fn validation_batches(
    corpus: &Corpus,
    t: &crate::TrainRecipe,
    rank: usize,
    world: usize,
) -> Vec<crate::data::Batch> {
    let mut rng = SplitMix64(mix(t.seed ^ 0x7661_6c69_6461_7465));
    (0..t.eval_batches)
        .map(|_| {
            batch(
                &corpus.validation,
                &mut rng,
                t.batch_size,
                t.seq_len,
                rank,
                world,
            )
        })
        .collect()
}

/// The mean validation loss over `eval_batches` fixed batches (the same every time and at
/// every world size), or `None` when there are none; `group` is every rank, `dp` the ranks
/// that hold different rows.
pub(crate) fn evaluate<B, C, M>(
    model: &M,
    corpus: &Corpus,
    recipe: &Recipe,
    group: &dyn ProcessGroup,
    dp: &dyn ProcessGroup,
    device: &B::Device,
) -> Result<Option<f64>>
where
    B: Backend,
    C: CheckpointStrategy,
    M: AutodiffModule<Train<B, C>>,
    M::InnerModule: CausalLm<Shard<B>>,
{
    let t = &recipe.train;
    if t.eval_batches == 0 {
        return Ok(None);
    }
    let inner = model.valid();
    let mut total = 0.0;
    // Rows by data-parallel rank: a tensor-parallel group's ranks compute the same rows.
    for b in validation_batches(corpus, t, dp.rank(), dp.world_size()) {
        let (x, y) = tensors::<Shard<B>>(&b, device);
        // Evaluated in the precision the model trains in (as under torch.autocast).
        let loss: f64 = kiln_shard::autocast(recipe.train.precision, || {
            causal_lm_loss(inner.forward(x), y).into_scalar().elem()
        });
        total += loss;
    }
    Ok(Some(all_mean(group, total / t.eval_batches as f64)?))
}
