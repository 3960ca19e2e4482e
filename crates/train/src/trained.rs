//! What a run trains: the whole model ([`Full`]), or LoRA adapters on its frozen base
//! ([`Adapters`]). Each is the first step of [`kiln::parallelize`] ([`kiln::Adapt`]);
//! everything else about a run (data, the step, validation, snapshots, resume, ranks) is the
//! same loop for both.

use crate::error::{IoContext, Result, fail};
use crate::pipelined::from_every_stage;
use crate::{LoraRecipe, Recipe, init};
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::module::AutodiffModule;
use burn::tensor::backend::Backend;
use kiln::{Adapt, ParallelError};
use kiln_hf::Pretrained;
use kiln_lora::Lora;
use kiln_model::{CausalLm, Staged};
use kiln_pipe::Pipeline;
use kiln_shard::{Shard, Train};
use std::marker::PhantomData;
use std::path::PathBuf;

/// How the module a run trains is made and what it leaves behind (its adapters are made by
/// [`Adapt`], the first step of `parallelize`).
pub(crate) trait Trained<B: Backend, C: CheckpointStrategy> {
    /// The model as built from its config, before adapters.
    type Base;
    /// The trained module: a chain of units, so that it can be cut into pipeline stages.
    type Model: AutodiffModule<Train<B, C>, InnerModule: Staged<Shard<B>> + CausalLm<Shard<B>>>
        + CausalLm<Train<B, C>>
        + Staged<Train<B, C>>;

    /// The base, its parameters not loaded yet ([`start`](Trained::start) does).
    fn base(&self, device: &B::Device) -> Self::Base;

    /// Its values at step 0, after sharding; when `resuming`, only what the snapshot does not
    /// hold (the snapshot is loaded next).
    fn start(&self, model: Self::Model, recipe: &Recipe, resuming: bool) -> Result<Self::Model>;

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

impl<B, C, M, K> Adapt<B, C, M> for Full<M, K>
where
    B: Backend,
    C: CheckpointStrategy,
    M: AutodiffModule<Train<B, C>>,
{
    type Model = M;
    fn adapt(&self, base: M, _: &B::Device) -> std::result::Result<M, ParallelError> {
        Ok(base)
    }
}

impl<B, C, M, K> Trained<B, C> for Full<M, K>
where
    B: Backend,
    C: CheckpointStrategy,
    M: Pretrained<Train<B, C>, Config = K>
        + CausalLm<Train<B, C>>
        + AutodiffModule<Train<B, C>>
        + Staged<Train<B, C>>,
    M::InnerModule: Staged<Shard<B>> + CausalLm<Shard<B>>,
{
    type Base = M;
    type Model = M;

    fn base(&self, device: &B::Device) -> M {
        M::from_config(&self.config, device)
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
    /// The run's seed (the adapters' initial values).
    pub seed: u64,
    pub _model: PhantomData<fn() -> M>,
}

impl<B, C, M, K> Adapt<B, C, M> for Adapters<M, K>
where
    B: Backend,
    C: CheckpointStrategy,
    M: Pretrained<Train<B, C>, Config = K> + AutodiffModule<Train<B, C>>,
    Lora<Train<B, C>, M>: AutodiffModule<Train<B, C>>,
{
    type Model = Lora<Train<B, C>, M>;

    fn adapt(
        &self,
        base: M,
        device: &B::Device,
    ) -> std::result::Result<Self::Model, ParallelError> {
        // The base stays uninitialised here: frozen, then sharded, then loaded tensor by
        // tensor in `start`, so that under ZeRO-3 it is never whole on a rank.
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
            None => kiln_lora::lora(base, &self.lora.config(self.seed), M::hf_tensor, device)?,
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
}

impl<B, C, M, K> Trained<B, C> for Adapters<M, K>
where
    B: Backend,
    C: CheckpointStrategy,
    M: Pretrained<Train<B, C>, Config = K>
        + CausalLm<Train<B, C>>
        + AutodiffModule<Train<B, C>>
        + Staged<Train<B, C>>
        + burn::module::ModuleDisplay,
    Lora<Train<B, C>, M>:
        AutodiffModule<Train<B, C>, InnerModule: Staged<Shard<B>> + CausalLm<Shard<B>>>,
{
    type Base = M;
    type Model = Lora<Train<B, C>, M>;

    fn base(&self, device: &B::Device) -> M {
        M::from_config(&self.config, device)
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
