//! The optimizer side: ZeRO-1/2's slice-step-gather, and global gradient-norm clipping.

use crate::ops::policy::{local, slice_local};
use crate::state::try_with_state;
use crate::strategy::{gather_model, replace_primitive};
use crate::{Shard, ShardTensor};
use burn::module::{AutodiffModule, ModuleMapper, ModuleVisitor, Param};
use burn::optim::LearningRate;
use burn::optim::{GradientsParams, MultiGradientsParams, Optimizer};
use burn::prelude::ElementConversion;
use burn::tensor::Tensor;
use burn::tensor::backend::{AutodiffBackend, Backend};
use kiln_comm::ProcessGroup;
use std::marker::PhantomData;
use std::sync::Arc;

/// Wraps any Burn optimizer so that it updates only this rank's slice where the strategy
/// shards optimizer state.
///
/// - DDP: the inner optimizer as is.
/// - ZeRO-1/2: parameters are replicated between steps but gradients arrive sharded; the step
///   slices each trainable parameter (locally, no communication), runs the inner optimizer on
///   the slices, so its state is created and kept slice-sized, then all-gathers the parameters.
/// - ZeRO-3 / hybrid: parameters are already shards; the inner optimizer runs on them.
#[derive(Debug, Clone)]
pub struct ShardedOptimizer<O, B> {
    inner: O,
    _backend: PhantomData<fn() -> B>,
}

impl<O, B> ShardedOptimizer<O, B> {
    /// Wraps `inner`.
    pub fn new(inner: O) -> Self {
        ShardedOptimizer {
            inner,
            _backend: PhantomData,
        }
    }
}

impl<O, B, AB, M> Optimizer<M, AB> for ShardedOptimizer<O, B>
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Shard<B>>,
    M: AutodiffModule<AB>,
    O: Optimizer<M, AB>,
{
    type Record = O::Record;

    fn step(&mut self, lr: LearningRate, module: M, grads: GradientsParams) -> M {
        check_reduced::<B, AB, M>(&module, &grads);
        let slice_over = try_with_state::<B, _>(|s| {
            let st = s.config.strategy;
            (st.shards_optimizer() && !st.shards_params()).then(|| s.shard_group.clone())
        })
        .flatten();
        match slice_over {
            Some(group) => {
                let module = module.map(&mut Slicer::<B> {
                    group,
                    _b: PhantomData,
                });
                let module = self.inner.step(lr, module, grads);
                gather_model::<B, AB, M>(module)
            }
            None => self.inner.step(lr, module, grads),
        }
    }

    fn step_multi(&mut self, lr: LearningRate, module: M, grads: MultiGradientsParams) -> M {
        self.inner.step_multi(lr, module, grads)
    }

    fn to_record(&self) -> Self::Record {
        self.inner.to_record()
    }

    fn load_record(self, record: Self::Record) -> Self {
        ShardedOptimizer::new(self.inner.load_record(record))
    }
}

/// Panics if, on a thread that sharded a model over more than one rank, a parameter has a
/// gradient the hook never reduced: training would silently diverge across ranks. This happens
/// when its mark was lost: loading weights replaces the parameters (call `remark` after
/// loading), or a second backward before the step (use `kiln_shard::backward`). Over one rank
/// there is nothing to reduce, so a model trained unsharded on a thread that earlier sharded
/// one at world size 1 (a benchmark's baseline, say) passes.
fn check_reduced<B, AB, M>(module: &M, grads: &GradientsParams)
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Shard<B>>,
    M: AutodiffModule<AB>,
{
    use burn_backend::distributed::DistributedParamId;
    use std::collections::HashSet;
    // One look at this thread's state: whether gradients need reducing at all (over more than
    // one rank), and which ones the hook reduced since the last step (taken: the next step
    // starts afresh).
    let Some((over_ranks, synced)) = try_with_state::<B, _>(|s| {
        let over_ranks = s.shard_group.world_size() > 1
            || s.replicate_group
                .as_ref()
                .is_some_and(|r| r.world_size() > 1);
        (over_ranks, std::mem::take(&mut s.synced))
    }) else {
        return;
    };
    if !over_ranks {
        return;
    }
    struct Find<'a, B> {
        grads: &'a GradientsParams,
        synced: &'a HashSet<DistributedParamId>,
        missing: Vec<String>,
        _b: PhantomData<B>,
    }
    impl<B: Backend, AB: AutodiffBackend<InnerBackend = Shard<B>>> ModuleVisitor<AB> for Find<'_, B> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<AB, D>>) {
            // Every gradient of a sharded model must have passed the hook, including those of
            // parameters `shard` never saw (a record loaded with its own ids, no `remark`).
            let reduced = self.synced.contains(&DistributedParamId::from(p.id.val()));
            if !reduced && self.grads.get::<Shard<B>, D>(p.id).is_some() {
                self.missing
                    .push(format!("{} {:?}", p.id, p.lazy_shape().dims::<D>()));
            }
        }
    }
    let mut find = Find::<B> {
        grads,
        synced: &synced,
        missing: Vec::new(),
        _b: PhantomData,
    };
    module.visit(&mut find);
    assert!(
        find.missing.is_empty(),
        "kiln: the gradients of {} parameter(s) were never reduced across ranks (first: {}): their \
         gradient-sync marks were lost. Loading weights replaces parameters: call \
         `kiln_shard::remark(&model)` after loading; for several backward passes per step use \
         `kiln_shard::backward`; a model not meant to be sharded must train on a thread that \
         has not sharded one",
        find.missing.len(),
        find.missing[0]
    );
}

struct Slicer<B> {
    group: Arc<dyn ProcessGroup>,
    _b: PhantomData<B>,
}

impl<B, AB> ModuleMapper<AB> for Slicer<B>
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Shard<B>>,
{
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<AB, D>>) -> Param<Tensor<AB, D>> {
        let (id, tensor, mapper) = param.consume();
        let tensor = if tensor.is_distributed() {
            let group = self.group.clone();
            replace_primitive::<B, AB, D>(id, tensor, |t| {
                ShardTensor::Sharded(slice_local::<B>(local(t), &group))
            })
        } else {
            tensor
        };
        Param::from_mapped_value(id, tensor, mapper)
    }
}

/// Scales the gradients so that their global L2 norm is at most `max_norm` (PyTorch's
/// `clip_grad_norm_`: coefficient `max_norm / (norm + 1e-6)`, capped at 1) and returns the
/// norm before clipping.
///
/// The norm is over the whole model: squares of sharded gradients are summed locally and
/// all-reduced, so every rank computes the same norm as a single device would. Every rank
/// must call it.
pub fn clip_grad_norm<AB, M>(
    module: &M,
    mut grads: GradientsParams,
    max_norm: f64,
) -> (GradientsParams, f64)
where
    AB: AutodiffBackend,
    M: AutodiffModule<AB>,
{
    struct SumSquares<'a, AB: AutodiffBackend> {
        grads: &'a GradientsParams,
        total: f64,
        _b: PhantomData<AB>,
    }
    impl<AB: AutodiffBackend> ModuleVisitor<AB> for SumSquares<'_, AB> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
            if let Some(g) = self.grads.get::<AB::InnerBackend, D>(param.id) {
                self.total += g.square().sum().into_scalar().elem::<f64>();
            }
        }
    }
    struct Scale<'a, AB: AutodiffBackend> {
        grads: &'a mut GradientsParams,
        scale: f64,
        _b: PhantomData<AB>,
    }
    impl<AB: AutodiffBackend> ModuleVisitor<AB> for Scale<'_, AB> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
            if let Some(g) = self.grads.remove::<AB::InnerBackend, D>(param.id) {
                self.grads.register(param.id, g.mul_scalar(self.scale));
            }
        }
    }
    let mut sum = SumSquares::<AB> {
        grads: &grads,
        total: 0.0,
        _b: PhantomData,
    };
    module.visit(&mut sum);
    let norm = sum.total.sqrt();
    let scale = (max_norm / (norm + 1e-6)).min(1.0);
    if scale < 1.0 {
        module.visit(&mut Scale::<AB> {
            grads: &mut grads,
            scale,
            _b: PhantomData,
        });
    }
    (grads, norm)
}
