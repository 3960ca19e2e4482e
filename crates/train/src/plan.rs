//! What a run trains: the whole model ([`Full`]), or LoRA adapters on its frozen base
//! ([`Adapters`]). Everything else about a run (data, the step, validation, snapshots, resume,
//! ranks) is the same loop for both.

use crate::error::{IoContext, Result, fail};
use crate::run::Train;
use crate::{LoraRecipe, Recipe, init};
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::module::AutodiffModule;
use burn::optim::Optimizer;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use kiln_comm::{BufMut, BufRef, ProcessGroup};
use kiln_hf::{CausalLm, Pretrained, Staged, causal_lm_loss};
use kiln_lora::Lora;
use kiln_pipe::{Pipeline, PipelineConfig};
use kiln_shard::{Shard, StepConfig};
use std::marker::PhantomData;
use std::path::PathBuf;
use std::sync::Arc;

/// Inputs and next-token targets `[rows, seq]`, for evaluation on the inner backend.
pub(crate) type TokenBatch<B> = (Tensor<Shard<B>, 2, Int>, Tensor<Shard<B>, 2, Int>);

/// How the module a run trains is made and what it leaves behind.
pub(crate) trait Plan<B: Backend, C: CheckpointStrategy> {
    /// The trained module: a chain of units, so that it can be cut into pipeline stages.
    type Model: AutodiffModule<Train<B, C>, InnerModule: Staged<Shard<B>>>
        + CausalLm<Train<B, C>>
        + Staged<Train<B, C>>;

    /// The module before sharding, its parameters not loaded yet ([`start`](Plan::start) does).
    fn create(&self, recipe: &Recipe, device: &B::Device) -> Result<Self::Model>;

    /// Its values at step 0, after sharding; when `resuming`, only what the snapshot does not
    /// hold (the snapshot is loaded next).
    fn start(&self, model: Self::Model, recipe: &Recipe, resuming: bool) -> Result<Self::Model>;

    /// A line for the run's start, when only part of the model trains.
    fn describe(&self, model: &Self::Model) -> Option<String>;

    /// The model's parameters, frozen and 4-bit ones included.
    fn params(&self, model: &Self::Model) -> usize {
        burn::module::Module::num_params(model)
    }

    /// Writes what the run leaves besides snapshots (every rank calls it: reading a sharded
    /// parameter is collective; rank 0 writes). Returns what was written, and where.
    fn finish(
        &self,
        model: &Self::Model,
        recipe: &Recipe,
        rank: usize,
        pipe: Option<&Pipeline>,
    ) -> Result<Vec<(String, PathBuf)>>;
}

/// Every parameter of the model `M` (of config `K`) trains.
pub(crate) struct Full<M, K> {
    pub config: K,
    pub _model: PhantomData<fn() -> M>,
}

impl<B, C, M, K> Plan<B, C> for Full<M, K>
where
    B: Backend,
    C: CheckpointStrategy,
    M: Pretrained<Train<B, C>, Config = K>
        + CausalLm<Train<B, C>>
        + AutodiffModule<Train<B, C>>
        + Staged<Train<B, C>>,
    M::InnerModule: Staged<Shard<B>>,
{
    type Model = M;

    fn create(&self, _: &Recipe, device: &B::Device) -> Result<M> {
        Ok(M::from_config(&self.config, device))
    }

    fn start(&self, model: M, recipe: &Recipe, resuming: bool) -> Result<M> {
        if resuming {
            return Ok(model);
        }
        // Loaded (or initialised) after sharding: under ZeRO-3 each tensor is sharded as it
        // arrives, so the whole model never exists on a rank.
        Ok(match &recipe.model.from {
            Some(dir) => {
                let model = model.load_safetensors(dir.join(kiln_hf::WEIGHTS_FILE))?;
                kiln_shard::remark(&model);
                model
            }
            None => init::init::<B, Train<B, C>, M>(model, recipe.train.seed),
        })
    }

    fn describe(&self, _: &M) -> Option<String> {
        None
    }

    fn finish(
        &self,
        _: &M,
        _: &Recipe,
        _: usize,
        _: Option<&Pipeline>,
    ) -> Result<Vec<(String, PathBuf)>> {
        Ok(Vec::new())
    }
}

/// LoRA adapters on the frozen base `M` (of config `K`) from `model.from`.
pub(crate) struct Adapters<M, K> {
    pub config: K,
    pub lora: LoraRecipe,
    pub _model: PhantomData<fn() -> M>,
}

impl<B, C, M, K> Plan<B, C> for Adapters<M, K>
where
    B: Backend,
    C: CheckpointStrategy,
    M: Pretrained<Train<B, C>, Config = K>
        + CausalLm<Train<B, C>>
        + AutodiffModule<Train<B, C>>
        + Staged<Train<B, C>>
        + burn::module::ModuleDisplay,
    Lora<Train<B, C>, M>: AutodiffModule<Train<B, C>, InnerModule: Staged<Shard<B>>>,
{
    type Model = Lora<Train<B, C>, M>;

    fn create(&self, recipe: &Recipe, device: &B::Device) -> Result<Self::Model> {
        // The base stays uninitialised here: frozen, then sharded, then loaded tensor by
        // tensor in `start`, so that under ZeRO-3 it is never whole on a rank.
        let base = M::from_config(&self.config, device);
        let model = match &self.lora.adapter {
            Some(dir) => {
                let mut model = kiln_lora::load_peft(base, dir, M::hf_tensor, device)?;
                if self.lora.dropout != 0.0 {
                    if !(0.0..1.0).contains(&self.lora.dropout) {
                        return Err(kiln_lora::LoraError::Dropout(self.lora.dropout).into());
                    }
                    model.config.dropout = self.lora.dropout;
                }
                model
            }
            None => kiln_lora::lora(
                base,
                &self.lora.config(recipe.train.seed),
                M::hf_tensor,
                device,
            )?,
        };
        // QLoRA (idempotent; an adapter directory's config does not say it): the linear
        // weights leave the base here (placeholders), so sharding never allocates them;
        // `start` fills their 4-bit codes from the file.
        Ok(if self.lora.qlora {
            model.quantize_base()
        } else {
            model
        })
    }

    fn start(&self, model: Self::Model, recipe: &Recipe, _: bool) -> Result<Self::Model> {
        // Frozen weights are never in a snapshot: always the base's.
        let Some(from) = &recipe.model.from else {
            fail!(Recipe, "LoRA fine-tunes a pretrained base: set model.from");
        };
        let file =
            kiln_hf::SafetensorsFile::open(from.join(kiln_hf::WEIGHTS_FILE), "the base's weights")?;
        Ok(model.load_base(&file)?)
    }

    fn params(&self, model: &Self::Model) -> usize {
        model.trainable_params() + model.base_params()
    }

    fn describe(&self, model: &Self::Model) -> Option<String> {
        let (trainable, base) = (model.trainable_params(), model.base_params());
        let mut line = format!(
            "LoRA r={} alpha={} on {} weights: {} trainable parameters ({:.2}% of the base's {}), the base frozen",
            model.config.r,
            model.config.alpha,
            model.targets.len(),
            crate::report::human(trainable as f64),
            100.0 * trainable as f64 / base as f64,
            crate::report::human(base as f64),
        );
        if model.config.qlora {
            let f32_base = base * std::mem::size_of::<f32>();
            line += &format!(
                "; QLoRA: {} linear weights in NF4, the base takes {} (f32: {}, {:.3}x)",
                model.quantized.len(),
                crate::report::bytes(model.base_bytes()),
                crate::report::bytes(f32_base),
                model.base_bytes() as f64 / f32_base as f64,
            );
        }
        Some(line)
    }

    fn finish(
        &self,
        model: &Self::Model,
        recipe: &Recipe,
        rank: usize,
        pipe: Option<&Pipeline>,
    ) -> Result<Vec<(String, PathBuf)>> {
        let base_dir = recipe.model.from.clone().unwrap_or_default();
        let mut written = Vec::new();
        // A pipeline stage holds its units' tensors only (the others are empty placeholders).
        let whole = |tensors| match pipe {
            Some(pipe) => from_every_stage(tensors, pipe.group().as_ref()),
            None => Ok(tensors),
        };
        // PEFT's files: what `PeftModel.from_pretrained(base, dir)` loads.
        let adapter_dir = recipe.output.dir.join("adapter");
        let tensors = whole(model.adapter_tensors())?;
        if rank == 0 {
            model.write_peft(&adapter_dir, &base_dir.display().to_string(), &tensors)?;
        }
        written.push(("adapters (PEFT)".to_string(), adapter_dir));
        if let Some(out) = &self.lora.merge_into {
            let merged = whole(kiln_hf::hf_tensors(&model.merge()))?;
            if rank == 0 {
                std::fs::create_dir_all(out).io(|| format!("cannot create {}", out.display()))?;
                // The base's other files (config, tokenizer, generation settings) go along.
                let entries = std::fs::read_dir(&base_dir)
                    .io(|| format!("cannot read {}", base_dir.display()))?;
                for entry in entries.flatten() {
                    let path = entry.path();
                    let name = entry.file_name();
                    let weights = name.to_string_lossy().contains(".safetensors");
                    if path.is_file() && !weights {
                        std::fs::copy(&path, out.join(&name)).io(|| {
                            format!("cannot copy {} to {}", path.display(), out.display())
                        })?;
                    }
                }
                kiln_hf::write_tensors(out.join(kiln_hf::WEIGHTS_FILE), &merged)?;
            }
            written.push(("merged model".to_string(), out.clone()));
        }
        Ok(written)
    }
}

/// Cuts `model` for this rank's pipeline stage (before sharding), `group` being the stage
/// group; `world` (every rank of the job) agrees on measured unit costs, timed on micro-batches
/// of `microbatch` (rows, sequence) token ids, where the config asks for them.
pub(crate) fn pipeline<B, C, M>(
    model: M,
    group: Arc<dyn ProcessGroup>,
    config: &PipelineConfig,
    world: &dyn ProcessGroup,
    microbatch: [usize; 2],
) -> Result<(Pipeline, M)>
where
    B: Backend,
    C: CheckpointStrategy,
    M: Staged<Train<B, C>>,
{
    let mut config = config.clone();
    if config.split == kiln_pipe::Split::Measured {
        let device = model.devices().into_iter().next().unwrap_or_default();
        // Token values do not change the cost of any unit: zeros will do.
        let tokens = Tensor::<Train<B, C>, 2, Int>::zeros(microbatch, &device);
        let loss = |logits| causal_lm_loss(logits, tokens.clone());
        config.split = kiln_pipe::Split::Costs(kiln_pipe::measure_costs(
            &model,
            tokens.clone(),
            loss,
            world,
            3,
        )?);
    }
    Ok(Pipeline::new(model, group, &config)?)
}

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
) -> (M, kiln_shard::StepStats, kiln_pipe::PipeStats)
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
    pipe.step(
        model,
        optim,
        lr,
        config,
        |mb| cut(x, mb),
        |logits, mb| causal_lm_loss(logits, cut(y, mb)).div_scalar(m as f64),
    )
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
fn from_every_stage(
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
