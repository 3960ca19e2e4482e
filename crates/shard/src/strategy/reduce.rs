//! A bucket of gradients reduced as a strategy says: read to the host (or kept on the device),
//! laid out for its collective, reduced, and turned back into gradients (whole for DDP, this
//! rank's shards otherwise).
//!
//! - DDP: all-reduce (average) the concatenation;
//! - ZeRO-1/2/3: reduce-scatter (average) so that each rank receives the shard of every gradient
//!   it owns. Each gradient's shards are padded to equal length and laid out rank-major
//!   ([`RankMajor`]), so one reduce-scatter of equal chunks serves a bucket of unevenly divisible
//!   tensors (FSDP's flat parameter padding);
//! - hybrid: reduce-scatter within the sharding group, then all-reduce the shards across groups.

use super::config::Strategy;
use crate::core::dtype::narrow;
#[cfg(feature = "cuda")]
use crate::core::dtype::widen;
use crate::core::host::{Host, read_host, slice_local, write_host};
use crate::core::ops::local;
#[cfg(feature = "cuda")]
use crate::core::ops::unary;
use crate::core::scope::{self, waiting};
use crate::core::tensor::{Restore, ShardTensor, Sharded};
use crate::features::zero::flat;
use burn_backend::{Backend, TensorMetadata};
use burn_std::Shape;
use kiln_comm::{ProcessGroup, ReduceOp, Work, shard_range};
use std::sync::Arc;

/// Who reduces a model's gradients, and how: its strategy and groups.
#[derive(Clone, Copy)]
pub(crate) struct Reduction<'a> {
    /// The strategy.
    pub strategy: Strategy,
    /// The group gradients are reduced (or reduce-scattered) over.
    pub shard: &'a Arc<dyn ProcessGroup>,
    /// Hybrid: the group the shards are then all-reduced over.
    pub across: Option<&'a Arc<dyn ProcessGroup>>,
}

/// What of a gradient is reduced: under tensor parallelism its part, reduced as the tensor
/// over the data-parallel group (never formed whole), with what makes the gradient of the
/// reduced part ([`restored`]); else the gradient itself. The gradient-sync hook and the
/// reduction after backward both go through here.
pub(crate) fn to_reduce<B: Backend>(g: &ShardTensor<B>) -> (ShardTensor<B>, Option<Restore<B>>) {
    match g.part() {
        Some(part) => (part.local, Some(part.rewrap)),
        None => (g.clone(), None),
    }
}

/// The gradient a reduced tensor is: the split tensor again when [`to_reduce`] reduced a part.
pub(crate) fn restored<B: Backend>(
    reduced: ShardTensor<B>,
    rewrap: Option<&Restore<B>>,
) -> ShardTensor<B> {
    match rewrap {
        Some(rewrap) => rewrap(reduced),
        None => reduced,
    }
}

/// A gradient handed over by the hook, waiting in the bucket.
pub(crate) struct PendingGrad<B: Backend> {
    /// Points into burn-autodiff's gradient container, whose boxed entries stay put (and are
    /// not removed) until backward returns; the bucket is always flushed before that, at the
    /// latest in `submit_sync_collective`.
    pub ptr: *mut ShardTensor<B>,
    /// The shape reduced: the gradient's, or its part's under tensor parallelism.
    pub shape: Shape,
    /// Under tensor parallelism: the part is reduced, and this makes the gradient again.
    pub rewrap: Option<Restore<B>>,
}

// SAFETY: a pending gradient is created and consumed by the one thread running a backward pass
// (burn-autodiff calls the hook on it); the state that holds it is behind a mutex only so that
// the model can move between threads *between* backward passes.
unsafe impl<B: Backend> Send for PendingGrad<B> {}

/// A bucket handed to the model's communication queue: written back into the gradient
/// container when backward ends (the pointers stay valid until then, see `PendingGrad`).
pub(crate) struct InFlight<B: Backend> {
    pub bucket: Vec<PendingGrad<B>>,
    pub layout: Layout<B>,
    pub work: Work<Host>,
}

/// Reduces whole gradients (in their order, identical on every rank) as the model's strategy
/// says: averaged whole tensors for DDP, this rank's averaged shards otherwise. Blocking.
pub(crate) fn reduce<B: Backend>(
    r: Reduction<'_>,
    grads: Vec<(ShardTensor<B>, Shape)>,
) -> Vec<ShardTensor<B>> {
    complete(r, prepare(r, grads, true))
}

/// A prepared bucket's results, communicating on this thread if needed.
pub(crate) fn complete<B: Backend>(r: Reduction<'_>, prepared: Prepared<B>) -> Vec<ShardTensor<B>> {
    match prepared {
        Prepared::Done(reduced) => reduced,
        Prepared::Send(layout, send) => {
            let out = waiting(|| communicate(r.shard.as_ref(), r.across.map(|a| a.as_ref()), send));
            finish(r, &layout, out)
        }
    }
}

/// A bucket read to the host and laid out for its collective.
pub(crate) enum Prepared<B: Backend> {
    /// Nothing to communicate (one rank): the results.
    Done(Vec<ShardTensor<B>>),
    /// The buffer to reduce, and how to read the result.
    Send(Layout<B>, Outgoing),
}

/// What the compute thread needs to turn a reduced buffer back into gradients.
pub(crate) struct Layout<B: Backend> {
    shapes: Vec<Shape>,
    device: B::Device,
    dtype: burn_backend::DType,
    /// `None`: DDP's all-reduced concatenation; else the rank-major shards.
    rank_major: Option<RankMajor>,
}

/// The buffer a bucket's collective sends, and which collective.
pub(crate) enum Outgoing {
    /// All-reduce (average) the concatenation.
    AllReduce(Host),
    /// Reduce-scatter (average) the rank-major layout (then all-reduce across replicas).
    ReduceScatter { send: Host, chunk: usize },
}

pub(crate) fn prepare<B: Backend>(
    r: Reduction<'_>,
    grads: Vec<(ShardTensor<B>, Shape)>,
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))] on_this_thread: bool,
) -> Prepared<B> {
    let group = r.shard;
    let strategy = r.strategy;
    if group.world_size() == 1 && r.across.is_none() {
        // Nothing to reduce: the gradients are already whole and final; a ZeRO strategy's
        // "shard" of a one-rank group is the whole tensor, so only the layout changes.
        return Prepared::Done(
            grads
                .into_iter()
                .map(|(g, _)| {
                    let whole = local(g);
                    if strategy.shards_optimizer() {
                        ShardTensor::Sharded(slice_local::<B>(whole, group, flat()))
                    } else {
                        ShardTensor::Local(whole)
                    }
                })
                .collect(),
        );
    }
    let shapes: Vec<Shape> = grads.iter().map(|(_, s)| s.clone()).collect();
    let inner: Vec<B::FloatTensorPrimitive> = grads.into_iter().map(|(g, _)| local(g)).collect();
    // Reduced in the policy's reduce dtype, handed back in the gradients' own.
    let dtype = inner[0].dtype();
    let reduce = scope::precision().reduce;
    let inner: Vec<B::FloatTensorPrimitive> =
        inner.into_iter().map(|g| narrow::<B>(g, reduce)).collect();
    #[cfg(feature = "cuda")]
    if on_this_thread {
        let on_device: Vec<_> = inner.iter().cloned().zip(shapes.iter().cloned()).collect();
        if let Some(done) = on_device::reduce(r, &on_device) {
            return Prepared::Done(
                done.into_iter()
                    .map(|t| unary(t, move |g| widen::<B>(g, dtype)))
                    .collect(),
            );
        }
    }
    let device = B::float_device(&inner[0]);
    let hosts: Vec<Host> = inner.into_iter().map(|g| read_host::<B>(g)).collect();
    if !strategy.shards_grads() {
        let layout = Layout {
            shapes,
            device,
            dtype,
            rank_major: None,
        };
        return Prepared::Send(layout, Outgoing::AllReduce(cat(&hosts)));
    }
    // Reduce-scatter: rank-major layout, each gradient's shards padded to ceil(n / S).
    let numels: Vec<usize> = shapes.iter().map(Shape::num_elements).collect();
    let rank_major = RankMajor::new(&numels, group.world_size());
    let mut send = hosts[0].zeros(rank_major.len());
    for peer in 0..group.world_size() {
        for (i, h) in hosts.iter().enumerate() {
            let (at, range) = rank_major.place(i, peer);
            send.copy_from(at, h, range);
        }
    }
    let chunk = rank_major.chunk;
    let layout = Layout {
        shapes,
        device,
        dtype,
        rank_major: Some(rank_major),
    };
    Prepared::Send(layout, Outgoing::ReduceScatter { send, chunk })
}

/// Runs a bucket's collective(s) on `group` (the model's shard group, or its queue's
/// sub-group), then across replicas: the reduced buffer.
pub(crate) fn communicate(
    group: &dyn ProcessGroup,
    across: Option<&dyn ProcessGroup>,
    send: Outgoing,
) -> kiln_comm::Result<Host> {
    match send {
        Outgoing::AllReduce(mut flat) => {
            group.all_reduce(flat.buf_mut(), ReduceOp::Avg)?;
            Ok(flat)
        }
        Outgoing::ReduceScatter { send, chunk } => {
            let mut mine = send.zeros(chunk);
            group.reduce_scatter(send.buf(), mine.buf_mut(), ReduceOp::Avg)?;
            drop(send);
            if let Some(across) = across {
                across.all_reduce(mine.buf_mut(), ReduceOp::Avg)?;
            }
            Ok(mine)
        }
    }
}

/// The reduced gradients (whole, or this rank's shards) from a bucket's reduced buffer.
pub(crate) fn finish<B: Backend>(
    r: Reduction<'_>,
    layout: &Layout<B>,
    out: kiln_comm::Result<Host>,
) -> Vec<ShardTensor<B>> {
    let group = r.shard;
    let out = out.unwrap_or_else(|e| {
        panic!(
            "kiln: rank {} could not reduce a bucket of {} gradients on group '{}': {e}",
            group.rank(),
            layout.shapes.len(),
            group.name()
        )
    });
    let (device, dtype) = (&layout.device, layout.dtype);
    let Some(rank_major) = &layout.rank_major else {
        let mut offset = 0;
        return layout
            .shapes
            .iter()
            .map(|shape| {
                let n = shape.num_elements();
                let part = out.slice(offset, offset + n);
                offset += n;
                ShardTensor::Local(write_host::<B>(part, shape.clone(), device, dtype))
            })
            .collect();
    };
    let rank = group.rank();
    layout
        .shapes
        .iter()
        .enumerate()
        .map(|(i, shape)| {
            let (at, range) = rank_major.place(i, rank);
            let at = at - rank * rank_major.chunk;
            let shard = write_host::<B>(
                out.slice(at, at + range.len()),
                Shape::from(vec![range.len()]),
                device,
                dtype,
            );
            ShardTensor::Sharded(Sharded {
                shard,
                shape: shape.clone(),
                group: group.clone(),
                ops: flat(),
            })
        })
        .collect()
}

/// FSDP's flat layout of a bucket of tensors over `world` ranks: rank `r`'s chunk holds its
/// shard of every tensor, in order, each padded to `ceil(numel / world)`, so that one
/// reduce-scatter or all-gather of equal chunks serves tensors of any size.
pub(crate) struct RankMajor {
    numels: Vec<usize>,
    /// Where each tensor's shard starts within a chunk.
    starts: Vec<usize>,
    /// Elements per rank.
    pub chunk: usize,
    world: usize,
}

impl RankMajor {
    pub fn new(numels: &[usize], world: usize) -> Self {
        let mut starts = Vec::with_capacity(numels.len());
        let mut chunk = 0;
        for n in numels {
            starts.push(chunk);
            chunk += n.div_ceil(world);
        }
        RankMajor {
            numels: numels.to_vec(),
            starts,
            chunk,
            world,
        }
    }

    /// Elements of the whole buffer.
    pub fn len(&self) -> usize {
        self.chunk * self.world
    }

    /// Where `peer`'s shard of tensor `i` lies in the whole buffer, and which elements of the
    /// flattened tensor it holds.
    pub fn place(&self, i: usize, peer: usize) -> (usize, std::ops::Range<usize>) {
        (
            peer * self.chunk + self.starts[i],
            shard_range(self.numels[i], self.world, peer),
        )
    }
}

pub(crate) fn cat(parts: &[Host]) -> Host {
    let total = parts.iter().map(Host::len).sum();
    let mut out = parts[0].zeros(total);
    let mut offset = 0;
    for p in parts {
        out.copy_from(offset, p, 0..p.len());
        offset += p.len();
    }
    out
}

/// The gradient reduction on device memory (burn-cuda tensors over an NCCL group): the bucket's
/// buffers laid out with the inner backend's own ops and reduced by NCCL on the tensors' device
/// pointers, nothing staged through the host. Any other backend or group returns `None`: the
/// caller takes the host path.
///
/// Untested here (no GPU on the development machine): `scripts/gpu-check.sh` runs the
/// decorator's parity checks on CUDA + NCCL, which go through these paths.
#[cfg(feature = "cuda")]
mod on_device {
    use crate::core::scope::waiting;
    use crate::core::tensor::{ShardTensor, Sharded};
    use crate::features::zero::flat;
    use crate::features::zero::on_device::{flat as flat1, is_nccl, padded, slice};
    use crate::strategy::reduce::{RankMajor, Reduction};
    use burn_backend::Backend;
    use burn_std::Shape;
    use kiln_comm::ReduceOp;

    /// A bucket of whole gradients reduced on the device as the model's strategy says (see
    /// `hook::reduce`): averaged whole tensors for DDP, this rank's averaged shards otherwise.
    pub(super) fn reduce<B: Backend>(
        r: Reduction<'_>,
        grads: &[(B::FloatTensorPrimitive, Shape)],
    ) -> Option<Vec<ShardTensor<B>>> {
        let group = r.shard.as_ref();
        if !is_nccl(group) || grads.is_empty() {
            return None;
        }
        let fail = |what: &str, e: kiln_comm::CommError| -> ! {
            panic!(
                "kiln: rank {} could not {what} a bucket of {} gradients on group '{}': {e}",
                group.rank(),
                grads.len(),
                group.name()
            )
        };
        let numels: Vec<usize> = grads.iter().map(|(_, s)| s.num_elements()).collect();
        if !r.strategy.shards_grads() {
            let cat = B::float_cat(
                grads.iter().map(|(g, _)| flat1::<B>(g.clone())).collect(),
                0,
            );
            let sum = waiting(|| crate::core::device::all_reduce::<B>(group, &cat, ReduceOp::Avg))?
                .unwrap_or_else(|e| fail("all-reduce", e));
            let mut at = 0;
            return Some(
                grads
                    .iter()
                    .zip(&numels)
                    .map(|((_, shape), &n)| {
                        let g =
                            B::float_reshape(slice::<B>(sum.clone(), at, at + n), shape.clone());
                        at += n;
                        ShardTensor::Local(g)
                    })
                    .collect(),
            );
        }
        // FSDP's rank-major padded layout (as `hook::RankMajor`), built on the device.
        let world = group.world_size();
        let layout = RankMajor::new(&numels, world);
        let mut parts = Vec::with_capacity(world * grads.len());
        for peer in 0..world {
            for (i, (g, _)) in grads.iter().enumerate() {
                let (_, range) = layout.place(i, peer);
                let width = numels[i].div_ceil(world);
                let piece = slice::<B>(flat1::<B>(g.clone()), range.start, range.end);
                parts.push(padded::<B>(piece, width));
            }
        }
        let send = B::float_cat(parts, 0);
        let mut mine =
            waiting(|| crate::core::device::reduce_scatter::<B>(group, &send, ReduceOp::Avg))?
                .unwrap_or_else(|e| fail("reduce-scatter", e));
        if let Some(across) = r.across {
            // The reduce-scatter has run: from here the host path is no longer an option.
            mine = waiting(|| {
                crate::core::device::all_reduce::<B>(across.as_ref(), &mine, ReduceOp::Avg)
            })
            .unwrap_or_else(|| {
                panic!(
                    "kiln: group '{}' is not an NCCL group of CUDA tensors like '{}'",
                    across.name(),
                    group.name()
                )
            })
            .unwrap_or_else(|e| fail("all-reduce (across replicas)", e));
        }
        let rank = group.rank();
        Some(
            grads
                .iter()
                .enumerate()
                .map(|(i, (_, shape))| {
                    let (at, range) = layout.place(i, rank);
                    let at = at - rank * layout.chunk;
                    ShardTensor::Sharded(Sharded {
                        shard: slice::<B>(mine.clone(), at, at + range.len()),
                        shape: shape.clone(),
                        group: r.shard.clone(),
                        ops: flat(),
                    })
                })
                .collect(),
        )
    }
}
