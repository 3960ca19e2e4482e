//! kiln: train any Burn model the way large models are trained, by changing its backend type.
//!
//! ```text
//! training:   Autodiff<Kiln<B>>   e.g. Train<Flex> on CPU, Train<Cuda> on GPUs
//! inference:  Kiln<B>
//! ```
//!
//! `Kiln<B>` is kiln's decorator over an inner backend `B`, written once here: [`shard::Shard`],
//! one layer under `Autodiff` that holds every strategy as a policy, because each must see the
//! others' tensors: sharding (DDP, ZeRO-1/2/3, hybrid), budgeted rematerialisation
//! ([`shard::remat`]: a recomputation of a sharded parameter gathers it again) and mixed
//! precision ([`shard::precision`]: a shard is rounded to bf16 before its all-gather, halving the
//! traffic). Burn's op-level checkpointing is `Autodiff`'s own (`Train<B, BalancedCheckpointing>`).
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

#[cfg(feature = "learner")]
pub mod learner;
mod parallel;

pub use burn::backend::autodiff::checkpoint::strategy::{BalancedCheckpointing, NoCheckpointing};
pub use burn::backend::{Autodiff, Flex};
pub use kiln_comm as comm;
pub use kiln_lora as lora;
pub use kiln_model as model;
pub use kiln_pipe as pipe;
pub use kiln_shard as shard;
pub use parallel::{
    Adapt, LmStages, Mesh, NoStages, Parallel, ParallelError, ParallelPlan, Remat, Stages, Whole,
    parallelize, parse_size,
};

/// Runs `ranks` ranks as threads of this process, each on a Rayon pool of its own (the
/// process's threads divided among them), and returns their results in rank order: the one
/// way to start thread ranks (`kiln::comm::spawn_ranks` is the bare one, on the global pool).
pub use kiln_shard::threads::spawn_ranks;

/// Ranks' own copies of one model (see [`copies`]).
#[derive(Debug)]
pub struct Copies<M>(Vec<std::sync::Mutex<Option<M>>>);

impl<M> Copies<M> {
    /// Rank `rank`'s copy.
    ///
    /// # Panics
    /// If it was taken already, or there is no copy for `rank`.
    pub fn take(&self, rank: usize) -> M {
        let n = self.0.len();
        self.0
            .get(rank)
            .and_then(|slot| {
                slot.lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .take()
            })
            .unwrap_or_else(|| {
                panic!("kiln::copies: no copy left for rank {rank} (there were {n}, one each)")
            })
    }
}

/// `n` copies of `model` for `n` ranks as threads, handed out by rank ([`Copies::take`]).
/// Each copy's parameters are fresh autodiff leaves (ranks as threads must not share autodiff
/// tensors: burn-autodiff's graphs are process-wide) holding the same values, their
/// `require_grad` kept; Burn's lazy parameters are initialised once, here, so that every rank
/// holds the same values.
pub fn copies<AB, M>(model: &M, n: usize) -> Copies<M>
where
    AB: burn::tensor::backend::AutodiffBackend,
    M: burn::module::AutodiffModule<AB>,
{
    Copies(
        (0..n)
            .map(|_| std::sync::Mutex::new(Some(M::from_inner(model.valid()))))
            .collect(),
    )
}

/// The README's and the guide's Rust blocks, compiled and run as doctests (CI's test command
/// runs them).
#[cfg(doctest)]
pub mod guide {
    #[doc = include_str!("../../../README.md")]
    pub struct Readme;
    #[doc = include_str!("../../../docs/library.md")]
    pub struct Library;
    #[doc = include_str!("../../../docs/train.md")]
    pub struct Train;
    #[doc = include_str!("../../../docs/cluster.md")]
    pub struct Cluster;
    #[doc = include_str!("../../../docs/benchmarks.md")]
    pub struct Benchmarks;
    #[doc = include_str!("../../../docs/design.md")]
    pub struct Design;
}

/// kiln's decorators over the inner backend `B` (for inference and as `Autodiff`'s inner).
pub type Kiln<B> = kiln_shard::Shard<B>;

/// The training stack over the inner backend `B`, `Autodiff<Kiln<B>, C>`, with autodiff's
/// checkpointing strategy `C`: none by default, or Burn's op-level [`BalancedCheckpointing`]
/// (`Train<Flex, BalancedCheckpointing>`): the outputs of memory-bound ops (elementwise,
/// activations, layout) are recomputed in backward from kept inputs instead of kept
/// themselves. Every kiln API (sharding, the gradient hook, [`shard::step`]) works with either.
pub use kiln_shard::Train;

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
