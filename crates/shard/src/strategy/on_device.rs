//! The gradient reduction on device memory (burn-cuda tensors over an NCCL group): the bucket's
//! buffers laid out with the inner backend's own ops and reduced by NCCL on the tensors' device
//! pointers, nothing staged through the host. Any other backend or group returns `None`: the
//! caller takes the host path.
//!
//! Untested here (no GPU on the development machine): `scripts/gpu-check.sh` runs the
//! decorator's parity checks on CUDA + NCCL, which go through these paths.

use super::state::ModelState;
use crate::core::scope::waiting;
use crate::core::tensor::{ShardTensor, Sharded};
use crate::features::zero::flat;
use crate::features::zero::on_device::{flat as flat1, is_nccl, padded, slice};
use burn_backend::Backend;
use burn_std::Shape;
use kiln_comm::ReduceOp;

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
                    let g = B::float_reshape(slice::<B>(sum.clone(), at, at + n), shape.clone());
                    at += n;
                    ShardTensor::Local(g)
                })
                .collect(),
        );
    }
    // FSDP's rank-major padded layout (as `hook::RankMajor`), built on the device.
    let world = group.world_size();
    let layout = super::hook::RankMajor::new(&numels, world);
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
    if let Some(across) = &m.replicate_group {
        // The reduce-scatter has run: from here the host path is no longer an option.
        mine =
            waiting(|| crate::core::device::all_reduce::<B>(across.as_ref(), &mine, ReduceOp::Avg))
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
                    ops: flat(),
                })
            })
            .collect(),
    )
}
