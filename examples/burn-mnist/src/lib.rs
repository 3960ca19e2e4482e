//! Burn 0.21.0's MNIST example (tracel-ai/burn `examples/mnist`), trained by burn-train on one
//! device or by kiln on N ranks: see `docs/learner.md` for the diff from upstream.
pub mod data;
pub mod model;
pub mod synthetic;
pub mod training;
