//! The float primitive of [`Shard`](crate::Shard): a whole tensor, or this rank's shard of one.

use burn_backend::{Backend, DType, TensorMetadata};
use burn_std::Shape;
use kiln_comm::ProcessGroup;
use std::sync::Arc;

/// A float tensor under kiln's sharding decorator.
///
/// `shape()` is always the logical (whole) shape, so modules, `num_params` and shape checks
/// see the model as written; only the bytes held differ.
#[derive(Debug, Clone)]
pub enum ShardTensor<B: Backend> {
    /// The whole tensor, held by this rank (activations, DDP parameters, anything replicated).
    Local(B::FloatTensorPrimitive),
    /// This rank's shard of a tensor laid out flat over a group.
    Sharded(Sharded<B>),
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
        }
    }

    fn shape(&self) -> Shape {
        match self {
            ShardTensor::Local(t) => t.shape(),
            ShardTensor::Sharded(s) => s.shape.clone(),
        }
    }
}

impl<B: Backend> ShardTensor<B> {
    /// Whether this is a shard.
    pub fn is_sharded(&self) -> bool {
        matches!(self, ShardTensor::Sharded(_))
    }

    /// Bytes this rank holds for the tensor.
    pub fn local_bytes(&self) -> usize {
        let (numel, dtype) = match self {
            ShardTensor::Local(t) => (t.shape().num_elements(), t.dtype()),
            ShardTensor::Sharded(s) => (s.shard.shape().num_elements(), s.shard.dtype()),
        };
        numel * dtype.size()
    }
}
