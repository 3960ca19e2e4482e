//! `kiln export`: a snapshot, written by any number of ranks under any strategy, as one
//! Hugging Face directory (`config.json` and a single consolidated `model.safetensors`). A
//! fine-tuning snapshot (adapters only) is written merged into its base.

use crate::error::{IoContext, Result};
use crate::snapshot::Snapshot;
use crate::state::load_params;
use crate::trained::{Adapters, Trained};
use burn::backend::Flex;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::module::AutodiffModule;
use burn::tensor::FloatDType;
use kiln::Adapt;
use kiln_hf::Pretrained;
use kiln_model::CausalLm;
use kiln_shard::Train;
use kiln_zoo::{ModelConfig, ModelType, with_model_type};
use std::path::{Path, PathBuf};

/// Writes the model of `snapshot` (a snapshot directory, or a run directory: its newest
/// snapshot) to the Hugging Face directory `out`, and returns the weights file's path.
///
/// The model is assembled whole on the CPU from the pieces; no process group is needed.
///
/// # Errors
/// No snapshot, a damaged or incomplete one, a file that cannot be written.
pub fn export(snapshot: &Path, out: &Path) -> Result<PathBuf> {
    export_as(snapshot, out, FloatDType::F32)
}

/// [`export`] with the weights in `dtype` (f32, bf16 or f16: the snapshot's f32 masters rounded
/// to nearest), named in `config.json` as `torch_dtype`.
///
/// # Errors
/// As [`export`].
pub fn export_as(snapshot: &Path, out: &Path, dtype: FloatDType) -> Result<PathBuf> {
    let snap = Snapshot::open(snapshot)?;
    let meta = &snap.manifest.meta;
    // A fine-tuning run's recipe names its base and adapters.
    let lora = toml::from_str::<crate::Recipe>(&meta.recipe)
        .ok()
        .filter(|r| r.lora.is_some());
    let kind = ModelType::from_name(&meta.model_kind).ok_or_else(|| {
        crate::TrainError::Snapshot(format!(
            "{} holds a model of kind '{}' (kiln knows {})",
            snap.dir().display(),
            meta.model_kind,
            ModelType::names()
        ))
    })?;
    let config = ModelConfig::from_json(kind, &meta.model_config)?;
    with_model_type!(config, M, c => write::<M<Train<Flex>>>(&snap, &c, lora.as_ref(), out, dtype))
}

fn write<M>(
    snap: &Snapshot,
    config: &M::Config,
    lora: Option<&crate::Recipe>,
    out: &Path,
    dtype: FloatDType,
) -> Result<PathBuf>
where
    M: Pretrained<Train<Flex>>
        + CausalLm<Train<Flex>>
        + AutodiffModule<Train<Flex>>
        + kiln_model::Staged<Train<Flex>>
        + burn::module::ModuleDisplay,
    M::Config: Clone,
    M::InnerModule: CausalLm<kiln_shard::Shard<Flex>> + kiln_model::Staged<kiln_shard::Shard<Flex>>,
    kiln_lora::Lora<Train<Flex>, M>: AutodiffModule<
            Train<Flex>,
            InnerModule: kiln_model::Staged<kiln_shard::Shard<Flex>>
                             + CausalLm<kiln_shard::Shard<Flex>>,
        >,
{
    let device = Default::default();
    let model = match lora {
        Some(recipe) => {
            let plan = Adapters::<M, M::Config> {
                config: config.clone(),
                lora: recipe.lora.clone().expect("filtered on lora"),
                seed: recipe.train.seed,
                _model: std::marker::PhantomData,
            };
            let base = Trained::<Flex, NoCheckpointing>::base(&plan, &device);
            let adapters = Adapt::<Flex, NoCheckpointing, M>::adapt(&plan, base, &device)?;
            let adapters = Trained::<Flex, NoCheckpointing>::start(&plan, adapters, recipe, true)?;
            load_params::<Flex, _, _>(adapters, snap)?.merge()
        }
        None => load_params::<Flex, _, M>(M::from_config(config, &device), snap)?,
    };
    model.save_pretrained_as(config, out, dtype)?;
    // The tokens the model learnt: the run's tokenizer.json goes along (none for bytes, or when
    // the recipe cannot be read back).
    let recipe = toml::from_str::<crate::Recipe>(&snap.manifest.meta.recipe).ok();
    if let Some(Ok(tokenizer)) = recipe.map(|r| r.tokenizer())
        && let Some(file) = tokenizer.file()
    {
        let to = out.join(kiln_hf::TOKENIZER_FILE);
        if file != to {
            std::fs::copy(file, &to)
                .io(|| format!("cannot copy {} to {}", file.display(), to.display()))?;
        }
    }
    Ok(out.join(kiln_hf::WEIGHTS_FILE))
}
