//! Strategies, their configuration, and the per-rank state the gradient hook uses.

use crate::ShardTensor;
use burn_backend::Backend;
use burn_backend::distributed::DistributedParamId;
use burn_std::Shape;
use kiln_comm::{CommError, ProcessGroup};
use std::any::{Any, TypeId};
use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;

/// How parameters, gradients and optimizer state are spread over the data-parallel ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Strategy {
    /// Everything replicated; gradients all-reduced (PyTorch DDP).
    Ddp,
    /// Optimizer state sharded. Whole gradients live until backward ends, then are
    /// reduce-scattered at once; parameters are all-gathered after the step.
    Zero1,
    /// Optimizer state and gradients sharded: gradients are reduce-scattered bucket by bucket
    /// during backward, so whole-model gradients never coexist.
    Zero2,
    /// Parameters too: FSDP full shard. Parameters are gathered on use and dropped after.
    Zero3,
    /// ZeRO-3 within groups of `shard_size` consecutive ranks, replicated across the groups
    /// (FSDP's HYBRID_SHARD): shards are reduce-scattered in the group, then all-reduced across.
    Hybrid {
        /// Ranks per sharding group; must divide the world size.
        shard_size: usize,
    },
}

impl Strategy {
    /// Parameters live as shards between steps.
    pub fn shards_params(self) -> bool {
        matches!(self, Strategy::Zero3 | Strategy::Hybrid { .. })
    }
    /// Gradients are reduce-scattered (each rank keeps the shard it owns), not all-reduced.
    pub fn shards_grads(self) -> bool {
        !matches!(self, Strategy::Ddp)
    }
    /// Gradients are reduced bucket by bucket as backward produces them (all but ZeRO-1, which
    /// reduces them all when backward ends).
    pub fn reduces_during_backward(self) -> bool {
        !matches!(self, Strategy::Zero1)
    }
    /// The optimizer updates only this rank's slice.
    pub fn shards_optimizer(self) -> bool {
        !matches!(self, Strategy::Ddp)
    }
}

impl std::fmt::Display for Strategy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Strategy::Ddp => f.write_str("ddp"),
            Strategy::Zero1 => f.write_str("zero1"),
            Strategy::Zero2 => f.write_str("zero2"),
            Strategy::Zero3 => f.write_str("zero3"),
            Strategy::Hybrid { shard_size } => write!(f, "hybrid(shard {shard_size})"),
        }
    }
}

impl std::str::FromStr for Strategy {
    type Err = ShardError;
    /// `ddp`, `zero1`, `zero2`, `zero3` (or `fsdp`), `hybrid:S`.
    fn from_str(s: &str) -> Result<Self, ShardError> {
        Ok(match s.trim().to_ascii_lowercase().as_str() {
            "ddp" => Strategy::Ddp,
            "zero1" => Strategy::Zero1,
            "zero2" => Strategy::Zero2,
            "zero3" | "fsdp" => Strategy::Zero3,
            other => match other.strip_prefix("hybrid:").map(str::parse) {
                Some(Ok(shard_size)) => Strategy::Hybrid { shard_size },
                _ => {
                    return Err(ShardError::Config(format!(
                        "unknown strategy '{s}': expected ddp, zero1, zero2, zero3 or hybrid:S"
                    )));
                }
            },
        })
    }
}

/// What [`shard`](crate::shard()) sets up.
#[derive(Debug, Clone)]
pub struct ShardConfig {
    /// The strategy.
    pub strategy: Strategy,
    /// Gradients are reduced in buckets of about this many bytes (PyTorch DDP's default is
    /// 25 MiB): fewer, larger collectives than one per parameter.
    pub bucket_bytes: usize,
}

impl ShardConfig {
    /// `strategy` with the default bucket size.
    pub fn new(strategy: Strategy) -> Self {
        ShardConfig {
            strategy,
            bucket_bytes: 25 << 20,
        }
    }
    /// Another bucket size.
    pub fn with_bucket_bytes(mut self, bytes: usize) -> Self {
        self.bucket_bytes = bytes.max(1);
        self
    }
}

/// Errors of the sharding layer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ShardError {
    /// An inconsistent configuration, with the numbers.
    #[error("sharding configuration: {0}")]
    Config(String),
    /// The ranks hold different models.
    #[error("ranks disagree about the model: {0}")]
    Inconsistent(String),
    /// A collective failed.
    #[error(transparent)]
    Comm(#[from] CommError),
}

/// A gradient handed over by the hook, waiting in the bucket.
pub(crate) struct PendingGrad<B: Backend> {
    /// Points into burn-autodiff's gradient container, whose boxed entries stay put (and are
    /// not removed) until backward returns; the bucket is always flushed before that, at the
    /// latest in `submit_sync_collective`.
    pub ptr: *mut ShardTensor<B>,
    pub shape: Shape,
}

/// One rank's sharding state (per backend type, per thread: ranks are threads or processes).
pub(crate) struct RankState<B: Backend> {
    pub shard_group: Arc<dyn ProcessGroup>,
    pub replicate_group: Option<Arc<dyn ProcessGroup>>,
    pub config: ShardConfig,
    pub params: HashMap<DistributedParamId, Shape>,
    pub bucket: Vec<PendingGrad<B>>,
    pub bucket_bytes: usize,
    /// Parameters whose gradient the hook reduced since the last optimizer step.
    pub synced: std::collections::HashSet<DistributedParamId>,
}

thread_local! {
    static STATES: RefCell<HashMap<TypeId, Box<dyn Any>>> = RefCell::new(HashMap::new());
    static LOCAL_READS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    static SHARDED_CREATION: RefCell<Option<Creation>> = const { RefCell::new(None) };
}

/// While a lazily initialised parameter is created under ZeRO-3: creation ops make only this
/// rank's shard, random ones from a generator seeded by (seed, rank) so that ranks draw
/// different values.
pub(crate) struct Creation {
    pub group: Arc<dyn ProcessGroup>,
    pub rng: rand::rngs::StdRng,
}

pub(crate) fn with_sharded_creation<R>(
    group: Arc<dyn ProcessGroup>,
    seed: u64,
    f: impl FnOnce() -> R,
) -> R {
    use rand::SeedableRng;
    let rng = rand::rngs::StdRng::seed_from_u64(
        seed ^ (group.rank() as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15),
    );
    struct Restore;
    impl Drop for Restore {
        fn drop(&mut self) {
            SHARDED_CREATION.with(|c| *c.borrow_mut() = None);
        }
    }
    SHARDED_CREATION.with(|c| *c.borrow_mut() = Some(Creation { group, rng }));
    let _restore = Restore;
    f()
}

/// Runs `f` on the creation scope, if one is active.
pub(crate) fn creating_sharded<R>(f: impl FnOnce(&mut Creation) -> R) -> Option<R> {
    SHARDED_CREATION.with(|c| c.borrow_mut().as_mut().map(f))
}

/// Runs `f` with reads of sharded tensors returning this rank's shard (flat, 1-D) instead of
/// gathering the whole tensor: for per-rank snapshots and for measuring what a rank holds.
/// No collective happens for such reads, so one rank may read alone.
pub fn local_reads<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            LOCAL_READS.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(LOCAL_READS.with(|c| c.replace(true)));
    f()
}

pub(crate) fn reading_locally() -> bool {
    LOCAL_READS.with(std::cell::Cell::get)
}

pub(crate) fn install<B: Backend>(state: RankState<B>) {
    STATES.with(|s| {
        s.borrow_mut().insert(TypeId::of::<B>(), Box::new(state));
    });
}

/// Runs `f` on this thread's state, or returns `None` if `shard` was never called here.
pub(crate) fn try_with_state<B: Backend, R>(f: impl FnOnce(&mut RankState<B>) -> R) -> Option<R> {
    STATES.with(|s| {
        let mut map = s.borrow_mut();
        map.get_mut(&TypeId::of::<B>())
            .map(|st| f(st.downcast_mut::<RankState<B>>().expect("keyed by type")))
    })
}

pub(crate) fn with_state<B: Backend, R>(f: impl FnOnce(&mut RankState<B>) -> R) -> R {
    try_with_state(f).unwrap_or_else(|| {
        panic!(
            "kiln: a parameter is marked for gradient synchronisation but `kiln_shard::shard` was \
             not called on this thread (each rank's thread must shard its own model)"
        )
    })
}
