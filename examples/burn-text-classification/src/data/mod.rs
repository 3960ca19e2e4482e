mod batcher;
mod dataset;
mod tokenizer;

pub use batcher::*;
pub use dataset::*;
pub use tokenizer::*;
