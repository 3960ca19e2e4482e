mod base;
mod device;
mod primitive;

pub use base::*;
pub use device::*;
pub use primitive::*;

/// Backend operations on tensors.
pub mod ops;

#[cfg(feature = "distributed")]
/// Distributed backend extension.
pub mod distributed;
