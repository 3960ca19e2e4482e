//! The optimizer side: ZeRO-1/2's slice-step-gather, and global gradient-norm clipping.

use super::buffers::sync_buffers;
use super::config::buckets;
use super::params::replace_primitive;
use super::reduce::RankMajor;
use super::shard::{Marks, apply_marks};
use super::state::ModelState;
use crate::core::backend::Shard;
use crate::core::error::ShardError;
use crate::core::host::{Host, read, read_host, slice_local, write_host};
use crate::core::ops::local;
use crate::core::scope::waiting;
use crate::core::tensor::{Restore, ShardTensor, Sharded, same_group};
use crate::features::zero::flat;
use burn::module::{AutodiffModule, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::LearningRate;
use burn::optim::{GradientsParams, MultiGradientsParams, Optimizer};
use burn::tensor::Tensor;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn_backend::TensorMetadata;
use std::collections::HashMap;
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
        let marks = Marks::<B>::of::<AB, M>(&module);
        check_reduced::<B, AB, M>(&module, &marks, &[&grads]);
        around_step(module, marks, |m| self.inner.step(lr, m, grads))
    }

    fn step_multi(&mut self, lr: LearningRate, module: M, grads: MultiGradientsParams) -> M {
        let marks = Marks::<B>::of::<AB, M>(&module);
        let parts: Vec<&GradientsParams> = grads.grads.iter().map(|(g, _)| g).collect();
        check_reduced::<B, AB, M>(&module, &marks, &parts);
        around_step(module, marks, |m| self.inner.step_multi(lr, m, grads))
    }

    fn to_record(&self) -> Self::Record {
        self.inner.to_record()
    }

    fn load_record(self, record: Self::Record) -> Self {
        ShardedOptimizer::new(self.inner.load_record(record))
    }
}

/// ZeRO-1/2: slices the replicated trainable parameters before the inner step (so that its
/// state is slice-sized) and all-gathers them after, in buckets; then re-marks every parameter
/// with its model's gradient-sync id (Burn's optimizer re-marks with ids of its own).
fn around_step<B, AB, M>(module: M, marks: Marks<B>, step: impl FnOnce(M) -> M) -> M
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Shard<B>>,
    M: AutodiffModule<AB>,
{
    // Parameters change: nothing gathered or registered for prefetching survives the step.
    for m in marks.models() {
        if let Some(p) = &m.prefetch {
            p.lock().invalidate();
        }
    }
    let slices = marks.models().iter().any(|m| slices_params(m));
    let module = if slices {
        module.map(&mut Slicer::<B> { marks: &marks })
    } else {
        module
    };
    let mut module = step(module);
    for m in marks.models().iter().filter(|m| slices_params(m)) {
        module = gather_bucketed::<B, AB, M>(module, &marks, m);
    }
    let module = apply_marks::<B, AB, M>(module, &marks);
    // Buffers (BatchNorm's running statistics) made equal across the ranks, as the model's
    // policy says.
    let module = match marks.models().first() {
        Some(m) => {
            let config = &m.config;
            sync_buffers::<B, AB, M>(
                module,
                m.dp_group.as_ref(),
                config.buffers,
                &config.buffer_paths,
            )
            .unwrap_or_else(|e| panic!("kiln: making buffers equal across ranks: {e}"))
        }
        None => module,
    };
    for m in marks.models() {
        if let Some(p) = &m.prefetch {
            super::prefetch::prime(p);
        }
    }
    module
}

/// ZeRO-1/2: replicated parameters, sharded optimizer state.
fn slices_params<B: Backend>(m: &ModelState<B>) -> bool {
    let st = m.config.strategy;
    st.shards_optimizer() && !st.shards_params()
}

/// Panics if, for a model sharded over more than one rank, a parameter has a gradient the hook
/// never reduced: training would silently diverge across ranks. This happens when its mark was
/// lost: a second backward before the step without [`remark`](crate::remark) or
/// [`backward`](crate::backward), or gradients computed under [`no_sync`](crate::no_sync)
/// without [`reduce_gradients`](crate::reduce_gradients). Over one rank there is nothing to
/// reduce.
fn check_reduced<B, AB, M>(module: &M, marks: &Marks<B>, grads: &[&GradientsParams])
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Shard<B>>,
    M: AutodiffModule<AB>,
{
    use burn_backend::distributed::DistributedParamId;
    use std::collections::HashSet;
    // Which gradients each model's hook reduced since the last step (taken: the next step
    // starts afresh).
    let synced: Vec<(u64, bool, HashSet<DistributedParamId>)> = marks
        .models()
        .iter()
        .map(|m| (m.seq, m.over_ranks(), std::mem::take(&mut m.lock().synced)))
        .collect();
    struct Find<'a, B: Backend> {
        grads: &'a [&'a GradientsParams],
        marks: &'a Marks<B>,
        synced: &'a [(u64, bool, HashSet<DistributedParamId>)],
        missing: Vec<String>,
    }
    impl<B: Backend, AB: AutodiffBackend<InnerBackend = Shard<B>>> ModuleVisitor<AB> for Find<'_, B> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<AB, D>>) {
            let Some((mark, m)) = self.marks.get(p.id) else {
                return;
            };
            let (_, over_ranks, synced) = self
                .synced
                .iter()
                .find(|(seq, _, _)| *seq == m.seq)
                .expect("every model of the marks");
            let has_grad = self
                .grads
                .iter()
                .any(|g| g.get::<Shard<B>, D>(p.id).is_some());
            if *over_ranks && has_grad && !synced.contains(mark) {
                self.missing
                    .push(format!("{} {:?}", p.id, p.lazy_shape().dims::<D>()));
            }
        }
    }
    let mut find = Find::<B> {
        grads,
        marks,
        synced: &synced,
        missing: Vec::new(),
    };
    module.visit(&mut find);
    assert!(
        find.missing.is_empty(),
        "kiln: the gradients of {} parameter(s) were never reduced across ranks (first: {}): their \
         gradient-sync marks were lost. For several backward passes per step use \
         `kiln_shard::backward` or call `kiln_shard::remark(&model)` between them; gradients \
         accumulated under `kiln_shard::no_sync` must go through `kiln_shard::reduce_gradients`",
        find.missing.len(),
        find.missing[0]
    );
}

struct Slicer<'a, B: Backend> {
    marks: &'a Marks<B>,
}

impl<B, AB> ModuleMapper<AB> for Slicer<'_, B>
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Shard<B>>,
{
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<AB, D>>) -> Param<Tensor<AB, D>> {
        let group = match self.marks.get(param.id) {
            Some((_, m)) if slices_params(m) => m.shard_group.clone(),
            _ => return param,
        };
        let (id, tensor, mapper) = param.consume();
        let tensor = replace_primitive::<B, AB, D>(tensor, |t| match t.part() {
            // A tensor-parallel part is sliced as the tensor.
            Some(p) => (p.rewrap)(ShardTensor::Sharded(slice_local::<B>(
                local(p.local),
                &group,
                flat(),
            ))),
            None => ShardTensor::Sharded(slice_local::<B>(local(t), &group, flat())),
        });
        Param::from_mapped_value(id, tensor, mapper)
    }
}

/// All-gathers the sliced parameters of model `m` after a ZeRO-1/2 step, a bucket of about
/// `bucket_bytes` per collective (rank-major, each parameter's shards padded to equal length,
/// as the gradient reduce-scatter lays them out).
fn gather_bucketed<B, AB, M>(module: M, marks: &Marks<B>, m: &Arc<ModelState<B>>) -> M
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Shard<B>>,
    M: AutodiffModule<AB>,
{
    // The model's shards, in module order.
    struct Read<'a, B: Backend> {
        marks: &'a Marks<B>,
        model: &'a Arc<ModelState<B>>,
        shards: Vec<(ParamId, Sharded<B>)>,
        /// How a tensor-parallel part gathered becomes the parameter again.
        parts: HashMap<ParamId, Restore<B>>,
    }
    impl<B: Backend, AB: AutodiffBackend<InnerBackend = Shard<B>>> ModuleVisitor<AB> for Read<'_, B> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<AB, D>>) {
            if self.marks.in_model(p.id, self.model).is_none() {
                return;
            }
            match p.val().inner().into_primitive().tensor() {
                ShardTensor::Sharded(s) => self.shards.push((p.id, s)),
                t => {
                    if let Some(part) = t.part()
                        && let ShardTensor::Sharded(s) = part.local
                    {
                        self.shards.push((p.id, s));
                        self.parts.insert(p.id, part.rewrap);
                    }
                }
            }
        }
    }
    let mut r = Read {
        marks,
        model: m,
        shards: Vec::new(),
        parts: HashMap::new(),
    };
    module.visit(&mut r);
    let group = &m.shard_group;
    let world = group.world_size();
    let mut whole: HashMap<ParamId, B::FloatTensorPrimitive> = HashMap::new();
    let sizes: Vec<_> = r
        .shards
        .iter()
        .map(|(_, s)| (s.shard.dtype(), s.numel() * s.shard.dtype().size()))
        .collect();
    for run in buckets(&sizes, m.config.bucket_bytes) {
        let dtype = sizes[run.start].0;
        let bucket = &r.shards[run];
        let numels: Vec<usize> = bucket.iter().map(|(_, s)| s.numel()).collect();
        let layout = RankMajor::new(&numels, world);
        let device = B::float_device(&bucket[0].1.shard);
        let rank = group.rank();
        let mut mine: Option<Host> = None;
        for (i, (_, s)) in bucket.iter().enumerate() {
            let h = read_host::<B>(s.shard.clone());
            let mine = mine.get_or_insert_with(|| h.zeros(layout.chunk));
            let (at, _) = layout.place(i, rank);
            mine.copy_from(at - rank * layout.chunk, &h, 0..h.len());
        }
        let mine = mine.expect("a bucket holds a tensor");
        let mut all = mine.zeros(layout.len());
        waiting(|| group.all_gather(mine.buf(), all.buf_mut())).unwrap_or_else(|e| {
            panic!(
                "kiln: rank {} could not all-gather a bucket of {} parameters on group '{}': {e}",
                group.rank(),
                bucket.len(),
                group.name()
            )
        });
        for (i, (id, s)) in bucket.iter().enumerate() {
            let mut values = mine.zeros(s.numel());
            for peer in 0..world {
                let (at, range) = layout.place(i, peer);
                values.copy_from(range.start, &all, at..at + range.len());
            }
            whole.insert(
                *id,
                write_host::<B>(values, s.shape.clone(), &device, dtype),
            );
        }
    }
    struct Write<B: Backend> {
        whole: HashMap<ParamId, B::FloatTensorPrimitive>,
        parts: HashMap<ParamId, Restore<B>>,
    }
    impl<B: Backend, AB: AutodiffBackend<InnerBackend = Shard<B>>> ModuleMapper<AB> for Write<B> {
        fn map_float<const D: usize>(
            &mut self,
            param: Param<Tensor<AB, D>>,
        ) -> Param<Tensor<AB, D>> {
            match self.whole.remove(&param.id) {
                Some(w) => {
                    let restore = self.parts.remove(&param.id);
                    let (id, tensor, mapper) = param.consume();
                    let tensor = replace_primitive::<B, AB, D>(tensor, |_| match restore {
                        Some(restore) => restore(ShardTensor::Local(w)),
                        None => ShardTensor::Local(w),
                    });
                    Param::from_mapped_value(id, tensor, mapper)
                }
                None => param,
            }
        }
    }
    let parts = r.parts;
    module.map(&mut Write::<B> { whole, parts })
}

/// Scales the gradients so that their global L2 norm is at most `max_norm` (PyTorch's
/// `clip_grad_norm_`: coefficient `max_norm / (norm + 1e-6)`, capped at 1) and returns the
/// norm before clipping.
///
/// The norm is over the whole model: every gradient's sum of squares is computed where it
/// lies, read to the host in one transfer, and the sharded gradients' sums all-reduced in one
/// collective per group (replicated gradients are whole and equal on every rank), so every rank
/// computes the same norm as a single device would. Every rank must call it.
pub fn clip_grad_norm<B, AB, M>(
    module: &M,
    grads: GradientsParams,
    max_norm: f64,
) -> Result<(GradientsParams, f64), ShardError>
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Shard<B>>,
    M: AutodiffModule<AB>,
{
    let norm = grad_norm::<B, AB, M>(module, &grads)?;
    let scale = clip_coefficient(max_norm, norm);
    let grads = if scale < 1.0 {
        scale_grads::<AB, M>(module, grads, scale)
    } else {
        grads
    };
    Ok((grads, norm))
}

/// What gradients of global norm `norm` are multiplied by to clip them to `max_norm`.
pub(crate) fn clip_coefficient(max_norm: f64, norm: f64) -> f64 {
    (max_norm / (norm + 1e-6)).min(1.0)
}

/// The global L2 norm of the gradients over all ranks and shards (see [`clip_grad_norm`]);
/// not finite when any rank's gradients are not. Every rank must call it.
///
/// # Errors
/// A failed all-reduce of the sharded gradients' part.
pub fn grad_norm<B, AB, M>(module: &M, grads: &GradientsParams) -> Result<f64, ShardError>
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Shard<B>>,
    M: AutodiffModule<AB>,
{
    use kiln_comm::{ProcessGroup, ReduceOp};
    /// Partial sums of squares over one group.
    type Partials<B> = (
        Arc<dyn ProcessGroup>,
        Vec<burn_backend::tensor::FloatTensor<B>>,
    );
    /// Sums of squares of whole gradients, of shards per group, and of tensor-parallel parts
    /// sharded over a data-parallel group (summed over that group, then over the tp group).
    struct SumSquares<'a, B: Backend> {
        grads: &'a GradientsParams,
        whole: Vec<B::FloatTensorPrimitive>,
        sharded: Vec<Partials<B>>,
        nested: Vec<(Arc<dyn ProcessGroup>, Partials<B>)>,
    }
    impl<B: Backend, AB: AutodiffBackend<InnerBackend = Shard<B>>> ModuleVisitor<AB>
        for SumSquares<'_, B>
    {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
            let Some(g) = self.grads.get::<Shard<B>, D>(param.id) else {
                return;
            };
            let square_sum = |t: B::FloatTensorPrimitive| B::float_sum(B::float_mul(t.clone(), t));
            // A shard's or a tensor-parallel part's squares are summed over its group.
            let (part, group) = match g.into_primitive().tensor() {
                ShardTensor::Sharded(s) => (s.shard, s.group),
                t => match t.part() {
                    Some(p) => match p.local {
                        ShardTensor::Sharded(s) => {
                            let part =
                                (s.shard.shape().num_elements() > 0).then(|| square_sum(s.shard));
                            let at = match self.nested.iter().position(|(dp, (tp, _))| {
                                same_group(dp, &s.group) && same_group(tp, &p.group)
                            }) {
                                Some(at) => at,
                                None => {
                                    self.nested.push((s.group, (p.group, Vec::new())));
                                    self.nested.len() - 1
                                }
                            };
                            self.nested[at].1.1.extend(part);
                            return;
                        }
                        part => (local(part), p.group),
                    },
                    None => return self.whole.push(square_sum(local(t))),
                },
            };
            let part = (part.shape().num_elements() > 0).then(|| square_sum(part));
            let at = match self.sharded.iter().position(|(g, _)| same_group(g, &group)) {
                Some(at) => at,
                None => {
                    self.sharded.push((group, Vec::new()));
                    self.sharded.len() - 1
                }
            };
            self.sharded[at].1.extend(part);
        }
    }
    /// One read of many one-element tensors, summed in f64.
    fn total<B: Backend>(parts: Vec<B::FloatTensorPrimitive>) -> f64 {
        if parts.is_empty() {
            return 0.0;
        }
        let all = B::float_cat(parts, 0);
        read::<B>(all).convert::<f64>().iter::<f64>().sum::<f64>()
    }
    let mut sum = SumSquares::<B> {
        grads,
        whole: Vec::new(),
        sharded: Vec::new(),
        nested: Vec::new(),
    };
    module.visit(&mut sum);
    let mut norm_sq = total::<B>(sum.whole);
    for (group, parts) in sum.sharded {
        let mut part = [total::<B>(parts) as f32];
        waiting(|| group.all_reduce((&mut part[..]).into(), ReduceOp::Sum))?;
        norm_sq += f64::from(part[0]);
    }
    for (dp, (tp, parts)) in sum.nested {
        let mut part = [total::<B>(parts) as f32];
        waiting(|| dp.all_reduce((&mut part[..]).into(), ReduceOp::Sum))?;
        waiting(|| tp.all_reduce((&mut part[..]).into(), ReduceOp::Sum))?;
        norm_sq += f64::from(part[0]);
    }
    Ok(norm_sq.sqrt())
}

/// The gradients each in its parameter's dtype: under a lower-precision compute dtype a
/// gradient leaving a compute-bound op is in that dtype, and the optimizer's state must not
/// be (fp32 masters and moments, as autocast's cast back to the parameter's dtype gives).
/// Parameters of a sharded model have theirs widened as they become final; this serves any
/// other model.
pub fn widen_grads<AB, M>(module: &M, mut grads: GradientsParams) -> GradientsParams
where
    AB: AutodiffBackend,
    M: AutodiffModule<AB>,
{
    struct Widen<'a, AB: AutodiffBackend> {
        grads: &'a mut GradientsParams,
        _b: PhantomData<AB>,
    }
    impl<AB: AutodiffBackend> ModuleVisitor<AB> for Widen<'_, AB> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
            let Some(dtype) = self
                .grads
                .get::<AB::InnerBackend, D>(param.id)
                .map(|g| g.dtype())
            else {
                return;
            };
            let want = param.val().dtype();
            if dtype != want
                && let Some(g) = self.grads.remove::<AB::InnerBackend, D>(param.id)
            {
                self.grads.register(param.id, g.cast(want));
            }
        }
    }
    module.visit(&mut Widen::<AB> {
        grads: &mut grads,
        _b: PhantomData,
    });
    grads
}

/// `grads` multiplied by `factor` (clipping, unscaling a loss scale).
pub fn scale_grads<AB, M>(module: &M, mut grads: GradientsParams, factor: f64) -> GradientsParams
where
    AB: AutodiffBackend,
    M: AutodiffModule<AB>,
{
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
    module.visit(&mut Scale::<AB> {
        grads: &mut grads,
        scale: factor,
        _b: PhantomData,
    });
    grads
}
