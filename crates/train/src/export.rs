//! `kiln export`: a snapshot, written by any number of ranks under any strategy, as one
//! Hugging Face directory (`config.json` and a single consolidated `model.safetensors`). A
//! fine-tuning snapshot (adapters only) is written merged into its base.

use crate::error::{IoContext, Result};
use crate::model::ModelSpec;
use crate::plan::{Adapters, Plan};
use crate::run::{Train, load_params};
use crate::snapshot::Snapshot;
use burn::backend::Flex;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::module::AutodiffModule;
use burn::tensor::FloatDType;
use kiln_hf::{CausalLm, Pretrained};
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
    match ModelSpec::from_json(&meta.model_kind, &meta.model_config)? {
        ModelSpec::Gpt2(c) => {
            write::<kiln_gpt2::Gpt2<Train<Flex>>>(&snap, &c, lora.as_ref(), out, dtype)
        }
        ModelSpec::Llama(c) => {
            write::<kiln_llama::Llama<Train<Flex>>>(&snap, &c, lora.as_ref(), out, dtype)
        }
    }
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
        + kiln_hf::Staged<Train<Flex>>
        + burn::module::ModuleDisplay,
    M::Config: Clone,
    kiln_lora::Lora<Train<Flex>, M>:
        AutodiffModule<Train<Flex>, InnerModule: kiln_hf::Staged<kiln_shard::Shard<Flex>>>,
{
    let device = Default::default();
    let model = match lora {
        Some(recipe) => {
            let plan = Adapters::<M, M::Config> {
                config: config.clone(),
                lora: recipe.lora.clone().expect("filtered on lora"),
                _model: std::marker::PhantomData,
            };
            let adapters = Plan::<Flex, NoCheckpointing>::create(&plan, recipe, &device)?;
            let adapters = Plan::<Flex, NoCheckpointing>::start(&plan, adapters, recipe, true)?;
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
