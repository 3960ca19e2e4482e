mod alias;
mod container;
mod kind;
mod ops;

pub use alias::*;
pub use container::*;
pub use kind::*;
pub use ops::*;

/// Tensor quantization module.
pub mod quantization;
