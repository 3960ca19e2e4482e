//! kiln's cross-crate tests live in `tests/` (PyTorch parity of the models through kiln,
//! sharded checkpoint loading); this library holds what they share.
#![warn(missing_docs)]

use std::path::PathBuf;

/// The parity fixture `name` (`tiny-gpt2`, `tiny-llama`): a Hugging Face model directory with
/// PyTorch's reference numbers, kept in `models/hf/tests/fixtures`.
pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../models/hf/tests/fixtures")
        .join(name)
}
