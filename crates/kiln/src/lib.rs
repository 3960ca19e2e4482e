//! kiln: train any Burn model the way large models are trained, by changing its backend type.
//!
//! ```text
//! training:   Autodiff<Kiln<B>>   e.g. Train<Flex> on CPU, Train<Cuda> on GPUs
//! inference:  Kiln<B>
//! ```
//!
//! `Kiln<B>` is the composition of kiln's decorators over an inner backend `B`, written once
//! here. Today it is the sharding decorator ([`shard::Shard`]: DDP, ZeRO-1/2/3, hybrid). The
//! order of the stack, as further decorators join it, is fixed by what each must see:
//! rematerialisation sits directly under `Autodiff` (it must see what autodiff saves for
//! backward), mixed precision above sharding (a shard cast to bf16 is cast locally and halves the
//! all-gather traffic), sharding at the bottom, next to the inner backend's memory.
//! Every decorator forwards burn-autodiff's gradient hook downward to the sharding layer.
//!
//! # Adding kiln to a project
//! kiln turns on Burn's `distributed` feature (burn-autodiff's per-parameter gradient hook).
//! Cargo unifies features across a build, so in a build that contains kiln, bare
//! `Autodiff<Flex>` is no longer an `AutodiffBackend` (Flex does not implement Burn's
//! `DistributedBackend`); the compiler says so at the first `backward()`. Use
//! `Autodiff<Kiln<Flex>>` ([`Train<Flex>`](Train)) instead: with no call to [`shard::shard`]
//! it only forwards to Flex.
//!
//! ```
//! use kiln::{Flex, Train};
//! use burn::tensor::{Tensor, backend::Backend};
//! let device = Default::default();
//! let x = Tensor::<Train<Flex>, 1>::from_floats([1.0, 2.0], &device).require_grad();
//! let grads = x.clone().powf_scalar(2.0).sum().backward();
//! assert_eq!(x.grad(&grads).unwrap().into_data().to_vec::<f32>().unwrap(), [2.0, 4.0]);
//! assert_eq!(Train::<Flex>::name(&device), "autodiff<kiln<flex>>");
//! ```
#![warn(missing_docs)]

pub use burn::backend::autodiff::checkpoint::strategy::{BalancedCheckpointing, NoCheckpointing};
pub use burn::backend::{Autodiff, Flex};
pub use kiln_comm as comm;
pub use kiln_shard as shard;

/// kiln's decorators over the inner backend `B` (for inference and as `Autodiff`'s inner).
pub type Kiln<B> = kiln_shard::Shard<B>;

/// The training stack over the inner backend `B`, with autodiff's checkpointing strategy `C`:
/// none by default, or Burn's op-level [`BalancedCheckpointing`] (`Train<Flex,
/// BalancedCheckpointing>`): the outputs of memory-bound ops (elementwise, activations,
/// layout) are recomputed in backward from kept inputs instead of kept themselves. Every kiln
/// API (sharding, the gradient hook, [`shard::step`]) works with either.
pub type Train<B, C = NoCheckpointing> = Autodiff<Kiln<B>, C>;

/// Burn's CUDA backend (feature `cuda`).
#[cfg(feature = "cuda")]
pub type Cuda = burn::backend::Cuda;

#[cfg(feature = "cuda")]
const _: () = {
    // `Autodiff<Kiln<Cuda>>` is a training backend.
    fn assert_trainable<B: burn::tensor::backend::AutodiffBackend>() {}
    let _ = assert_trainable::<Train<Cuda>>;
};

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::backend::Backend;

    #[test]
    fn the_stack_by_name() {
        let device = Default::default();
        assert_eq!(Kiln::<Flex>::name(&device), "kiln<flex>");
        assert_eq!(Train::<Flex>::name(&device), "autodiff<kiln<flex>>");
        assert_eq!(
            Train::<Flex, BalancedCheckpointing>::name(&device),
            "autodiff<kiln<flex>>"
        );
    }
}
