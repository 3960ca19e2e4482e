//! A pipelined run's side of the step, validation and samples, through [`Pipeline`].

use crate::error::Result;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::module::AutodiffModule;
use burn::optim::Optimizer;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use kiln_comm::{BufMut, BufRef, ProcessGroup};
use kiln_model::{Staged, causal_lm_loss};
use kiln_pipe::Pipeline;
use kiln_shard::{Shard, StepConfig, Train};

/// Inputs and next-token targets `[rows, seq]`, for evaluation on the inner backend.
pub(crate) type TokenBatch<B> = (Tensor<Shard<B>, 2, Int>, Tensor<Shard<B>, 2, Int>);

/// One pipelined step over this rank's rows `x`, `y` (cut into the pipeline's micro-batches),
/// through [`Pipeline::step`], with what the stage did.
#[allow(clippy::too_many_arguments)]
pub(crate) fn pipe_step<B, C, M, O>(
    pipe: &Pipeline,
    model: M,
    optim: &mut O,
    lr: f64,
    config: &StepConfig,
    x: &Tensor<Train<B, C>, 2, Int>,
    y: &Tensor<Train<B, C>, 2, Int>,
) -> Result<(M, kiln_shard::StepStats, kiln_pipe::PipeStats)>
where
    B: Backend,
    C: CheckpointStrategy,
    M: AutodiffModule<Train<B, C>> + Staged<Train<B, C>>,
    O: Optimizer<M, Train<B, C>>,
{
    let m = pipe.schedule().microbatches();
    let [rows, seq] = x.dims();
    let per = rows / m;
    let cut = |t: &Tensor<Train<B, C>, 2, Int>, mb: usize| {
        t.clone().slice([mb * per..(mb + 1) * per, 0..seq])
    };
    Ok(pipe.step(
        model,
        optim,
        lr,
        config,
        |mb| cut(x, mb),
        |logits, mb| causal_lm_loss(logits, cut(y, mb)).div_scalar(m as f64),
    )?)
}

/// The summed loss of `batches` (inputs, targets) through the pipeline, forward only.
pub(crate) fn pipe_evaluate<B, C, M>(
    pipe: &Pipeline,
    model: &M,
    batches: &[TokenBatch<B>],
) -> Result<f64>
where
    B: Backend,
    C: CheckpointStrategy,
    M: AutodiffModule<Train<B, C>, InnerModule: Staged<Shard<B>>>,
{
    Ok(pipe.evaluate(
        &model.valid(),
        batches.len(),
        |mb| batches[mb].0.clone(),
        |logits, mb| causal_lm_loss(logits, batches[mb].1.clone()),
    )?)
}

/// The logits of the token after `window` through the pipeline (for sampling).
pub(crate) fn pipe_last_logits<B, C, M>(
    pipe: &Pipeline,
    model: &M,
    window: &[i64],
    vocab: usize,
) -> Result<Vec<f32>>
where
    B: Backend,
    C: CheckpointStrategy,
    M: AutodiffModule<Train<B, C>, InnerModule: Staged<Shard<B>>>,
{
    Ok(pipe.last_logits(&model.valid(), window, vocab)?)
}

/// Named tensors that each pipeline stage holds some of (the others' are empty placeholders),
/// made whole on every stage: each from the first stage whose copy is not empty. A collective
/// over the stage group `stages`; every stage passes the same names in the same order.
pub(crate) fn from_every_stage(
    tensors: Vec<(String, TensorData)>,
    stages: &dyn ProcessGroup,
) -> Result<Vec<(String, TensorData)>> {
    let p = stages.world_size();
    let mut out = Vec::with_capacity(tensors.len());
    for (name, data) in tensors {
        let mut sizes = vec![0i64; p];
        let mine = [data.num_elements() as i64];
        stages.all_gather(BufRef::I64(&mine), BufMut::I64(&mut sizes))?;
        let Some(owner) = sizes.iter().position(|&n| n > 0) else {
            out.push((name, data));
            continue;
        };
        // The shape (at most 8 dimensions), then the values, from the owner.
        let mut dims = [0i64; 8];
        for (d, n) in dims.iter_mut().zip(data.shape.to_vec()) {
            *d = n as i64;
        }
        stages.broadcast(BufMut::I64(&mut dims), owner)?;
        let mut values = match stages.rank() == owner {
            true => data
                .convert::<f32>()
                .into_vec::<f32>()
                .expect("converted to f32"),
            false => vec![0f32; sizes[owner] as usize],
        };
        stages.broadcast(BufMut::F32(&mut values), owner)?;
        let shape: Vec<usize> = dims
            .iter()
            .take_while(|&&d| d > 0)
            .map(|&d| d as usize)
            .collect();
        out.push((name, TensorData::new(values, shape)));
    }
    Ok(out)
}
