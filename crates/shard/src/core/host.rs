//! Moving inner tensors to and from the host, for collectives on host buffers.

use super::tensor::{ShardOps, Sharded};
use burn_backend::{Backend, DType, TensorData, TensorMetadata, try_read_sync};
use burn_std::{Shape, Slice};
use kiln_comm::{ProcessGroup, shard_range};
use std::sync::Arc;

use kiln_comm::tensor::HostBuffer;
use kiln_comm::{BufMut, BufRef};

/// Tensors of at least this many elements are read as shape-only buffers when the job runs on
/// shapes ([`scope::shapes_only`](super::scope::shapes_only)); smaller ones carry values
/// (control values: norms, counts).
pub const SHAPE_MIN: usize = 1 << 16;

/// A host copy of float tensor data for collectives ([`HostBuffer`]), or, when the job runs
/// on shapes (`kiln plan`), a buffer that exists only as a size: its bytes are counted to the
/// rank as a real buffer's would be, and collectives on it move nothing.
#[derive(Debug)]
pub enum Host {
    /// Real elements.
    Real(HostBuffer),
    /// A size only.
    Shape {
        /// The element type.
        dtype: kiln_comm::DType,
        /// Number of elements.
        len: usize,
        /// The bytes, counted.
        held: super::scope::Counted,
    },
}

impl Clone for Host {
    fn clone(&self) -> Host {
        match self {
            Host::Real(h) => Host::Real(h.clone()),
            Host::Shape { dtype, len, .. } => Host::shape(*dtype, *len),
        }
    }
}

impl Host {
    /// A shape-only buffer of `len` elements of `dtype`.
    pub fn shape(dtype: kiln_comm::DType, len: usize) -> Host {
        Host::Shape {
            dtype,
            len,
            held: super::scope::Counted::new(len * dtype.size()),
        }
    }
    /// The data's elements (see [`HostBuffer::from_data`]).
    pub fn from_data(data: TensorData) -> Host {
        Host::Real(HostBuffer::from_data(data))
    }
    /// Whether a buffer of `len` elements is shape-only: on shapes, a large one.
    fn as_shape(len: usize) -> bool {
        len >= SHAPE_MIN && super::scope::shapes_only()
    }
    /// The element type.
    pub fn dtype(&self) -> kiln_comm::DType {
        match self {
            Host::Real(h) => h.buf().dtype(),
            Host::Shape { dtype, .. } => *dtype,
        }
    }
    /// `len` zeros of the same dtype (shape-only when large, on shapes).
    pub fn zeros(&self, len: usize) -> Host {
        match self {
            Host::Real(h) if !Host::as_shape(len) => Host::Real(h.zeros(len)),
            h => Host::shape(h.dtype(), len),
        }
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Host::Real(h) => h.len(),
            Host::Shape { len, .. } => *len,
        }
    }
    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The elements as a collective's input.
    pub fn buf(&self) -> BufRef<'_> {
        match self {
            Host::Real(h) => h.buf(),
            Host::Shape { dtype, len, .. } => BufRef::Shape {
                dtype: *dtype,
                len: *len,
            },
        }
    }
    /// The elements as a collective's output.
    pub fn buf_mut(&mut self) -> BufMut<'_> {
        match self {
            Host::Real(h) => h.buf_mut(),
            Host::Shape { dtype, len, .. } => BufMut::Shape {
                dtype: *dtype,
                len: *len,
            },
        }
    }
    /// Truncates or pads with zeros to `len` elements.
    pub fn resize(&mut self, len: usize) {
        match self {
            Host::Real(h) if !Host::as_shape(len) => h.resize(len),
            h => *h = Host::shape(h.dtype(), len),
        }
    }
    /// A copy of elements `start..end`.
    pub fn slice(&self, start: usize, end: usize) -> Host {
        match self {
            Host::Real(h) => Host::Real(h.slice(start, end)),
            Host::Shape { dtype, .. } => Host::shape(*dtype, end - start),
        }
    }
    /// Copies `src[range]` to `self[at..]` (nothing moves where either is shape-only).
    ///
    /// # Panics
    /// If the dtypes differ or the ranges are out of bounds.
    pub fn copy_from(&mut self, at: usize, src: &Host, range: std::ops::Range<usize>) {
        if let (Host::Real(d), Host::Real(s)) = (self, src) {
            d.copy_from(at, s, range);
        }
    }
    /// Appends `other`'s elements.
    pub fn extend(&mut self, other: Host) {
        let len = self.len() + other.len();
        match (&mut *self, other) {
            (Host::Real(d), Host::Real(o)) if !Host::as_shape(len) => d.extend(o),
            (d, _) => *d = Host::shape(d.dtype(), len),
        }
    }
    /// Tensor data of `shape`.
    ///
    /// # Panics
    /// On a shape-only buffer: use [`write_host`].
    pub fn into_data(self, shape: impl Into<Shape>) -> TensorData {
        match self {
            Host::Real(h) => h.into_data(shape),
            Host::Shape { .. } => panic!("kiln: a shape-only buffer has no data (write_host)"),
        }
    }
}

/// Reads an inner tensor to a host buffer; on shapes, a large one is a shape-only buffer
/// (nothing is read).
pub fn read_host<B: Backend>(t: B::FloatTensorPrimitive) -> Host {
    let len = t.shape().num_elements();
    if len >= SHAPE_MIN && super::scope::shapes_only() {
        let dtype = match t.dtype() {
            DType::F16 => kiln_comm::DType::F16,
            DType::BF16 => kiln_comm::DType::BF16,
            _ => kiln_comm::DType::F32,
        };
        return Host::shape(dtype, len);
    }
    Host::from_data(read::<B>(t))
}

/// Writes a host buffer to an inner tensor of `shape` and `dtype` on `device` (a shape-only
/// buffer gives an uninitialised tensor of that shape).
pub fn write_host<B: Backend>(
    host: Host,
    shape: impl Into<Shape>,
    device: &B::Device,
    dtype: DType,
) -> B::FloatTensorPrimitive {
    match host {
        Host::Real(h) => write::<B>(h.into_data(shape), device, dtype),
        Host::Shape { .. } => B::float_empty(shape.into(), device, dtype.into()),
    }
}

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
    crate::core::dtype::widen::<B>(B::float_from_data(data, device), dtype)
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
