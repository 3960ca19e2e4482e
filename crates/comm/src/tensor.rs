//! A thin adapter from Burn tensors to [`ProcessGroup`] collectives, through host memory.
//!
//! Float tensors travel in their own precision (`f32`, `f16`, `bf16`; anything else as `f32`)
//! and come back with their dtype and device. Along dimension 0, shards follow
//! [`shard_range`] over rows; uneven row counts are padded to equal chunks on the wire (as
//! FSDP pads its flat parameters), so any row count works.
//!
//! This path copies through the host: it is for metrics, checkpoints and CPU training. Device
//! buffers on GPUs go through `NcclGroup`'s pointer collectives instead.

use crate::dtype::{BufMut, BufRef, ReduceOp};
use crate::error::{CommError, OpContext, OpKind, Result};
use crate::group::ProcessGroup;
use crate::shard::shard_range;
use burn_tensor::backend::Backend;
use burn_tensor::{DType as BurnDType, Tensor, TensorData};
use half::{bf16, f16};

/// A host copy of float tensor data in a dtype the collectives carry: `f32`, `f16` or `bf16`
/// (other float types travel as `f32`). Shared by this adapter and kiln's sharding layer.
#[derive(Debug, Clone)]
pub enum HostBuffer {
    /// f32 elements.
    F32(Vec<f32>),
    /// f16 elements.
    F16(Vec<f16>),
    /// bf16 elements.
    BF16(Vec<bf16>),
}

impl HostBuffer {
    /// The data's elements, in their own precision where the collectives carry it.
    pub fn from_data(data: TensorData) -> HostBuffer {
        let conv = "converting tensor data to its own dtype cannot fail";
        match data.dtype {
            BurnDType::F16 => HostBuffer::F16(data.into_vec().expect(conv)),
            BurnDType::BF16 => HostBuffer::BF16(data.into_vec().expect(conv)),
            BurnDType::F32 => HostBuffer::F32(data.into_vec().expect(conv)),
            _ => HostBuffer::F32(data.convert::<f32>().into_vec().expect(conv)),
        }
    }
    /// `len` zeros of the same dtype.
    pub fn zeros(&self, len: usize) -> HostBuffer {
        match self {
            HostBuffer::F32(_) => HostBuffer::F32(vec![0.0; len]),
            HostBuffer::F16(_) => HostBuffer::F16(vec![f16::ZERO; len]),
            HostBuffer::BF16(_) => HostBuffer::BF16(vec![bf16::ZERO; len]),
        }
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            HostBuffer::F32(v) => v.len(),
            HostBuffer::F16(v) => v.len(),
            HostBuffer::BF16(v) => v.len(),
        }
    }
    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The elements as a collective's input.
    pub fn buf(&self) -> BufRef<'_> {
        match self {
            HostBuffer::F32(v) => v.into(),
            HostBuffer::F16(v) => v.into(),
            HostBuffer::BF16(v) => v.into(),
        }
    }
    /// The elements as a collective's output.
    pub fn buf_mut(&mut self) -> BufMut<'_> {
        match self {
            HostBuffer::F32(v) => v.into(),
            HostBuffer::F16(v) => v.into(),
            HostBuffer::BF16(v) => v.into(),
        }
    }
    /// Truncates or pads with zeros to `len` elements.
    pub fn resize(&mut self, len: usize) {
        match self {
            HostBuffer::F32(v) => v.resize(len, 0.0),
            HostBuffer::F16(v) => v.resize(len, f16::ZERO),
            HostBuffer::BF16(v) => v.resize(len, bf16::ZERO),
        }
    }
    /// A copy of elements `start..end`.
    pub fn slice(&self, start: usize, end: usize) -> HostBuffer {
        match self {
            HostBuffer::F32(v) => HostBuffer::F32(v[start..end].to_vec()),
            HostBuffer::F16(v) => HostBuffer::F16(v[start..end].to_vec()),
            HostBuffer::BF16(v) => HostBuffer::BF16(v[start..end].to_vec()),
        }
    }
    /// Copies `src[range]` to `self[at..]`.
    ///
    /// # Panics
    /// If the dtypes differ or the ranges are out of bounds.
    pub fn copy_from(&mut self, at: usize, src: &HostBuffer, range: std::ops::Range<usize>) {
        let n = range.len();
        match (self, src) {
            (HostBuffer::F32(d), HostBuffer::F32(s)) => d[at..at + n].copy_from_slice(&s[range]),
            (HostBuffer::F16(d), HostBuffer::F16(s)) => d[at..at + n].copy_from_slice(&s[range]),
            (HostBuffer::BF16(d), HostBuffer::BF16(s)) => d[at..at + n].copy_from_slice(&s[range]),
            (d, s) => panic!(
                "host buffers of different dtypes: {} vs {}",
                d.buf_dtype(),
                s.buf_dtype()
            ),
        }
    }
    fn buf_dtype(&self) -> crate::DType {
        self.buf().dtype()
    }
    /// Appends `other`'s elements.
    ///
    /// # Panics
    /// If the dtypes differ.
    pub fn extend(&mut self, other: HostBuffer) {
        let at = self.len();
        self.resize(at + other.len());
        self.copy_from(at, &other, 0..other.len());
    }
    /// Tensor data of `shape`.
    pub fn into_data(self, shape: impl Into<burn_tensor::Shape>) -> TensorData {
        match self {
            HostBuffer::F32(v) => TensorData::new(v, shape),
            HostBuffer::F16(v) => TensorData::new(v, shape),
            HostBuffer::BF16(v) => TensorData::new(v, shape),
        }
    }
}

fn back<B: Backend, const D: usize>(
    host: HostBuffer,
    shape: Vec<usize>,
    device: &B::Device,
    dtype: BurnDType,
) -> Tensor<B, D> {
    Tensor::from_data(host.into_data(shape), (device, dtype))
}

/// All-reduces a float tensor; every rank gets the combined tensor.
///
/// # Errors
/// As [`ProcessGroup::all_reduce`].
pub fn all_reduce<B: Backend, const D: usize>(
    group: &dyn ProcessGroup,
    tensor: Tensor<B, D>,
    op: ReduceOp,
) -> Result<Tensor<B, D>> {
    let (device, dtype, shape) = (tensor.device(), tensor.dtype(), tensor.dims().to_vec());
    let mut host = HostBuffer::from_data(tensor.into_data());
    group.all_reduce(host.buf_mut(), op)?;
    Ok(back(host, shape, &device, dtype))
}

/// Broadcasts `root`'s tensor; every rank passes a tensor of the same shape and dtype.
///
/// # Errors
/// As [`ProcessGroup::broadcast`].
pub fn broadcast<B: Backend, const D: usize>(
    group: &dyn ProcessGroup,
    tensor: Tensor<B, D>,
    root: usize,
) -> Result<Tensor<B, D>> {
    let (device, dtype, shape) = (tensor.device(), tensor.dtype(), tensor.dims().to_vec());
    let mut host = HostBuffer::from_data(tensor.into_data());
    group.broadcast(host.buf_mut(), root)?;
    Ok(back(host, shape, &device, dtype))
}

/// Gathers row shards into the whole tensor of `rows` rows: this rank's `shard` holds rows
/// `shard_range(rows, world_size, rank)`.
///
/// # Errors
/// [`CommError::InvalidArgument`] if the shard's row count is not this rank's share.
pub fn all_gather_rows<B: Backend, const D: usize>(
    group: &dyn ProcessGroup,
    shard: Tensor<B, D>,
    rows: usize,
) -> Result<Tensor<B, D>> {
    let (n, r) = (group.world_size(), group.rank());
    let (device, dtype) = (shard.device(), shard.dtype());
    let mut shape = shard.dims().to_vec();
    let mine = shard_range(rows, n, r).len();
    if shape[0] != mine {
        return Err(invalid(
            group,
            OpKind::AllGather,
            format!(
                "the shard has {} rows but rank {r}'s share of {rows} rows is {mine}",
                shape[0]
            ),
        ));
    }
    let row: usize = shape[1..].iter().product();
    let padded_rows = rows.div_ceil(n);
    let mut host = HostBuffer::from_data(shard.into_data());
    host.resize(padded_rows * row);
    let mut out = host.zeros(padded_rows * row * n);
    group.all_gather(host.buf(), out.buf_mut())?;
    // Strip each rank's padding.
    let mut whole = out.zeros(0);
    for peer in 0..n {
        let take = shard_range(rows, n, peer).len() * row;
        let start = peer * padded_rows * row;
        whole.extend(out.slice(start, start + take));
    }
    shape[0] = rows;
    Ok(back(whole, shape, &device, dtype))
}

/// Combines a whole tensor across ranks and returns this rank's rows of the result
/// (`shard_range(rows, world_size, rank)`).
///
/// # Errors
/// As [`ProcessGroup::reduce_scatter`].
pub fn reduce_scatter_rows<B: Backend, const D: usize>(
    group: &dyn ProcessGroup,
    tensor: Tensor<B, D>,
    op: ReduceOp,
) -> Result<Tensor<B, D>> {
    let (n, r) = (group.world_size(), group.rank());
    let (device, dtype) = (tensor.device(), tensor.dtype());
    let mut shape = tensor.dims().to_vec();
    let rows = shape[0];
    let row: usize = shape[1..].iter().product();
    let padded_rows = rows.div_ceil(n);
    let host = HostBuffer::from_data(tensor.into_data());
    // Lay rank p's rows at p * padded_rows, so the wire chunks are equal.
    let mut padded = host.zeros(0);
    for peer in 0..n {
        let range = shard_range(rows, n, peer);
        let mut part = host.slice(range.start * row, range.end * row);
        part.resize(padded_rows * row);
        padded.extend(part);
    }
    let mut out = padded.zeros(padded_rows * row);
    group.reduce_scatter(padded.buf(), out.buf_mut(), op)?;
    let mine = shard_range(rows, n, r).len();
    out.resize(mine * row);
    shape[0] = mine;
    Ok(back(out, shape, &device, dtype))
}

fn invalid(group: &dyn ProcessGroup, kind: OpKind, message: String) -> CommError {
    CommError::InvalidArgument {
        op: OpContext {
            kind,
            seq: 0,
            group: group.name().to_string(),
            rank: group.rank(),
            world_size: group.world_size(),
        },
        message,
    }
}

/// Sends a float tensor to `dst`.
///
/// # Errors
/// As [`ProcessGroup::send`].
pub fn send<B: Backend, const D: usize>(
    group: &dyn ProcessGroup,
    tensor: Tensor<B, D>,
    dst: usize,
) -> Result<()> {
    let host = HostBuffer::from_data(tensor.into_data());
    group.send(host.buf(), dst)
}

/// Receives a float tensor from `src` into the shape, dtype and device of `like`.
///
/// # Errors
/// As [`ProcessGroup::recv`].
pub fn recv<B: Backend, const D: usize>(
    group: &dyn ProcessGroup,
    like: Tensor<B, D>,
    src: usize,
) -> Result<Tensor<B, D>> {
    let (device, dtype, shape) = (like.device(), like.dtype(), like.dims().to_vec());
    let mut host = HostBuffer::from_data(like.into_data());
    debug_assert_eq!(host.len(), shape.iter().product::<usize>());
    group.recv(host.buf_mut(), src)?;
    Ok(back(host, shape, &device, dtype))
}
