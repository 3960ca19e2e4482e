//! Burn 0.21.0's text-classification example (tracel-ai/burn `examples/text-classification`),
//! trained by burn-train on one device or by kiln on N ranks: see `docs/learner.md` for the diff.
#[macro_use]
extern crate derive_new;

pub mod data;
pub mod model;
pub mod training;

pub use data::{AgNewsDataset, TextClassificationDataset};
