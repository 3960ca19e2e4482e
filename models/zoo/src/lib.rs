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

mod kinds;
#[cfg(feature = "sharding")]
pub mod parallel;

pub use kinds::{ModelConfig, ModelType, Sizes};

/// The model types [`with_model_type!`] names (not part of the API).
#[doc(hidden)]
pub mod __models {
    pub use kiln_gpt2::Gpt2;
    pub use kiln_llama::Llama;
}

use burn::module::AutodiffModule;
use burn::tensor::backend::AutodiffBackend;
use kiln_hf::verify::{Parallel, SingleDevice, Tolerances, VerifyReport, verify_model_with};
use kiln_hf::{HfError, Pretrained, REFERENCE_FILE, Reference, WEIGHTS_FILE};
use kiln_model::CausalLm;
use std::path::Path;

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
    // Fail on an unsupported model before reading the (possibly large) files.
    let kind = ModelType::of_dir(dir)?;
    let reference = Reference::read(dir.join(REFERENCE_FILE))?;
    with_model_type!(kind, M => verify::<B, M<B>, P>(dir, &reference, tolerances, device, parallel))
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
