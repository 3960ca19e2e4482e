//! Strategies, their configuration, and the per-rank state the gradient hook uses.

use crate::ShardTensor;
use burn_backend::Backend;
use burn_backend::distributed::DistributedParamId;
use burn_std::Shape;
use kiln_comm::{CommError, ProcessGroup};
use std::any::Any;
use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

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

/// How [`shard`](crate::shard()) makes every rank start from the same weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum InitSync {
    /// Every rank's parameters and buffers become rank 0's (PyTorch DDP's broadcast when it
    /// wraps a model, FSDP's `sync_module_states`): one bucketed broadcast for replicated
    /// parameters; under ZeRO-3 and hybrid, rank 0 sends each rank only its shard, so no other
    /// rank ever holds a whole tensor it did not build itself (the other ranks may build the
    /// model lazily, e.g. with Burn's lazy initialisers, and never materialise it).
    #[default]
    FromRank0,
    /// The caller guarantees equal weights (every rank loaded one checkpoint, or a seeded
    /// initialisation such as `kiln train`'s): nothing is sent but a fingerprint per parameter,
    /// all-gathered, and a parameter that differs is an error naming it and the rank.
    Verify,
}

/// What [`shard`](crate::shard()) sets up.
#[derive(Debug, Clone)]
pub struct ShardConfig {
    /// The strategy.
    pub strategy: Strategy,
    /// Gradients are reduced in buckets of about this many bytes (PyTorch DDP's default is
    /// 25 MiB): fewer, larger collectives than one per parameter. The same size buckets the
    /// other bulk collectives (initial broadcast, ZeRO-1/2's parameter all-gather).
    pub bucket_bytes: usize,
    /// How the ranks' initial weights are made equal.
    pub init: InitSync,
    /// Communication runs on a thread of its own, overlapping computation: gradient buckets
    /// are reduced while backward goes on, and ZeRO-3 / hybrid prefetch parameters (on
    /// CPU process groups; NCCL groups keep blocking collectives). Off: every collective
    /// blocks the compute thread where it is issued (the results are the same).
    pub overlap: bool,
    /// ZeRO-3 / hybrid (with `overlap`): all-gathers of the parameters used next are issued
    /// ahead, in the order of the previous step (FSDP2's forward and backward prefetch),
    /// up to this many bytes of whole parameters in flight (at least one parameter; 0: no
    /// prefetch).
    pub prefetch_bytes: usize,
}

impl ShardConfig {
    /// `strategy` with the default bucket size, weights synchronised from rank 0.
    pub fn new(strategy: Strategy) -> Self {
        ShardConfig {
            strategy,
            bucket_bytes: 25 << 20,
            init: InitSync::FromRank0,
            overlap: true,
            prefetch_bytes: 32 << 20,
        }
    }
    /// Another bucket size.
    pub fn with_bucket_bytes(mut self, bytes: usize) -> Self {
        self.bucket_bytes = bytes.max(1);
        self
    }
    /// Another way of making initial weights equal.
    pub fn with_init(mut self, init: InitSync) -> Self {
        self.init = init;
        self
    }
    /// Communication overlapped with computation, or not (see [`ShardConfig::overlap`]).
    pub fn with_overlap(mut self, overlap: bool) -> Self {
        self.overlap = overlap;
        self
    }
    /// Another prefetch budget (see [`ShardConfig::prefetch_bytes`]).
    pub fn with_prefetch_bytes(mut self, bytes: usize) -> Self {
        self.prefetch_bytes = bytes;
        self
    }
}

/// Consecutive runs of `items` (a key and a size in bytes each, in the order every rank shares)
/// that one collective carries: a run ends once it holds `limit` bytes or where the key changes
/// (collectives carry one element type). Every run holds at least one item.
pub(crate) fn buckets<K: PartialEq>(items: &[(K, usize)], limit: usize) -> Vec<Range<usize>> {
    let mut runs: Vec<Range<usize>> = Vec::new();
    let mut bytes = 0;
    for (i, (key, size)) in items.iter().enumerate() {
        match runs.last_mut() {
            Some(run) if bytes < limit && items[run.start].0 == *key => run.end = i + 1,
            _ => {
                runs.push(i..i + 1);
                bytes = 0;
            }
        }
        bytes += size;
    }
    runs
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

// SAFETY: a pending gradient is created and consumed by the one thread running a backward pass
// (burn-autodiff calls the hook on it); the state that holds it is behind a mutex only so that
// the model can move between threads *between* backward passes.
unsafe impl<B: Backend> Send for PendingGrad<B> {}

/// What a sharded model's state changes while it trains.
#[derive(Default)]
pub(crate) struct Dynamic<B: Backend> {
    /// The logical shape of every trainable parameter, by the gradient-sync id kiln gave it.
    pub params: HashMap<DistributedParamId, Shape>,
    pub bucket: Vec<PendingGrad<B>>,
    pub bucket_bytes: usize,
    /// Parameters whose gradient was reduced since the last optimizer step.
    pub synced: HashSet<DistributedParamId>,
    /// Inside [`no_sync`](crate::no_sync): the hook leaves gradients unreduced.
    pub no_sync: bool,
    /// Buckets handed to the communication queue, in order, written back when backward ends.
    pub in_flight: Vec<crate::hook::InFlight<B>>,
}

/// One sharded model's state on this rank: its groups, configuration and the parameters the
/// gradient hook reduces. Found from a parameter's gradient-sync id, which `shard` makes unique
/// to the model (so several sharded models coexist on a thread, and a model can move between
/// threads: nothing is kept per thread).
pub(crate) struct ModelState<B: Backend> {
    /// Creation order on this rank: models are flushed in this order at the end of a backward
    /// that involves several, identically on every rank.
    pub seq: u64,
    /// This rank's index in the group the model was sharded over.
    pub world_rank: usize,
    pub shard_group: Arc<dyn ProcessGroup>,
    pub replicate_group: Option<Arc<dyn ProcessGroup>>,
    pub config: ShardConfig,
    pub dynamic: Mutex<Dynamic<B>>,
    /// The communication thread (over a sub-group of `shard_group`), with `config.overlap`
    /// on a CPU group of more than one rank.
    pub queue: Option<kiln_comm::CommQueue>,
    pub prefetch: Mutex<crate::prefetch::Prefetch<B>>,
}

impl<B: Backend> ModelState<B> {
    pub fn lock(&self) -> std::sync::MutexGuard<'_, Dynamic<B>> {
        self.dynamic
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub fn prefetch(&self) -> std::sync::MutexGuard<'_, crate::prefetch::Prefetch<B>> {
        self.prefetch
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether gradients must be reduced at all (more than one rank).
    pub fn over_ranks(&self) -> bool {
        self.shard_group.world_size() > 1
            || self
                .replicate_group
                .as_ref()
                .is_some_and(|r| r.world_size() > 1)
    }

    /// A fresh gradient-sync id for a parameter of this model, registered.
    pub fn register(self: &Arc<Self>, param: u64, shape: Shape) -> DistributedParamId {
        let id = fresh_id();
        self.lock().params.insert(id, shape);
        let mut r = registry();
        r.by_id.insert(id, self.clone() as AnyModel);
        r.by_burn_id
            .entry(DistributedParamId::from(param))
            .or_default()
            .push((id, self.clone() as AnyModel));
        id
    }
}

/// A model, type-erased (its inner backend is generic).
pub(crate) type AnyModel = Arc<dyn Any + Send + Sync>;

#[derive(Default)]
struct Registry {
    /// Models by the gradient-sync ids kiln gave their parameters.
    by_id: HashMap<DistributedParamId, AnyModel>,
    /// The same, by the id Burn's own optimizers mark parameters with after a step
    /// (`DistributedParamId::from(ParamId)`), for models stepped by a plain Burn optimizer:
    /// ranks as threads may hold models with equal `ParamId`s (one record loaded on every
    /// rank), told apart by the rank the thread works for.
    by_burn_id: HashMap<DistributedParamId, Vec<(DistributedParamId, AnyModel)>>,
}

fn registry() -> std::sync::MutexGuard<'static, Registry> {
    static REGISTRY: std::sync::LazyLock<Mutex<Registry>> =
        std::sync::LazyLock::new(Default::default);
    REGISTRY
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Gradient-sync ids kiln hands out: unique in the process, never a Burn `ParamId` value (those
/// are random 64-bit numbers; these count down from the top, so a collision would need 2^63
/// parameters or an astronomically unlucky draw).
fn fresh_id() -> DistributedParamId {
    static NEXT: AtomicU64 = AtomicU64::new(u64::MAX);
    DistributedParamId::from(NEXT.fetch_sub(1, Ordering::Relaxed))
}

/// The next model's creation order number.
pub(crate) fn next_seq() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// The model a gradient-sync id belongs to and the parameter's id in it: an id `shard` gave
/// out, or one a plain Burn optimizer marked the parameter with (see `Registry`).
pub(crate) fn model_of<B: Backend>(
    id: DistributedParamId,
) -> Option<(Arc<ModelState<B>>, DistributedParamId)> {
    let downcast = |any: AnyModel| {
        any.downcast::<ModelState<B>>()
            .unwrap_or_else(|_| panic!("kiln: parameter {id:?} was sharded on another backend"))
    };
    let r = registry();
    if let Some(any) = r.by_id.get(&id) {
        return Some((downcast(any.clone()), id));
    }
    let candidates = r.by_burn_id.get(&id)?;
    let pick = |(uid, any): &(DistributedParamId, AnyModel)| (downcast(any.clone()), *uid);
    if let [only] = candidates.as_slice() {
        return Some(pick(only));
    }
    let rank = crate::account::current_rank()?;
    let mine: Vec<_> = candidates
        .iter()
        .map(pick)
        .filter(|(m, _)| m.world_rank == rank)
        .collect();
    match <[_; 1]>::try_from(mine) {
        Ok([found]) => Some(found),
        Err(_) => None,
    }
}

/// The gradient-sync id `model` gave the parameter with Burn's `ParamId` value `param`.
pub(crate) fn id_in_model<B: Backend>(
    model: &Arc<ModelState<B>>,
    param: u64,
) -> Option<DistributedParamId> {
    let model = Arc::as_ptr(model).cast::<()>();
    registry()
        .by_burn_id
        .get(&DistributedParamId::from(param))?
        .iter()
        .find(|(_, m)| Arc::as_ptr(m).cast::<()>() == model)
        .map(|(uid, _)| *uid)
}

/// Forgets a model's parameters (see [`release`](crate::release)).
pub(crate) fn unregister(ids: &[DistributedParamId]) {
    let mut r = registry();
    for id in ids {
        r.by_id.remove(id);
    }
    for list in r.by_burn_id.values_mut() {
        list.retain(|(uid, _)| !ids.contains(uid));
    }
    r.by_burn_id.retain(|_, list| !list.is_empty());
}

thread_local! {
    static LOCAL_READS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    static SHARDED_CREATION: RefCell<Option<Creation>> = const { RefCell::new(None) };
}

/// While a lazily initialised parameter is created under ZeRO-3: creation ops make only this
/// rank's shard, random ones from a generator seeded by (seed, shard rank): shards differ, and
/// `shard` derives the seed from the job and the parameter's path, so replicas (hybrid) draw
/// alike.
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
    scoped(&LOCAL_READS, true, f)
}

/// Runs `f` with the thread-local `key` set to `value`, restoring the outer value after (also
/// when `f` panics).
pub(crate) fn scoped<T: Copy + 'static, R>(
    key: &'static std::thread::LocalKey<std::cell::Cell<T>>,
    value: T,
    f: impl FnOnce() -> R,
) -> R {
    struct Restore<T: Copy + 'static>(&'static std::thread::LocalKey<std::cell::Cell<T>>, T);
    impl<T: Copy + 'static> Drop for Restore<T> {
        fn drop(&mut self) {
            self.0.with(|c| c.set(self.1));
        }
    }
    let _restore = Restore(key, key.with(|c| c.replace(value)));
    f()
}

pub(crate) fn reading_locally() -> bool {
    LOCAL_READS.with(std::cell::Cell::get)
}

#[cfg(test)]
mod tests {
    use super::buckets;

    #[test]
    fn buckets_end_at_the_limit_and_where_the_key_changes() {
        let items = [('f', 4), ('f', 4), ('f', 4), ('i', 1), ('f', 20), ('f', 1)];
        assert_eq!(buckets(&items, 8), vec![0..2, 2..3, 3..4, 4..5, 5..6]);
        assert_eq!(buckets(&items, 100), vec![0..3, 3..4, 4..6]);
        assert!(buckets::<char>(&[], 8).is_empty());
    }
}
