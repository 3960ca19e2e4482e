//! Moving inner tensors to and from the host, for collectives on host buffers.

use super::tensor::{ShardOps, Sharded};
use burn_backend::{Backend, DType, TensorData, TensorMetadata, try_read_sync};
use burn_std::{Shape, Slice};
use kiln_comm::{ProcessGroup, shard_range};
use std::sync::Arc;

pub use kiln_comm::tensor::HostBuffer as Host;

/// Reads an inner tensor to the host.
pub fn read<B: Backend>(t: B::FloatTensorPrimitive) -> TensorData {
    try_read_sync(B::float_into_data(t))
        .expect("kiln: the inner backend cannot read tensors synchronously")
        .unwrap_or_else(|e| panic!("kiln: reading a tensor failed: {e:?}"))
}

/// Writes host data to an inner tensor of `dtype` on `device`.
pub fn write<B: Backend>(
    data: TensorData,
    device: &B::Device,
    dtype: DType,
) -> B::FloatTensorPrimitive {
    let t = B::float_from_data(data, device);
    if t.dtype() == dtype {
        t
    } else {
        B::float_cast(t, dtype.into())
    }
}

/// Panics with the rank, the operation and the shape: Burn's op signatures cannot return
/// errors, and a failed collective leaves nothing sensible to compute.
pub fn collective_failed(
    what: &str,
    shape: &Shape,
    group: &dyn ProcessGroup,
    e: impl std::fmt::Display,
) -> ! {
    panic!(
        "kiln: rank {} of group '{}' could not {what} a tensor of shape {:?}: {e}",
        group.rank(),
        group.name(),
        shape.as_slice()
    )
}

/// This rank's shard of a whole inner tensor (no communication), carrying `ops`.
pub fn slice_local<B: Backend>(
    t: B::FloatTensorPrimitive,
    group: &Arc<dyn ProcessGroup>,
    ops: Arc<dyn ShardOps<B>>,
) -> Sharded<B> {
    let shape = t.shape();
    let numel = shape.num_elements();
    let range = shard_range(numel, group.world_size(), group.rank());
    let flat = B::float_reshape(t, Shape::from(vec![numel]));
    let shard = B::float_slice(
        flat,
        &[Slice::new(
            range.start as isize,
            Some(range.end as isize),
            1,
        )],
    );
    Sharded {
        shard,
        shape,
        group: group.clone(),
        ops,
    }
}
