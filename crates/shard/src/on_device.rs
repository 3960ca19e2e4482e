//! The decorator's collectives on device memory (burn-cuda tensors over an NCCL group): the
//! parameter all-gather and the gradient reduction lay their buffers out with the inner
//! backend's own ops (reshape, slice, cat, zeros) and call NCCL on the tensors' device
//! pointers (`device`), so nothing is staged through the host. Any other backend or group
//! (and any case `device` declines) returns `None`: the caller takes the host path.
//!
//! Untested here (no GPU on the development machine): `scripts/gpu-check.sh` runs the
//! decorator's parity checks on CUDA + NCCL, which go through these paths.

use crate::ShardTensor;
use crate::ops::policy::collective_failed;
use crate::state::ModelState;
use crate::tensor::Sharded;
use burn_backend::{Backend, TensorMetadata};
use burn_std::{Shape, Slice};
use kiln_comm::{ProcessGroup, ReduceOp, shard_range};

fn is_nccl(group: &dyn ProcessGroup) -> bool {
    group.backend() == "nccl"
}

fn flat<B: Backend>(t: B::FloatTensorPrimitive) -> B::FloatTensorPrimitive {
    let n = t.shape().num_elements();
    B::float_reshape(t, Shape::from(vec![n]))
}

fn slice<B: Backend>(
    t: B::FloatTensorPrimitive,
    start: usize,
    end: usize,
) -> B::FloatTensorPrimitive {
    B::float_slice(t, &[Slice::new(start as isize, Some(end as isize), 1)])
}

/// `t` (1-D) followed by zeros up to `len` elements.
fn padded<B: Backend>(t: B::FloatTensorPrimitive, len: usize) -> B::FloatTensorPrimitive {
    let n = t.shape().num_elements();
    if n == len {
        return t;
    }
    let device = B::float_device(&t);
    let zeros = B::float_zeros(Shape::from(vec![len - n]), &device, t.dtype().into());
    B::float_cat(vec![t, zeros], 0)
}

/// The whole tensor of `s`, gathered on the device (unequal shards padded to the largest,
/// then the padding dropped).
pub(crate) fn gather<B: Backend>(s: &Sharded<B>) -> Option<B::FloatTensorPrimitive> {
    if !is_nccl(s.group.as_ref()) {
        return None;
    }
    let (world, numel) = (s.group.world_size(), s.numel());
    let chunk = numel.div_ceil(world);
    // In the compute dtype of the policy, widened back below.
    let shard = crate::precision::narrow::<B>(s.shard.clone(), crate::precision::gather_dtype());
    let mine = padded::<B>(flat::<B>(shard), chunk);
    let all = crate::account::waiting(|| crate::device::all_gather::<B>(s.group.as_ref(), &mine))?
        .unwrap_or_else(|e| collective_failed("all-gather", &s.shape, s.group.as_ref(), e));
    let whole = if chunk * world == numel {
        all
    } else {
        let parts = (0..world)
            .map(|r| {
                let len = shard_range(numel, world, r).len();
                slice::<B>(all.clone(), r * chunk, r * chunk + len)
            })
            .collect();
        B::float_cat(parts, 0)
    };
    let whole = crate::precision::widen::<B>(whole, s.shard.dtype());
    Some(B::float_reshape(whole, s.shape.clone()))
}

/// A bucket of whole gradients reduced on the device as the model's strategy says (see
/// `hook::reduce`): averaged whole tensors for DDP, this rank's averaged shards otherwise.
pub(crate) fn reduce<B: Backend>(
    m: &ModelState<B>,
    grads: &[(B::FloatTensorPrimitive, Shape)],
) -> Option<Vec<ShardTensor<B>>> {
    let group = m.shard_group.as_ref();
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
    if !m.config.strategy.shards_grads() {
        let cat = B::float_cat(grads.iter().map(|(g, _)| flat::<B>(g.clone())).collect(), 0);
        let sum =
            crate::account::waiting(|| crate::device::all_reduce::<B>(group, &cat, ReduceOp::Avg))?
                .unwrap_or_else(|e| fail("all-reduce", e));
        let mut at = 0;
        return Some(
            grads
                .iter()
                .zip(&numels)
                .map(|((_, shape), &n)| {
                    let g = B::float_reshape(slice::<B>(sum.clone(), at, at + n), shape.clone());
                    at += n;
                    ShardTensor::Local(g)
                })
                .collect(),
        );
    }
    // FSDP's rank-major padded layout (as `hook::RankMajor`), built on the device.
    let world = group.world_size();
    let layout = crate::hook::RankMajor::new(&numels, world);
    let mut parts = Vec::with_capacity(world * grads.len());
    for peer in 0..world {
        for (i, (g, _)) in grads.iter().enumerate() {
            let (_, range) = layout.place(i, peer);
            let width = numels[i].div_ceil(world);
            let piece = slice::<B>(flat::<B>(g.clone()), range.start, range.end);
            parts.push(padded::<B>(piece, width));
        }
    }
    let send = B::float_cat(parts, 0);
    let mut mine = crate::account::waiting(|| {
        crate::device::reduce_scatter::<B>(group, &send, ReduceOp::Avg)
    })?
    .unwrap_or_else(|e| fail("reduce-scatter", e));
    if let Some(across) = &m.replicate_group {
        // The reduce-scatter has run: from here the host path is no longer an option.
        mine = crate::account::waiting(|| {
            crate::device::all_reduce::<B>(across.as_ref(), &mine, ReduceOp::Avg)
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
                    group: m.shard_group.clone(),
                    tag: None,
                })
            })
            .collect(),
    )
}
