//! Every model kiln knows, chosen by a Hugging Face `config.json`'s `model_type`, and the PyTorch
//! parity check of a model directory (what `kiln verify-hf DIR` runs).
//!
//! The model crates cannot depend on each other, and `kiln-hf` (which they use) cannot depend on
//! them: dispatching on `model_type` therefore lives here, one level above.
//!
//! ```no_run
//! use kiln::{Flex, Train};
//! use kiln_hf::verify::Tolerances;
//!
//! let dir = "models/hf/tests/fixtures/tiny-llama";
//! let report = kiln_zoo::verify_dir::<Train<Flex>>(dir, &Tolerances::default(), &Default::default())?;
//! assert!(report.passed());
//! # Ok::<(), kiln_hf::HfError>(())
//! ```
#![warn(missing_docs)]

#[cfg(feature = "sharding")]
pub mod parallel;

use burn::module::AutodiffModule;
use burn::tensor::backend::AutodiffBackend;
use kiln_gpt2::Gpt2;
use kiln_hf::verify::{Parallel, SingleDevice, Tolerances, VerifyReport, verify_model_with};
use kiln_hf::{
    CausalLm, HfError, Pretrained, REFERENCE_FILE, Reference, WEIGHTS_FILE, config_path, model_type,
};
use kiln_llama::Llama;
use std::path::Path;

/// The `model_type`s kiln implements.
pub const MODEL_TYPES: [&str; 2] = ["gpt2", "llama"];

/// Verifies the model directory `dir` (`config.json`, `model.safetensors`,
/// `reference.safetensors`) against PyTorch's numbers on backend `B`: see
/// [`kiln_hf::verify::verify_model`].
///
/// # Errors
/// A missing or invalid config, an unsupported `model_type`, a missing or malformed weights or
/// reference file, a missing or mis-shaped tensor.
pub fn verify_dir<B: AutodiffBackend>(
    dir: impl AsRef<Path>,
    tolerances: &Tolerances,
    device: &B::Device,
) -> Result<VerifyReport, HfError> {
    verify_dir_with::<B, _>(dir, tolerances, device, &SingleDevice)
}

/// [`verify_dir`] with training run through `parallel` (e.g. a kiln sharding strategy).
///
/// # Errors
/// As [`verify_dir`], and [`HfError::Parallel`] from `parallel`.
pub fn verify_dir_with<B: AutodiffBackend, P: Parallel<B>>(
    dir: impl AsRef<Path>,
    tolerances: &Tolerances,
    device: &B::Device,
    parallel: &P,
) -> Result<VerifyReport, HfError> {
    let dir = dir.as_ref();
    let kind = model_type(dir)?;
    // Fail on an unsupported model before reading the (possibly large) files.
    if !MODEL_TYPES.contains(&kind.as_str()) {
        return Err(HfError::UnsupportedModel {
            model_type: kind,
            path: config_path(dir),
            supported: MODEL_TYPES.join(", "),
        });
    }
    let reference = Reference::read(dir.join(REFERENCE_FILE))?;
    match kind.as_str() {
        "gpt2" => verify::<B, Gpt2<B>, P>(dir, &reference, tolerances, device, parallel),
        "llama" => verify::<B, Llama<B>, P>(dir, &reference, tolerances, device, parallel),
        _ => unreachable!("checked against MODEL_TYPES"),
    }
}

/// Builds the model of `dir`'s config, applies the strategy (before the weights are read, so that
/// a sharding strategy shards each tensor as it is loaded), loads the weights and verifies.
fn verify<B, M, P>(
    dir: &Path,
    reference: &Reference,
    tolerances: &Tolerances,
    device: &B::Device,
    parallel: &P,
) -> Result<VerifyReport, HfError>
where
    B: AutodiffBackend,
    M: Pretrained<B> + AutodiffModule<B> + CausalLm<B>,
    P: Parallel<B>,
{
    let model = parallel.prepare(M::from_config(&M::read_config(dir)?, device))?;
    let model = model.load_safetensors(dir.join(WEIGHTS_FILE))?;
    verify_model_with(model, reference, tolerances, device, parallel)
}
