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

/// Host copy of a float tensor in a wire dtype.
enum Host {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
}

impl Host {
    fn of(data: TensorData) -> Host {
        let conv = "converting tensor data to its own dtype cannot fail";
        match data.dtype {
            BurnDType::F16 => Host::F16(data.into_vec().expect(conv)),
            BurnDType::BF16 => Host::BF16(data.into_vec().expect(conv)),
            BurnDType::F32 => Host::F32(data.into_vec().expect(conv)),
            _ => Host::F32(data.convert::<f32>().into_vec().expect(conv)),
        }
    }
    fn zeros_like(&self, len: usize) -> Host {
        match self {
            Host::F32(_) => Host::F32(vec![0.0; len]),
            Host::F16(_) => Host::F16(vec![f16::ZERO; len]),
            Host::BF16(_) => Host::BF16(vec![bf16::ZERO; len]),
        }
    }
    fn len(&self) -> usize {
        match self {
            Host::F32(v) => v.len(),
            Host::F16(v) => v.len(),
            Host::BF16(v) => v.len(),
        }
    }
    fn buf(&self) -> BufRef<'_> {
        match self {
            Host::F32(v) => v.into(),
            Host::F16(v) => v.into(),
            Host::BF16(v) => v.into(),
        }
    }
    fn buf_mut(&mut self) -> BufMut<'_> {
        match self {
            Host::F32(v) => v.into(),
            Host::F16(v) => v.into(),
            Host::BF16(v) => v.into(),
        }
    }
    fn resize(&mut self, len: usize) {
        match self {
            Host::F32(v) => v.resize(len, 0.0),
            Host::F16(v) => v.resize(len, f16::ZERO),
            Host::BF16(v) => v.resize(len, bf16::ZERO),
        }
    }
    fn slice(&self, start: usize, end: usize) -> Host {
        match self {
            Host::F32(v) => Host::F32(v[start..end].to_vec()),
            Host::F16(v) => Host::F16(v[start..end].to_vec()),
            Host::BF16(v) => Host::BF16(v[start..end].to_vec()),
        }
    }
    fn into_data(self, shape: Vec<usize>) -> TensorData {
        match self {
            Host::F32(v) => TensorData::new(v, shape),
            Host::F16(v) => TensorData::new(v, shape),
            Host::BF16(v) => TensorData::new(v, shape),
        }
    }
}

fn back<B: Backend, const D: usize>(
    host: Host,
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
    let mut host = Host::of(tensor.into_data());
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
    let mut host = Host::of(tensor.into_data());
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
    let mut host = Host::of(shard.into_data());
    host.resize(padded_rows * row);
    let mut out = host.zeros_like(padded_rows * row * n);
    group.all_gather(host.buf(), out.buf_mut())?;
    // Strip each rank's padding.
    let mut whole = out.zeros_like(0);
    for peer in 0..n {
        let take = shard_range(rows, n, peer).len() * row;
        let start = peer * padded_rows * row;
        append(&mut whole, out.slice(start, start + take));
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
    let host = Host::of(tensor.into_data());
    // Lay rank p's rows at p * padded_rows, so the wire chunks are equal.
    let mut padded = host.zeros_like(0);
    for peer in 0..n {
        let range = shard_range(rows, n, peer);
        let mut part = host.slice(range.start * row, range.end * row);
        part.resize(padded_rows * row);
        append(&mut padded, part);
    }
    let mut out = padded.zeros_like(padded_rows * row);
    group.reduce_scatter(padded.buf(), out.buf_mut(), op)?;
    let mine = shard_range(rows, n, r).len();
    out.resize(mine * row);
    shape[0] = mine;
    Ok(back(out, shape, &device, dtype))
}

fn append(acc: &mut Host, part: Host) {
    match (acc, part) {
        (Host::F32(a), Host::F32(b)) => a.extend(b),
        (Host::F16(a), Host::F16(b)) => a.extend(b),
        (Host::BF16(a), Host::BF16(b)) => a.extend(b),
        _ => unreachable!("parts of one tensor share its dtype"),
    }
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
    let host = Host::of(tensor.into_data());
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
    let mut host = Host::of(like.into_data());
    debug_assert_eq!(host.len(), shape.iter().product::<usize>());
    group.recv(host.buf_mut(), src)?;
    Ok(back(host, shape, &device, dtype))
}
