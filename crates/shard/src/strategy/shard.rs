//! `shard`: puts a model under a strategy; `gather_model`: the whole model back; the model's
//! gradient-sync marks (`remark`, `backward`, `no_sync`, `reduce_gradients`, `release`).

use super::buffers::Where;
use super::config::{BufferPolicy, InitSync, ShardConfig, Strategy, buckets};
use super::params::{Path, mark_of, replace_primitive};
use super::prefetch::{Prefetcher, track};
use super::reduce::{reduce, restored, to_reduce};
use super::state::{
    Dynamic, ModelState, id_in_model, model_of, next_seq, unregister, with_sharded_creation,
};
use super::sync::{self, Scatter};
use crate::core::backend::Shard;
use crate::core::error::ShardError;
use crate::core::host::slice_local;
use crate::core::ops::local;
use crate::core::scope;
use crate::core::tensor::ShardTensor;
use crate::features::zero::flat;
use burn::module::{AutodiffModule, Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorPrimitive};
use burn_backend::distributed::DistributedParamId;
use burn_std::{DType, Shape};
use kiln_comm::{DeviceMesh, MeshShape, ProcessGroup};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Puts `module` under `config.strategy` over the data-parallel `group`: every rank calls it
/// with its own copy of the same architecture.
///
/// - Weights: by default every rank's parameters and buffers become rank 0's
///   ([`InitSync::FromRank0`]), so a model initialised with Burn's random initialisers trains
///   like one model; [`InitSync::Verify`] trusts the caller and checks a fingerprint instead.
///   Parameters not initialised yet (Burn's lazy initialisers) are created sharded under
///   ZeRO-3 and hybrid: the whole tensor never exists, and replicas draw the same shards.
/// - Trainable parameters are marked so that their gradients are reduced during backward,
///   with ids unique to this model: several sharded models live side by side on one thread (a
///   frozen teacher and a student, an EMA copy, a GAN's two networks), and a model may move to
///   another thread. Under ZeRO-3 and hybrid they are replaced by this rank's shard.
/// - Weights loaded later (records, Hugging Face files, burn-store) keep the marks, and are
///   sharded tensor by tensor as they arrive under ZeRO-3 (this replaces a load mapper the
///   model may have set).
///
/// # Errors
/// A hybrid shard size that does not divide the world size; ranks whose models differ in their
/// parameters' number or shapes; under [`InitSync::Verify`], a parameter whose values differ
/// between ranks (named); a failing collective.
pub fn shard<B, AB, M>(
    module: M,
    group: Arc<dyn ProcessGroup>,
    config: ShardConfig,
) -> Result<M, ShardError>
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Shard<B>>,
    M: Module<AB>,
{
    let groups = match config.strategy {
        Strategy::Hybrid { shard_size } => {
            let world = group.world_size();
            if shard_size == 0 || !world.is_multiple_of(shard_size) {
                return Err(ShardError::Config(format!(
                    "hybrid shard size {shard_size} does not divide the world size {world}"
                )));
            }
            let mesh = DeviceMesh::new(
                world,
                MeshShape {
                    dp_replicate: world / shard_size,
                    dp_shard: shard_size,
                    ..Default::default()
                },
            )?;
            let groups = mesh.groups(group.as_ref())?;
            ShardGroups {
                dp: group,
                shard: groups.dp_shard,
                replicate: Some(groups.dp_replicate),
            }
        }
        _ => ShardGroups {
            shard: group.clone(),
            dp: group,
            replicate: None,
        },
    };
    shard_over::<B, AB, M>(module, groups, config)
}

/// The groups a strategy uses: the data-parallel ranks, the ranks parameters are sharded
/// over, and (hybrid) the ranks holding the same shard.
#[derive(Debug, Clone)]
pub struct ShardGroups {
    /// Every data-parallel rank (the ranks holding the same model).
    pub dp: Arc<dyn ProcessGroup>,
    /// The ranks parameters, gradients and optimizer state are sharded over: `dp`, or under
    /// hybrid sharding a group of consecutive ranks within it.
    pub shard: Arc<dyn ProcessGroup>,
    /// Hybrid: the ranks holding the same shard (replicas, all-reduced across).
    pub replicate: Option<Arc<dyn ProcessGroup>>,
}

/// [`shard`] over groups the caller built (a job's one device mesh: `dp`, `dp_shard`,
/// `dp_replicate`).
///
/// # Errors
/// As [`shard`]; a hybrid strategy without a replicate group, or sharding groups that do not
/// match its shard size.
pub fn shard_over<B, AB, M>(
    module: M,
    groups: ShardGroups,
    config: ShardConfig,
) -> Result<M, ShardError>
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Shard<B>>,
    M: Module<AB>,
{
    let ShardGroups {
        dp: group,
        shard: shard_group,
        replicate: replicate_group,
    } = groups;
    // kiln's burn-autodiff hands final gradients to the hooks a backend registered.
    #[cfg(burn_autodiff_hooks)]
    burn_autodiff::distributed::register_distributed::<Shard<B>>();
    #[cfg(burn_autodiff_hooks)]
    burn_autodiff::distributed::register_batch_mean::<Shard<B>>(
        burn_autodiff::distributed::BatchMean {
            take: crate::core::ops::batch::take_synced,
            grad: crate::core::ops::batch::synced_grad::<B>,
        },
    );
    crate::core::ops::register_autocast::<B>();
    if let Strategy::Hybrid { shard_size } = config.strategy
        && (shard_group.world_size() != shard_size || replicate_group.is_none())
    {
        return Err(ShardError::Config(format!(
            "hybrid:{shard_size} needs sharding groups of {shard_size} ranks and a replicate group, got sharding groups of {} ranks{}",
            shard_group.world_size(),
            if replicate_group.is_none() {
                " and no replicate group"
            } else {
                ""
            }
        )));
    }
    scope::attribute_to_rank(group.rank());
    sync::check_shapes(&module, group.as_ref())?;
    let seed = sync::job_seed(group.as_ref())?;
    let over_ranks = group.world_size() > 1;
    let shard_params = config.strategy.shards_params();
    if config.init == InitSync::Verify && over_ranks {
        sync::verify_equal::<B, AB, M>(&module, group.as_ref())?;
    }
    let scatter = if config.init == InitSync::FromRank0 && over_ranks && shard_params {
        Some(Scatter::new::<AB, M>(
            &module,
            group.clone(),
            shard_group.world_size(),
        )?)
    } else {
        None
    };
    let bucket_bytes = config.bucket_bytes;
    let buffer_paths = config.buffer_paths.clone();
    let init = config.init;
    // NCCL groups keep blocking collectives: a communication thread would need the CUDA
    // context and a stream ordered with the compute stream.
    let queue = (config.overlap
        && shard_group.world_size() > 1
        && matches!(shard_group.backend(), "local" | "tcp"))
    .then(|| kiln_comm::CommQueue::new(shard_group.as_ref()).map(Arc::new))
    .transpose()?;
    let prefetch = queue
        .as_ref()
        .map(|q| Prefetcher::new(q.clone(), config.prefetch_bytes));
    let batch_group = match config.buffers == BufferPolicy::Sync && over_ranks {
        true => {
            let all: Vec<usize> = (0..group.world_size()).collect();
            Some(group.split(&all, "batch-statistics")?)
        }
        false => None,
    };
    let state = Arc::new(ModelState {
        seq: next_seq(),
        world_rank: group.rank(),
        dp_group: group.clone(),
        shard_group: shard_group.clone(),
        replicate_group,
        batch_group,
        config,
        dynamic: Mutex::new(Dynamic::default()),
        queue,
        prefetch,
    });
    let mut mapper = Sharder::<B> {
        state,
        path: Path::default(),
        place: Where::default(),
        seed,
        scatter,
        shard_params,
    };
    let mut module = module.map(&mut mapper);
    if let Some(scatter) = mapper.scatter {
        scatter.finish()?;
    }
    if init == InitSync::FromRank0 && over_ranks {
        // Replicated float parameters, and every int or bool buffer (never sharded).
        module = sync::broadcast_from_rank0::<B, AB, M>(
            module,
            group.as_ref(),
            bucket_bytes,
            !shard_params,
            &buffer_paths,
        )?;
    }
    Ok(module)
}

/// Gathers every sharded parameter: the whole model on every rank (for saving, evaluation on a
/// single device, export). A collective: every rank must call it.
pub fn gather_model<B, AB, M>(module: M) -> M
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Shard<B>>,
    M: Module<AB>,
{
    module.map(&mut Gatherer::<B>(std::marker::PhantomData))
}

struct Sharder<B: Backend> {
    state: Arc<ModelState<B>>,
    path: Path,
    place: Where,
    seed: u64,
    scatter: Option<Scatter>,
    shard_params: bool,
}

impl<B, AB> ModuleMapper<AB> for Sharder<B>
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Shard<B>>,
{
    fn enter_module(&mut self, name: &str, container: &str) {
        self.path.push(name);
        self.place.enter(name, container);
    }
    fn exit_module(&mut self, _: &str, _: &str) {
        self.path.pop();
        self.place.exit();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<AB, D>>) -> Param<Tensor<AB, D>> {
        if self.place.is_buffer(&self.state.config.buffer_paths) {
            // A buffer: whole on every rank, never sharded (made equal by the initial
            // broadcast and after every optimizer step).
            if let Some(scatter) = &mut self.scatter {
                scatter.skip();
            }
            let (id, tensor, mapper) = param.consume();
            let tensor = replace_primitive::<B, AB, D>(tensor, |t| ShardTensor::Local(local(t)));
            return Param::from_mapped_value(id, tensor, mapper);
        }
        let group = self.state.shard_group.clone();
        let shard_params = self.shard_params;
        let path = self.path.join();
        // A parameter not initialised yet is created sharded: its initialiser runs with the
        // creation ops making only this rank's shard, so the whole tensor never exists. The
        // draws are seeded by (job seed, path, shard rank): shards differ, replicas agree.
        let seed = self.seed ^ kiln_comm::hash::fnv1a(path.as_bytes());
        let lazy = !param.is_initialized();
        let create_sharded = |param: Param<Tensor<AB, D>>| {
            with_sharded_creation::<B, _>(group.clone(), seed, || param.consume())
        };
        let (id, tensor, mapper) = match &mut self.scatter {
            Some(scatter) => scatter.param::<B, AB, D>(param, &path, lazy, &group, create_sharded),
            None if shard_params && lazy => create_sharded(param),
            None => param.consume(),
        };
        let trainable = tensor.is_require_grad();
        let shape = Shape::from(tensor.dims().to_vec());
        let dtype = tensor.dtype();
        let mark = trainable.then(|| self.state.register(id.val(), shape, dtype));
        let mut tensor = replace_primitive::<B, AB, D>(tensor, |t| {
            let t = match t {
                ShardTensor::Sharded(s) if shard_params && s.group.name() == group.name() => {
                    ShardTensor::Sharded(s)
                }
                t if shard_params => {
                    ShardTensor::Sharded(slice_local::<B>(local(t), &group, flat()))
                }
                t => ShardTensor::Local(local(t)),
            };
            match mark {
                Some(mark) => match &self.state.prefetch {
                    Some(p) => track(p, mark, t),
                    None => t,
                },
                None => t,
            }
        });
        if let Some(mark) = mark {
            tensor = tensor.set_distributed(mark);
        }
        // Weights loaded later (Hugging Face files, records, burn-store) keep this
        // parameter's gradient-sync mark, and under ZeRO-3 are sharded tensor by tensor as
        // they arrive, so a sharded model is never whole while loading.
        Param::from_mapped_value(id, tensor, mapper).load_mapper(move |t: Tensor<AB, D>| {
            let require_grad = t.is_require_grad();
            let inner = t.inner().into_primitive().tensor();
            let inner = match inner {
                ShardTensor::Sharded(s) if shard_params => ShardTensor::Sharded(s),
                t if shard_params => {
                    ShardTensor::Sharded(slice_local::<B>(local(t), &group, flat()))
                }
                t => ShardTensor::Local(local(t)),
            };
            let mut out =
                Tensor::<AB, D>::from_inner(Tensor::from_primitive(TensorPrimitive::Float(inner)));
            if require_grad {
                out = out.require_grad();
            }
            if let Some(mark) = mark {
                out = out.set_distributed(mark);
            }
            out
        })
    }
}

struct Gatherer<B>(std::marker::PhantomData<B>);

impl<B, AB> ModuleMapper<AB> for Gatherer<B>
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Shard<B>>,
{
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<AB, D>>) -> Param<Tensor<AB, D>> {
        let (id, tensor, mapper) = param.consume();
        let tensor = replace_primitive::<B, AB, D>(tensor, |t| ShardTensor::Local(local(t)));
        Param::from_mapped_value(id, tensor, mapper)
    }
}

/// The sharded models `module`'s parameters belong to, with each parameter's gradient-sync id:
/// found from the parameters' marks (a parameter that lost its mark, e.g. replaced by a
/// user's own mapper, is found through its `ParamId` in the model of the others).
pub(crate) struct Marks<B: Backend> {
    /// The gradient-sync id and model of every trainable parameter of a sharded model.
    params: HashMap<ParamId, (DistributedParamId, Arc<ModelState<B>>)>,
}

impl<B: Backend> Marks<B> {
    pub fn of<AB, M>(module: &M) -> Self
    where
        AB: AutodiffBackend<InnerBackend = Shard<B>>,
        M: Module<AB>,
    {
        type Found<B> = (
            ParamId,
            Option<(DistributedParamId, Arc<ModelState<B>>)>,
            Option<(Shape, DType)>,
        );
        struct Find<B: Backend> {
            found: Vec<Found<B>>,
        }
        impl<B: Backend, AB: AutodiffBackend<InnerBackend = Shard<B>>> ModuleVisitor<AB> for Find<B> {
            fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<AB, D>>) {
                if !p.is_initialized() {
                    return self.found.push((p.id, None, None));
                }
                let t = p.val();
                let known = mark_of(&t).and_then(|id| model_of::<B>(id).map(|(m, id)| (id, m)));
                let trainable = t
                    .is_require_grad()
                    .then(|| (Shape::from(t.dims().to_vec()), t.dtype()));
                self.found.push((p.id, known, trainable));
            }
        }
        let mut find = Find::<B> { found: Vec::new() };
        module.visit(&mut find);
        let fallback = find
            .found
            .iter()
            .find_map(|(_, k, _)| k.as_ref().map(|(_, m)| m.clone()));
        let params = find
            .found
            .into_iter()
            .filter_map(|(pid, known, trainable)| match (known, trainable) {
                (Some(known), _) => Some((pid, known)),
                (None, Some((shape, dtype))) => {
                    let m = fallback.clone()?;
                    // Loading a record gives parameters the record's ids, which `shard` never
                    // saw: registered here, so that the gradient is reduced too.
                    let id = id_in_model(&m, pid.val())
                        .unwrap_or_else(|| m.register(pid.val(), shape, dtype));
                    Some((pid, (id, m)))
                }
                (None, None) => None,
            })
            .collect();
        Marks { params }
    }

    /// The distinct models, in creation order.
    pub fn models(&self) -> Vec<Arc<ModelState<B>>> {
        let mut models: Vec<Arc<ModelState<B>>> = Vec::new();
        for (_, m) in self.params.values() {
            if !models.iter().any(|k| Arc::ptr_eq(k, m)) {
                models.push(m.clone());
            }
        }
        models.sort_by_key(|m| m.seq);
        models
    }

    /// A parameter's gradient-sync id and model.
    pub fn get(&self, id: ParamId) -> Option<&(DistributedParamId, Arc<ModelState<B>>)> {
        self.params.get(&id)
    }

    /// A parameter's gradient-sync id, if it belongs to `model`.
    pub fn in_model(&self, id: ParamId, model: &Arc<ModelState<B>>) -> Option<DistributedParamId> {
        self.get(id)
            .filter(|(_, m)| Arc::ptr_eq(m, model))
            .map(|(mark, _)| *mark)
    }
}

/// Runs `f`, a forward and backward pass of `module`, with `BatchNorm`'s batch statistics
/// computed over the model's data-parallel ranks when it was sharded with
/// `BufferPolicy::Sync` (on more than one rank); otherwise just runs it. `weight`: the factor
/// this rank's gradients are multiplied by before they are averaged over the ranks (1 when
/// every rank has as many rows). [`step`](crate::step()) does this itself.
pub fn with_batch_statistics<B, AB, M, R>(module: &M, weight: f64, f: impl FnOnce() -> R) -> R
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Shard<B>>,
    M: Module<AB>,
{
    match batch_group::<B, AB, M>(module) {
        Some(group) => scope::with(
            scope::Set::BatchGroup(Some(scope::BatchGroup { group, weight })),
            f,
        ),
        None => f(),
    }
}

/// The group `BatchNorm`'s statistics are computed over during `module`'s steps
/// (`BufferPolicy::Sync` on more than one rank), if any: the first sharded model's found.
fn batch_group<B, AB, M>(module: &M) -> Option<Arc<dyn ProcessGroup>>
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Shard<B>>,
    M: Module<AB>,
{
    struct Find<B: Backend> {
        model: Option<Arc<ModelState<B>>>,
    }
    impl<B: Backend, AB: AutodiffBackend<InnerBackend = Shard<B>>> ModuleVisitor<AB> for Find<B> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<AB, D>>) {
            if self.model.is_none() && p.is_initialized() {
                self.model = mark_of(&p.val()).and_then(|id| model_of::<B>(id).map(|(m, _)| m));
            }
        }
    }
    let mut find = Find::<B> { model: None };
    module.visit(&mut find);
    find.model.and_then(|m| m.batch_group.clone())
}

/// Marks every parameter of `module` with the gradient-sync id in `marks` (after Burn's
/// optimizer re-marked them with ids of its own, or after a backward pass consumed the marks).
pub(crate) fn apply_marks<B, AB, M>(module: M, marks: &Marks<B>) -> M
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Shard<B>>,
    M: Module<AB>,
{
    struct Mark<'a, B: Backend>(&'a Marks<B>);
    impl<B: Backend, AB: AutodiffBackend<InnerBackend = Shard<B>>> ModuleMapper<AB> for Mark<'_, B> {
        fn map_float<const D: usize>(
            &mut self,
            param: Param<Tensor<AB, D>>,
        ) -> Param<Tensor<AB, D>> {
            match self.0.get(param.id) {
                Some((mark, model)) => {
                    let (id, mut tensor, mapper) = param.consume();
                    if let Some(p) = &model.prefetch
                        && model.config.strategy.shards_params()
                    {
                        // The new shard is the value prefetches read from now on.
                        tensor = replace_primitive::<B, AB, D>(tensor, |t| track(p, *mark, t));
                    }
                    Param::from_mapped_value(id, tensor.set_distributed(*mark), mapper)
                }
                None => param,
            }
        }
    }
    module.map(&mut Mark(marks))
}

/// `loss.backward()` followed by `GradientsParams::from_grads`, leaving the model ready for
/// another backward before the optimizer step (gradient accumulation).
///
/// burn-autodiff consumes a parameter's "reduce my gradient" mark with the backward that uses
/// it; the optimizer step re-marks, but a second micro-batch before the step would otherwise
/// run unmarked and its gradients would never be reduced. This re-marks every trainable
/// parameter. To reduce only once for all micro-batches, see [`no_sync`].
pub fn backward<B, AB, M>(loss: Tensor<AB, 1>, module: &M) -> GradientsParams
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Shard<B>>,
    M: AutodiffModule<AB>,
{
    let grads = GradientsParams::from_grads(loss.backward(), module);
    remark::<B, AB, M>(module);
    grads
}

/// Marks every trainable parameter of a sharded model again for gradient reduction: after a
/// backward pass that is followed by another before the optimizer step (see [`backward`]).
/// (The mark is keyed by the parameter's graph node, so marking a clone suffices.)
pub fn remark<B, AB, M>(module: &M)
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Shard<B>>,
    M: Module<AB>,
{
    struct Remark<'a, B: Backend>(&'a Marks<B>);
    impl<B: Backend, AB: AutodiffBackend<InnerBackend = Shard<B>>> ModuleVisitor<AB> for Remark<'_, B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
            if let Some((mark, _)) = self.0.get(param.id) {
                let _ = param.val().set_distributed(*mark);
            }
        }
    }
    let marks = Marks::<B>::of::<AB, M>(module);
    module.visit(&mut Remark(&marks));
}

/// Runs `f` (forward and backward passes) without reducing gradients: they stay whole and
/// local, as in PyTorch DDP's `no_sync()` and FSDP2's `set_requires_gradient_sync(False)`.
/// Accumulate the micro-batches' gradients as usual and reduce the sum once with
/// [`reduce_gradients`] before the optimizer step: with k micro-batches, 1/k of the traffic.
///
/// What it costs: under ZeRO-2/3 the unreduced gradients are whole tensors until
/// `reduce_gradients` (the memory of DDP's gradients, not ZeRO's shards); ZeRO-3 still
/// gathers parameters on use in every micro-batch.
///
/// Call [`remark`] (or use [`backward`]) between micro-batches, as for any accumulation.
pub fn no_sync<B, AB, M, R>(module: &M, f: impl FnOnce() -> R) -> R
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Shard<B>>,
    M: Module<AB>,
{
    let models = Marks::<B>::of::<AB, M>(module).models();
    struct Restore<B: Backend>(Vec<Arc<ModelState<B>>>);
    impl<B: Backend> Drop for Restore<B> {
        fn drop(&mut self) {
            for m in &self.0 {
                m.lock().no_sync = false;
            }
        }
    }
    for m in &models {
        m.lock().no_sync = true;
    }
    let _restore = Restore(models);
    f()
}

/// Reduces gradients accumulated under [`no_sync`], in buckets, as the hook would have: all-
/// reduced (DDP) or reduce-scattered to this rank's shards (ZeRO). A collective: every rank
/// calls it with its own gradients of the same model.
pub fn reduce_gradients<B, AB, M>(module: &M, mut grads: GradientsParams) -> GradientsParams
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Shard<B>>,
    M: AutodiffModule<AB>,
{
    /// Takes the gradients of one model's parameters, in module order (the same on every rank).
    struct Take<'a, B: Backend> {
        grads: &'a mut GradientsParams,
        marks: &'a Marks<B>,
        model: &'a Arc<ModelState<B>>,
        taken: Vec<(ParamId, DistributedParamId, ShardTensor<B>)>,
    }
    impl<B: Backend, AB: AutodiffBackend<InnerBackend = Shard<B>>> ModuleVisitor<AB> for Take<'_, B> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<AB, D>>) {
            let Some(mark) = self.marks.in_model(p.id, self.model) else {
                return;
            };
            if let Some(g) = self.grads.remove::<Shard<B>, D>(p.id) {
                self.taken.push((p.id, mark, g.into_primitive().tensor()));
            }
        }
    }
    /// Puts the reduced gradients back (the visitor knows each parameter's rank `D`).
    struct Put<'a, B: Backend> {
        grads: &'a mut GradientsParams,
        reduced: HashMap<ParamId, ShardTensor<B>>,
    }
    impl<B: Backend, AB: AutodiffBackend<InnerBackend = Shard<B>>> ModuleVisitor<AB> for Put<'_, B> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<AB, D>>) {
            if let Some(g) = self.reduced.remove(&p.id) {
                let g = Tensor::<Shard<B>, D>::from_primitive(TensorPrimitive::Float(g));
                self.grads.register::<Shard<B>, D>(p.id, g);
            }
        }
    }
    let marks = Marks::<B>::of::<AB, M>(module);
    let mut reduced = HashMap::new();
    for m in marks.models() {
        let mut take = Take {
            grads: &mut grads,
            marks: &marks,
            model: &m,
            taken: Vec::new(),
        };
        module.visit(&mut take);
        let taken = take.taken;
        let sizes: Vec<((), usize)> = taken
            .iter()
            .map(|(_, _, g)| ((), g.local_bytes()))
            .collect();
        for run in buckets(&sizes, m.config.bucket_bytes) {
            let bucket = &taken[run];
            let (grads, rewraps): (Vec<_>, Vec<_>) = bucket
                .iter()
                .map(|(_, _, g)| {
                    let (g, rewrap) = to_reduce(g);
                    let shape = burn_backend::TensorMetadata::shape(&g);
                    ((g, shape), rewrap)
                })
                .unzip();
            let results = reduce(m.reduction(), grads);
            let mut d = m.lock();
            for (((pid, mark, _), rewrap), g) in bucket.iter().zip(rewraps).zip(results) {
                d.synced.insert(*mark);
                reduced.insert(*pid, restored(g, rewrap.as_ref()));
            }
        }
    }
    module.visit(&mut Put {
        grads: &mut grads,
        reduced,
    });
    grads
}

/// Forgets a sharded model's gradient-sync registrations (its state and groups are freed once
/// no parameter refers to them). Its parameters' gradients are no longer reduced afterwards.
pub fn release<B, AB, M>(module: &M)
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Shard<B>>,
    M: Module<AB>,
{
    let marks = Marks::<B>::of::<AB, M>(module);
    for m in marks.models() {
        let ids: Vec<DistributedParamId> = m.lock().params.keys().copied().collect();
        unregister(&ids);
    }
}

/// The group over which `module`'s strategy shards optimizer state (ZeRO-1/2/3, hybrid), or
/// `None` when it is replicated (DDP) or the model is not sharded.
pub fn optimizer_state_group<B, AB, M>(module: &M) -> Option<Arc<dyn ProcessGroup>>
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Shard<B>>,
    M: Module<AB>,
{
    let models = Marks::<B>::of::<AB, M>(module).models();
    let m = models.first()?;
    m.config
        .strategy
        .shards_optimizer()
        .then(|| m.shard_group.clone())
}
