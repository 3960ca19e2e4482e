//! The float primitive of [`Shard`](crate::Shard): a whole tensor, this rank's shard of one, or
//! a deferred value behind the [`Deferred`] trait.
//!
//! The core knows these three kinds only. What a deferred value is (a view of a shard, a remat
//! handle, a LoRA weight, a deferred weight gradient) is up to the feature that made it: the
//! ops ask it through the trait whether it handles an op itself (a view absorbs layout and
//! elementwise ops, a LoRA weight computes `linear` factored) and otherwise take its value.

use burn_backend::{Backend, DType, TensorMetadata};
use burn_std::{Shape, Slice, SliceOps};
use kiln_comm::ProcessGroup;
use std::any::Any;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

/// An inner backend's float primitive.
pub type Prim<B> = <B as burn_backend::BackendTypes>::FloatTensorPrimitive;

/// A float tensor under kiln's decorator.
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
    /// A value a feature defers: formed (or gathered, or recomputed) only when read.
    Deferred(Arc<dyn Deferred<B>>),
}

/// A value whose forming is deferred, with the ops it handles without forming it.
///
/// Every method but the metadata has a default: "not handled here", and the core then works
/// on [`value`](Deferred::value).
pub trait Deferred<B: Backend>: Any + Send + Sync + std::fmt::Debug {
    /// The logical shape.
    fn shape(&self) -> Shape;
    /// The element type.
    fn dtype(&self) -> DType;
    /// The inner device.
    fn device(&self) -> B::Device;
    /// The whole value (formed, gathered or recomputed).
    fn value(&self) -> Prim<B>;
    /// Bytes this rank holds for it.
    fn held_bytes(&self) -> usize {
        0
    }
    /// Whether it stands for a shard (a view of one): a rank's part, not a whole value.
    fn is_sharded(&self) -> bool {
        false
    }
    /// Whether the inner tensor requires a gradient.
    fn is_require_grad(&self) -> bool {
        false
    }
    /// An elementwise op, if it can be applied without forming the value.
    fn elementwise(&self, _f: &Elementwise<B>) -> Option<ShardTensor<B>> {
        None
    }
    /// A layout op, if it can be deferred too.
    fn layout(&self, _op: &ViewOp) -> Option<ShardTensor<B>> {
        None
    }
    /// `linear(x, self, bias)` computed without forming the value, or the arguments back.
    // The arguments come back unboxed: this runs once per `linear`, and boxing would allocate.
    #[allow(clippy::result_large_err)]
    fn linear(self: Arc<Self>, x: ShardTensor<B>, bias: Option<ShardTensor<B>>) -> LinearArgs<B> {
        Err((x, bias))
    }
    /// `linear_x_backward(self, dy)` computed without forming the value, or `dy` back.
    fn linear_x_backward(
        self: Arc<Self>,
        dy: ShardTensor<B>,
    ) -> Result<ShardTensor<B>, ShardTensor<B>> {
        Err(dy)
    }
    /// An elementwise op on two tensors (broadcasting), `f(self, other)` or, when `!self_lhs`,
    /// `f(other, self)`, computed without forming the value, or `other` back.
    fn binary(
        self: Arc<Self>,
        other: ShardTensor<B>,
        _self_lhs: bool,
        _f: &Binary<B>,
    ) -> Result<ShardTensor<B>, ShardTensor<B>> {
        Err(other)
    }
    /// `matmul(self, other)` or, when `!self_lhs`, `matmul(other, self)` (`f` is the inner
    /// matmul under the precision policy), or `other` back.
    fn matmul(
        self: Arc<Self>,
        other: ShardTensor<B>,
        _self_lhs: bool,
        _f: &Binary<B>,
    ) -> Result<ShardTensor<B>, ShardTensor<B>> {
        Err(other)
    }
    /// An op that works along dimension `dim` only (a reduction keeping it, a cumulative op):
    /// every other index is independent.
    fn along(&self, _dim: usize, _f: &Elementwise<B>) -> Option<ShardTensor<B>> {
        None
    }
    /// `linear_weight_backward(x, dy)` where `self` is `x` (`self_is_x`) or `dy`, or the other
    /// back.
    fn weight_grad(
        self: Arc<Self>,
        other: ShardTensor<B>,
        _self_is_x: bool,
    ) -> Result<ShardTensor<B>, ShardTensor<B>> {
        Err(other)
    }
    /// `embedding(self, indices)` (`self` the table), computed without forming the value.
    fn embed(
        &self,
        _indices: &<B as burn_backend::BackendTypes>::IntTensorPrimitive,
    ) -> Option<ShardTensor<B>> {
        None
    }
    /// `embedding_backward(self, dy, indices)` (`self` the table), computed without forming it.
    fn embed_grad(
        &self,
        _dy: &ShardTensor<B>,
        _indices: &<B as burn_backend::BackendTypes>::IntTensorPrimitive,
    ) -> Option<ShardTensor<B>> {
        None
    }
    /// `cat(tensors, dim)` where `self` is one of `tensors`, computed without forming the
    /// values, or `None`.
    fn cat(&self, _tensors: &[ShardTensor<B>], _dim: usize) -> Option<ShardTensor<B>> {
        None
    }
    /// `gather(dim, self, indices)`, computed without forming the value.
    fn take(
        &self,
        _dim: usize,
        _indices: &<B as burn_backend::BackendTypes>::IntTensorPrimitive,
    ) -> Option<ShardTensor<B>> {
        None
    }
    /// The sum of every element, computed without forming the value.
    fn sum(&self) -> Option<ShardTensor<B>> {
        None
    }
    /// This rank's part of a tensor split over another group (tensor parallelism), and how a
    /// new part (a reduced gradient, updated weights) becomes the tensor again: the
    /// data-parallel strategies work on the part.
    fn part(&self) -> Option<Part<B>> {
        None
    }
    /// `slice_assign(target, slices, self)` computed without forming the value, or `target`
    /// back.
    fn slice_assign(
        self: Arc<Self>,
        target: ShardTensor<B>,
        _slices: &[Slice],
    ) -> Result<ShardTensor<B>, ShardTensor<B>> {
        Err(target)
    }
    /// `linear_bias_backward(self)`, the output gradient summed over every dimension but the
    /// last.
    fn bias_grad(&self) -> Option<ShardTensor<B>> {
        None
    }
}

/// A rank's part of a split tensor ([`Deferred::part`]).
#[derive(Clone)]
pub struct Part<B: Backend> {
    /// This rank's part, as held (whole, or sharded over another group).
    pub local: ShardTensor<B>,
    /// The group the tensor is split over.
    pub group: Arc<dyn ProcessGroup>,
    /// The split tensor a new part of the same shape makes (a reduced gradient, whole or
    /// sharded).
    pub rewrap: Restore<B>,
    /// The split tensor a new whole tensor makes, this rank keeping its part (weights read
    /// from a snapshot).
    pub of_whole: Rewrap<B>,
}

impl<B: Backend> std::fmt::Debug for Part<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Part")
            .field("shape", &self.local.shape())
            .finish_non_exhaustive()
    }
}

/// A function of a part as held making the split tensor again ([`Part::rewrap`]).
pub type Restore<B> = Arc<dyn Fn(ShardTensor<B>) -> ShardTensor<B> + Send + Sync>;

/// A function of an inner tensor making a tensor under the decorator ([`Part`]).
pub type Rewrap<B> = Arc<dyn Fn(Prim<B>) -> ShardTensor<B> + Send + Sync>;

/// An elementwise op on two inner tensors.
pub type Binary<B> = Arc<dyn Fn(Prim<B>, Prim<B>) -> Prim<B> + Send + Sync>;

/// `linear`'s result, or its arguments `(x, bias)` back when not handled.
pub type LinearArgs<B> = Result<ShardTensor<B>, (ShardTensor<B>, Option<ShardTensor<B>>)>;

/// An elementwise op on one inner tensor.
pub type Elementwise<B> = Arc<dyn Fn(Prim<B>) -> Prim<B> + Send + Sync>;

/// How a shard becomes whole and what a layout op on it gives: every [`Sharded`] carries one,
/// so the core gathers a shard without looking anything up (the ZeRO feature's is the plain
/// all-gather; a parameter's also serves gathers its model prefetched).
pub trait ShardOps<B: Backend>: Any + Send + Sync + std::fmt::Debug {
    /// The whole tensor of `s` (a collective over `s.group`).
    fn gather(&self, s: &Sharded<B>) -> Prim<B>;
    /// A layout op on `s`, deferred so that no whole tensor outlives the op that uses it.
    fn view(&self, s: Sharded<B>, op: ViewOp) -> ShardTensor<B>;
    /// What a shard computed from one carrying these ops carries (new values: a parameter's
    /// identity does not carry over).
    fn derived(&self) -> Arc<dyn ShardOps<B>>;
}

/// This rank's shard of a tensor: elements `shard_range(numel, world_size, rank)` of the
/// row-major flattened tensor, as a 1-D inner tensor.
///
/// The group travels with the shard (the inner device cannot tell ranks apart: Flex has a
/// single device), and so does how to gather it ([`ShardOps`]), so any op can gather it.
#[derive(Clone)]
pub struct Sharded<B: Backend> {
    /// The local elements, 1-D.
    pub shard: B::FloatTensorPrimitive,
    /// The logical shape of the whole tensor.
    pub shape: Shape,
    /// The group the tensor is sharded over.
    pub group: Arc<dyn ProcessGroup>,
    /// How it is gathered.
    pub ops: Arc<dyn ShardOps<B>>,
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

    /// The whole tensor (a collective over the group).
    pub fn gather(&self) -> Prim<B> {
        self.ops.gather(self)
    }

    /// The shard of the same layout holding `f(shard)`: new values computed from this one.
    pub fn map(self, f: impl FnOnce(Prim<B>) -> Prim<B>) -> Sharded<B> {
        let Sharded {
            shard,
            shape,
            group,
            ops,
        } = self;
        Sharded {
            shard: f(shard),
            shape,
            group,
            ops: ops.derived(),
        }
    }
}

/// Two handles on one group (sub-groups are distinct objects with distinct names).
pub fn same_group(a: &Arc<dyn ProcessGroup>, b: &Arc<dyn ProcessGroup>) -> bool {
    Arc::ptr_eq(a, b)
        || (a.name() == b.name() && a.rank() == b.rank() && a.world_size() == b.world_size())
}

/// A layout op, with the inner backend's arguments (deferred on shards).
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
    pub fn apply_shape(&self, shape: Shape) -> Shape {
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

impl<B: Backend> TensorMetadata for ShardTensor<B> {
    fn dtype(&self) -> DType {
        match self {
            ShardTensor::Local(t) => t.dtype(),
            ShardTensor::Sharded(s) => s.shard.dtype(),
            ShardTensor::Deferred(d) => d.dtype(),
        }
    }

    fn shape(&self) -> Shape {
        match self {
            ShardTensor::Local(t) => t.shape(),
            ShardTensor::Sharded(s) => s.shape.clone(),
            ShardTensor::Deferred(d) => d.shape(),
        }
    }
}

impl<B: Backend> ShardTensor<B> {
    /// Whether this is a shard (or stands for one).
    pub fn is_sharded(&self) -> bool {
        match self {
            ShardTensor::Local(_) => false,
            ShardTensor::Sharded(_) => true,
            ShardTensor::Deferred(d) => d.is_sharded(),
        }
    }

    /// Bytes this rank holds for the tensor.
    pub fn local_bytes(&self) -> usize {
        match self {
            ShardTensor::Local(t) => t.shape().num_elements() * t.dtype().size(),
            ShardTensor::Sharded(s) => s.shard.shape().num_elements() * s.shard.dtype().size(),
            ShardTensor::Deferred(d) => d.held_bytes(),
        }
    }

    /// The inner device.
    pub fn device(&self) -> B::Device {
        match self {
            ShardTensor::Local(t) => B::float_device(t),
            ShardTensor::Sharded(s) => B::float_device(&s.shard),
            ShardTensor::Deferred(d) => d.device(),
        }
    }

    /// The whole tensor as an inner tensor: a shard gathered (a collective), a deferred value
    /// formed.
    pub fn into_whole(self) -> Prim<B> {
        match self {
            ShardTensor::Local(t) => t,
            ShardTensor::Sharded(s) => s.gather(),
            ShardTensor::Deferred(d) => d.value(),
        }
    }

    /// This rank's part of a tensor split over another group ([`Deferred::part`]).
    pub fn part(&self) -> Option<Part<B>> {
        match self {
            ShardTensor::Deferred(d) => d.part(),
            _ => None,
        }
    }

    /// The deferred value as its concrete type, if it is one.
    pub fn deferred<T: Deferred<B>>(&self) -> Option<Arc<T>> {
        match self {
            ShardTensor::Deferred(d) => {
                let any: Arc<dyn Any + Send + Sync> = d.clone();
                any.downcast::<T>().ok()
            }
            _ => None,
        }
    }
}

/// Layers that want `Linear`'s weight gradients deferred (see [`WeightGrad`]): while any is
/// alive, `linear_weight_backward` returns the deferred form.
static DEFER_WEIGHT_GRADS: AtomicUsize = AtomicUsize::new(0);

/// Asks for deferred weight gradients until the guard is dropped.
#[derive(Debug)]
pub struct DeferWeightGrads(());

impl DeferWeightGrads {
    /// Starts asking.
    pub fn new() -> Self {
        DEFER_WEIGHT_GRADS.fetch_add(1, Relaxed);
        DeferWeightGrads(())
    }
}

impl Default for DeferWeightGrads {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for DeferWeightGrads {
    fn drop(&mut self) {
        DEFER_WEIGHT_GRADS.fetch_sub(1, Relaxed);
    }
}

/// Whether weight gradients are deferred now.
pub(crate) fn deferring_weight_grads() -> bool {
    DEFER_WEIGHT_GRADS.load(Relaxed) > 0
}

/// A `Linear`'s weight gradient `Σ xᵀ dy`, kept as `x` and `dy` and formed only when read: a
/// consumer that needs only thin products of them (a LoRA weight's adapters) never forms the
/// `[in, out]` matrix.
#[derive(Debug, Clone)]
pub struct WeightGrad<B: Backend> {
    /// The layer's input.
    pub x: ShardTensor<B>,
    /// The gradient of its output.
    pub dy: ShardTensor<B>,
}

impl<B: Backend> Deferred<B> for WeightGrad<B> {
    fn shape(&self) -> Shape {
        let (x, dy) = (self.x.shape(), self.dy.shape());
        Shape::new([x[x.num_dims() - 1], dy[dy.num_dims() - 1]])
    }
    fn dtype(&self) -> DType {
        self.dy.dtype()
    }
    fn device(&self) -> B::Device {
        self.dy.device()
    }
    fn value(&self) -> Prim<B> {
        B::linear_weight_backward(self.x.clone().into_whole(), self.dy.clone().into_whole())
    }
}
