//! A sharded model's state on a rank, and the registry that finds it from a parameter's
//! gradient-sync id (the gradient hook's only way to its model).

use super::config::ShardConfig;
use super::prefetch::Prefetcher;
use super::reduce::{InFlight, PendingGrad, Reduction};
use crate::core::scope::{self, AnyArc, Creation, Set};
use crate::core::tensor::ShardOps;
use crate::features::zero::flat;
use burn_backend::distributed::DistributedParamId;
use burn_backend::{Backend, DType};
use burn_std::Shape;
use kiln_comm::{CommQueue, ProcessGroup};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// What a sharded model's state changes while it trains.
#[derive(Default)]
pub(crate) struct Dynamic<B: Backend> {
    /// The logical shape of every trainable parameter, by the gradient-sync id kiln gave it.
    /// Each trainable parameter's shape and dtype (its gradient is handed on in that dtype).
    pub params: HashMap<DistributedParamId, (Shape, DType)>,
    pub bucket: Vec<PendingGrad<B>>,
    pub bucket_bytes: usize,
    /// Parameters whose gradient was reduced since the last optimizer step.
    pub synced: HashSet<DistributedParamId>,
    /// Inside [`no_sync`](crate::no_sync): the hook leaves gradients unreduced.
    pub no_sync: bool,
    /// Buckets handed to the communication queue, in order, written back when backward ends.
    pub in_flight: Vec<InFlight<B>>,
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
    /// Every data-parallel rank (buffers are made equal over it).
    pub dp_group: Arc<dyn ProcessGroup>,
    pub shard_group: Arc<dyn ProcessGroup>,
    pub replicate_group: Option<Arc<dyn ProcessGroup>>,
    /// Under `BufferPolicy::Sync` on more than one rank: the group (a split of `dp_group`) that
    /// `BatchNorm`'s statistics are computed over during the model's steps.
    pub batch_group: Option<Arc<dyn ProcessGroup>>,
    pub config: ShardConfig,
    pub dynamic: Mutex<Dynamic<B>>,
    /// The communication thread (over a sub-group of `shard_group`), with `config.overlap`
    /// on a CPU group of more than one rank.
    pub queue: Option<Arc<CommQueue>>,
    /// ZeRO-3 / hybrid with a queue: the parameters' all-gathers issued ahead.
    pub prefetch: Option<Arc<Prefetcher<B>>>,
}

impl<B: Backend> ModelState<B> {
    pub fn lock(&self) -> std::sync::MutexGuard<'_, Dynamic<B>> {
        self.dynamic
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Who reduces the model's gradients, and how.
    pub fn reduction(&self) -> Reduction<'_> {
        Reduction {
            strategy: self.config.strategy,
            shard: &self.shard_group,
            across: self.replicate_group.as_ref(),
        }
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
    pub fn register(
        self: &Arc<Self>,
        param: u64,
        shape: Shape,
        dtype: DType,
    ) -> DistributedParamId {
        let id = fresh_id();
        self.lock().params.insert(id, (shape, dtype));
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
pub(crate) type AnyModel = AnyArc;

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
    let rank = scope::current_rank()?;
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

/// Runs `f` with the creation ops making only this rank's shard of `group` (a lazily
/// initialised parameter under ZeRO-3), random ones from a generator seeded by (seed, shard
/// rank): shards differ, and `shard` derives the seed from the job and the parameter's path, so
/// replicas (hybrid) draw alike.
pub(crate) fn with_sharded_creation<B: Backend, R>(
    group: Arc<dyn ProcessGroup>,
    seed: u64,
    f: impl FnOnce() -> R,
) -> R {
    use rand::SeedableRng;
    let rng = rand::rngs::StdRng::seed_from_u64(
        seed ^ (group.rank() as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15),
    );
    let ops: Arc<dyn ShardOps<B>> = flat::<B>();
    let creation = Creation {
        group,
        rng,
        ops: Arc::new(ops),
    };
    scope::with(Set::Creation(Some(creation)), f)
}
