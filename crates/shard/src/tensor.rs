//! The float primitive of [`Shard`](crate::Shard): a whole tensor, or this rank's shard of one.

use burn_backend::{Backend, DType, TensorMetadata};
use burn_std::{Shape, Slice, SliceOps};
use kiln_comm::ProcessGroup;
use std::sync::Arc;

/// A float tensor under kiln's sharding decorator.
///
/// `shape()` is always the logical (whole) shape, so modules, `num_params` and shape checks
/// see the model as written; only the bytes held differ.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum ShardTensor<B: Backend> {
    /// The whole tensor, held by this rank (activations, DDP parameters, anything replicated).
    Local(B::FloatTensorPrimitive),
    /// This rank's shard of a tensor laid out flat over a group.
    Sharded(Sharded<B>),
    /// A layout op (reshape, transpose, permute, slice, expand) of a shard, not yet applied:
    /// the shard is gathered and the ops replayed only when the view is used.
    ///
    /// Without it, `w.transpose()` of a sharded weight would return the whole weight, which
    /// autodiff then keeps for backward (a tied output head `x @ wteᵀ`, a LayerNorm's scale
    /// reshaped for broadcasting): the whole parameter would live from forward to backward,
    /// breaking ZeRO-3's "gathered on use, dropped after".
    View(View<B>),
    /// A whole tensor recorded for rematerialisation (inside a step's forward under a memory
    /// budget): its value may be given up and computed again when read (see [`crate::remat`]).
    Remat(crate::remat::Handle<B>),
    /// A LoRA weight `W + s Aᵀ Bᵀ`, formed only when used other than by `Linear` (see
    /// [`crate::lowrank`]).
    LowRank(Arc<crate::lowrank::LowRank<B>>),
    /// A `Linear`'s weight gradient `Σ xᵀ dy`, formed only when read other than by a LoRA
    /// weight's op (see [`crate::lowrank`]).
    WeightGrad(Arc<crate::lowrank::WeightGrad<B>>),
}

/// A shard seen through layout ops: `ops` applied in order to the gathered `base`.
#[derive(Debug, Clone)]
pub struct View<B: Backend> {
    /// The shard the view reads.
    pub base: Sharded<B>,
    /// The layout ops, in order.
    pub ops: Vec<ViewOp>,
    /// The view's logical shape.
    pub shape: Shape,
}

/// A layout op deferred by a [`View`], with the inner backend's arguments.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum ViewOp {
    /// `float_reshape` to this shape.
    Reshape(Shape),
    /// `float_swap_dims`.
    SwapDims(usize, usize),
    /// `float_permute` by these axes.
    Permute(Vec<usize>),
    /// `float_slice` with these slices.
    Slice(Vec<Slice>),
    /// `float_expand` to this shape.
    Expand(Shape),
}

impl ViewOp {
    /// Applies the op to a whole inner tensor.
    pub fn apply<B: Backend>(&self, t: B::FloatTensorPrimitive) -> B::FloatTensorPrimitive {
        match self {
            ViewOp::Reshape(shape) => B::float_reshape(t, shape.clone()),
            ViewOp::SwapDims(a, b) => B::float_swap_dims(t, *a, *b),
            ViewOp::Permute(axes) => B::float_permute(t, axes),
            ViewOp::Slice(slices) => B::float_slice(t, slices),
            ViewOp::Expand(shape) => B::float_expand(t, shape.clone()),
        }
    }

    /// The shape the op gives a tensor of `shape` (Burn's shape rules, without a tensor).
    pub fn apply_shape<B: Backend>(&self, shape: Shape) -> Shape {
        let dims = shape.as_slice();
        match self {
            ViewOp::Reshape(s) | ViewOp::Expand(s) => s.clone(),
            ViewOp::SwapDims(a, b) => {
                let mut d = dims.to_vec();
                d.swap(*a, *b);
                Shape::from(d)
            }
            ViewOp::Permute(axes) => Shape::from(axes.iter().map(|&a| dims[a]).collect::<Vec<_>>()),
            ViewOp::Slice(slices) => shape.clone().slice(slices).unwrap_or_else(|e| {
                panic!("kiln: slicing a tensor of shape {dims:?} with {slices:?}: {e:?}")
            }),
        }
    }
}

/// This rank's shard of a tensor: elements `shard_range(numel, world_size, rank)` of the
/// row-major flattened tensor, as a 1-D inner tensor.
///
/// The group travels with the shard (the inner device cannot tell ranks apart: Flex has a
/// single device), so any op can gather it.
#[derive(Clone)]
pub struct Sharded<B: Backend> {
    /// The local elements, 1-D.
    pub shard: B::FloatTensorPrimitive,
    /// The logical shape of the whole tensor.
    pub shape: Shape,
    /// The group the tensor is sharded over.
    pub group: Arc<dyn ProcessGroup>,
    /// Which parameter value this shard is (set when a sharded model's parameters are marked,
    /// kept by clones and views, dropped by any op that computes new values): gathering it may
    /// use an all-gather prefetched in the order of the previous step (see `prefetch`).
    pub(crate) tag: Option<ParamTag>,
}

/// A parameter's gradient-sync id and the version of its value: the model's optimizer steps
/// so far when it was marked. A prefetch serves only the version it was gathered from, so a
/// copy of the model kept from before a step (an EMA, a snapshot) never receives newer values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ParamTag {
    pub id: burn_backend::distributed::DistributedParamId,
    pub version: u64,
}

impl<B: Backend> std::fmt::Debug for Sharded<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sharded")
            .field("shape", &self.shape)
            .field("rank", &self.group.rank())
            .field("world_size", &self.group.world_size())
            .field("group", &self.group.name())
            .finish()
    }
}

impl<B: Backend> Sharded<B> {
    /// The number of elements of the whole tensor.
    pub fn numel(&self) -> usize {
        self.shape.num_elements()
    }

    /// Whether `other` is laid out like `self` (same logical shape, same group), so that
    /// elementwise ops can run shard by shard.
    pub fn same_layout(&self, other: &Sharded<B>) -> bool {
        self.shape == other.shape && same_group(&self.group, &other.group)
    }
}

/// Two handles on one group (sub-groups are distinct objects with distinct names).
pub(crate) fn same_group(a: &Arc<dyn ProcessGroup>, b: &Arc<dyn ProcessGroup>) -> bool {
    Arc::ptr_eq(a, b)
        || (a.name() == b.name() && a.rank() == b.rank() && a.world_size() == b.world_size())
}

impl<B: Backend> TensorMetadata for ShardTensor<B> {
    fn dtype(&self) -> DType {
        match self {
            ShardTensor::Local(t) => t.dtype(),
            ShardTensor::Sharded(s) => s.shard.dtype(),
            ShardTensor::View(v) => v.base.shard.dtype(),
            ShardTensor::Remat(h) => h.dtype(),
            ShardTensor::LowRank(w) => w.dtype(),
            ShardTensor::WeightGrad(g) => g.dtype(),
        }
    }

    fn shape(&self) -> Shape {
        match self {
            ShardTensor::Local(t) => t.shape(),
            ShardTensor::Sharded(s) => s.shape.clone(),
            ShardTensor::View(v) => v.shape.clone(),
            ShardTensor::Remat(h) => h.shape(),
            ShardTensor::LowRank(w) => w.shape(),
            ShardTensor::WeightGrad(g) => g.shape(),
        }
    }
}

impl<B: Backend> ShardTensor<B> {
    /// Whether this is a shard (or a view of one).
    pub fn is_sharded(&self) -> bool {
        matches!(self, ShardTensor::Sharded(_) | ShardTensor::View(_))
    }

    /// Bytes this rank holds for the tensor (a view holds its shard).
    pub fn local_bytes(&self) -> usize {
        let (numel, dtype) = match self {
            ShardTensor::Local(t) => (t.shape().num_elements(), t.dtype()),
            ShardTensor::Sharded(s) => (s.shard.shape().num_elements(), s.shard.dtype()),
            ShardTensor::View(v) => (v.base.shard.shape().num_elements(), v.base.shard.dtype()),
            ShardTensor::Remat(h) => (h.shape().num_elements(), h.dtype()),
            // Neither holds a tensor of its own shape.
            ShardTensor::LowRank(_) | ShardTensor::WeightGrad(_) => (0, self.dtype()),
        };
        numel * dtype.size()
    }
}
