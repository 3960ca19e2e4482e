//! `shard`: puts a model under a strategy; `gather_model`: the whole model back.

use crate::ops::policy::{local, slice_local};
use crate::state::{RankState, ShardConfig, ShardError, install, with_sharded_creation};
use crate::{Shard, ShardTensor, Strategy};
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorPrimitive};
use burn_backend::distributed::DistributedParamId;
use kiln_comm::{DeviceMesh, MeshShape, ProcessGroup, ReduceOp};
use std::collections::HashMap;
use std::sync::Arc;

/// Puts `module` under `config.strategy` over the data-parallel `group`: every rank calls it
/// with its own copy of the same model (same architecture; same weights, e.g. loaded from one
/// checkpoint or broadcast).
///
/// Trainable parameters are marked so that their gradients are reduced during backward; under
/// ZeRO-3 and hybrid they are also replaced by this rank's shard. Call it on each rank's thread
/// (the gradient hook finds its state there).
///
/// # Errors
/// A hybrid shard size that does not divide the world size; ranks whose models differ in their
/// parameters' number or shapes; a failing collective.
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
    let (shard_group, replicate_group) = match config.strategy {
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
            (groups.dp_shard, Some(groups.dp_replicate))
        }
        _ => (group.clone(), None),
    };
    check_consistent(&module, group.as_ref())?;
    let mut mapper = Sharder::<B> {
        _b: std::marker::PhantomData,
        group: shard_group.clone(),
        shard_params: config.strategy.shards_params(),
        params: HashMap::new(),
    };
    let module = module.map(&mut mapper);
    install::<B>(RankState {
        shard_group,
        replicate_group,
        config,
        params: mapper.params,
        bucket: Vec::new(),
        bucket_bytes: 0,
        synced: Default::default(),
    });
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

/// Replaces a parameter's inner primitive, keeping it a leaf with its `require_grad` and
/// gradient-sync mark.
pub(crate) fn replace_primitive<B, AB, const D: usize>(
    id: ParamId,
    tensor: Tensor<AB, D>,
    f: impl FnOnce(ShardTensor<B>) -> ShardTensor<B>,
) -> Tensor<AB, D>
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Shard<B>>,
{
    let require_grad = tensor.is_require_grad();
    let distributed = tensor.is_distributed();
    let inner = tensor.inner().into_primitive().tensor();
    let inner = Tensor::<Shard<B>, D>::from_primitive(TensorPrimitive::Float(f(inner)));
    let mut out = Tensor::<AB, D>::from_inner(inner);
    if require_grad {
        out = out.require_grad();
    }
    if distributed {
        out = out.set_distributed(DistributedParamId::from(id.val()));
    }
    out
}

struct Sharder<B: Backend> {
    _b: std::marker::PhantomData<B>,
    group: Arc<dyn ProcessGroup>,
    shard_params: bool,
    params: HashMap<DistributedParamId, burn_std::Shape>,
}

impl<B, AB> ModuleMapper<AB> for Sharder<B>
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Shard<B>>,
{
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<AB, D>>) -> Param<Tensor<AB, D>> {
        let group = self.group.clone();
        let shard_params = self.shard_params;
        // A parameter not initialised yet is created sharded: its initialiser runs with the
        // creation ops making only this rank's shard, so the whole tensor never exists.
        let (id, tensor, mapper) = if shard_params && !param.is_initialized() {
            let seed = param.id.val();
            with_sharded_creation(group.clone(), seed, || param.consume())
        } else {
            param.consume()
        };
        let trainable = tensor.is_require_grad();
        let shape = burn_std::Shape::from(tensor.dims().to_vec());
        let mut tensor = replace_primitive::<B, AB, D>(id, tensor, |t| match t {
            ShardTensor::Sharded(s) if shard_params && s.group.name() == group.name() => {
                ShardTensor::Sharded(s)
            }
            t if shard_params => ShardTensor::Sharded(slice_local::<B>(local(t), &group)),
            t => ShardTensor::Local(local(t)),
        });
        if trainable {
            let did = DistributedParamId::from(id.val());
            self.params.insert(did, shape);
            tensor = tensor.set_distributed(did);
        }
        let param = Param::from_mapped_value(id, tensor, mapper);
        if !shard_params {
            return param;
        }
        // Weights loaded later (Hugging Face files, records, burn-store) are sharded tensor by
        // tensor as they arrive, so a sharded model is never whole while loading. (This
        // replaces a load mapper the model may have set.) Loading replaces the tensors and
        // their gradient marks: call `remark` after it.
        param.load_mapper(move |t: Tensor<AB, D>| {
            let require_grad = t.is_require_grad();
            let inner = t.inner().into_primitive().tensor();
            let sharded = match inner {
                ShardTensor::Sharded(s) => ShardTensor::Sharded(s),
                t => ShardTensor::Sharded(slice_local::<B>(local(t), &group)),
            };
            let out = Tensor::<AB, D>::from_inner(Tensor::from_primitive(TensorPrimitive::Float(
                sharded,
            )));
            if require_grad {
                out.require_grad()
            } else {
                out
            }
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
        let tensor = replace_primitive::<B, AB, D>(id, tensor, |t| ShardTensor::Local(local(t)));
        Param::from_mapped_value(id, tensor, mapper)
    }
}

/// Every rank must hold the same parameters (count and shapes, in order): compared through a
/// fingerprint all-reduced with max and min.
fn check_consistent<AB: AutodiffBackend, M: Module<AB>>(
    module: &M,
    group: &dyn ProcessGroup,
) -> Result<(), ShardError> {
    struct Fingerprint {
        count: i64,
        hash: u64,
    }
    impl<AB: Backend> ModuleVisitor<AB> for Fingerprint {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
            self.count += 1;
            // `lazy_shape` does not run a lazy initialiser (that happens sharded, later).
            for d in param.lazy_shape().dims::<D>() {
                self.hash = (self.hash ^ d as u64).wrapping_mul(0x0100_0000_01b3);
            }
            self.hash = (self.hash ^ 0xff).wrapping_mul(0x0100_0000_01b3);
        }
    }
    let mut fp = Fingerprint {
        count: 0,
        hash: 0xcbf2_9ce4_8422_2325,
    };
    module.visit(&mut fp);
    let mine = [fp.count, fp.hash as i64];
    let mut max = mine;
    let mut min = mine;
    group.all_reduce((&mut max[..]).into(), ReduceOp::Max)?;
    group.all_reduce((&mut min[..]).into(), ReduceOp::Min)?;
    if max != min {
        return Err(ShardError::Inconsistent(format!(
            "rank {} has {} parameters (shape fingerprint {:016x}), but across the group '{}' \
             the parameter count ranges over {}..={} and the fingerprints differ: every rank \
             must build the same model",
            group.rank(),
            fp.count,
            fp.hash,
            group.name(),
            min[0],
            max[0]
        )));
    }
    Ok(())
}

/// `loss.backward()` followed by `GradientsParams::from_grads`, leaving the model ready for
/// another backward before the optimizer step (gradient accumulation).
///
/// burn-autodiff consumes a parameter's "reduce my gradient" mark with the backward that uses
/// it; the optimizer step re-marks, but a second micro-batch before the step would otherwise
/// run unmarked and its gradients would never be reduced. This re-marks every trainable
/// parameter (the mark is keyed by the parameter's graph node, so marking a clone suffices).
pub fn backward<B, AB, M>(loss: Tensor<AB, 1>, module: &M) -> burn::optim::GradientsParams
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Shard<B>>,
    M: burn::module::AutodiffModule<AB>,
{
    let grads = burn::optim::GradientsParams::from_grads(loss.backward(), module);
    remark::<B, AB, M>(module);
    grads
}

/// Marks every trainable parameter of a sharded model again for gradient reduction.
/// Call it after a backward pass that is followed by another before the optimizer step (see
/// [`backward`]) and after loading weights into a sharded model (loading replaces the
/// parameters' tensors, and with them the marks).
pub fn remark<B, AB, M>(module: &M)
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Shard<B>>,
    M: burn::module::AutodiffModule<AB>,
{
    struct Remark<B>(std::marker::PhantomData<B>);
    impl<B: Backend, AB: AutodiffBackend<InnerBackend = Shard<B>>> ModuleVisitor<AB> for Remark<B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
            let did = DistributedParamId::from(param.id.val());
            let tensor = param.val();
            // Loading a record gives parameters the record's ids, which `shard` may never have
            // seen: a trainable parameter of a sharded model is registered here, so that its
            // gradient is reduced like every other.
            let shape = burn_std::Shape::from(tensor.dims().to_vec());
            let sharded = crate::state::try_with_state::<B, _>(|s| {
                s.params.entry(did).or_insert(shape);
            })
            .is_some();
            if tensor.is_distributed() || (sharded && tensor.is_require_grad()) {
                let _ = tensor.set_distributed(did);
            }
        }
    }
    module.visit(&mut Remark::<B>(std::marker::PhantomData));
}
