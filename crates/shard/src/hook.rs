//! Gradient reduction during backward, through burn-autodiff's `distributed` hook.
//!
//! burn-autodiff calls `submit_gradient_sync` on the backend directly under `Autodiff` the
//! moment a marked parameter's gradient is final, in the same (graph-determined) order on every
//! rank, and `submit_sync_collective` when backward ends. Gradients are collected into a bucket
//! and reduced together once it holds `bucket_bytes`:
//! - DDP: all-reduce (average) the concatenation;
//! - ZeRO-1/2/3: reduce-scatter (average) so that each rank receives the shard of every gradient
//!   it owns. Each gradient's shards are padded to equal length and laid out rank-major, so one
//!   reduce-scatter of equal chunks serves a bucket of unevenly divisible tensors (FSDP's flat
//!   parameter padding). ZeRO-1 flushes once, when backward ends (whole gradients coexist until
//!   then, as ZeRO-1 defines); ZeRO-2/3 flush whenever a bucket is full;
//! - hybrid: reduce-scatter within the sharding group, then all-reduce the shards across groups.

use crate::ops::policy::{Host, local, read, slice_local, write};
use crate::state::{PendingGrad, RankState, with_state};
use crate::tensor::Sharded;
use crate::{Shard, ShardTensor};
use burn_backend::distributed::{DistributedBackend, DistributedParams, TensorRef};
use burn_backend::{Backend, TensorMetadata};
use burn_std::Shape;
use kiln_comm::{ReduceOp, shard_len, shard_range};

impl<B: Backend> DistributedBackend for Shard<B> {
    fn register_sync_parameters(_device: &Self::Device, _params: Vec<DistributedParams>) {
        // The order comes from the graph traversal, identical on every rank; nothing to fix here.
        with_state::<B, _>(|s| {
            assert!(
                s.bucket.is_empty(),
                "kiln: a backward pass started before the previous one synchronised its gradients"
            );
        });
    }

    fn submit_gradient_sync(tensor: TensorRef<Self>, params: DistributedParams) {
        with_state::<B, _>(|s| {
            let shape = s.params.get(&params.param_id).cloned().unwrap_or_else(|| {
                panic!(
                    "kiln: gradient of parameter {:?}, which `shard` did not register",
                    params.param_id
                )
            });
            // SAFETY: `tensor.0` points to the gradient in burn-autodiff's container, valid for
            // the rest of this backward (see `PendingGrad`).
            let grad = unsafe { &*tensor.0 };
            assert_eq!(
                grad.shape(),
                shape,
                "kiln: gradient shape differs from its parameter's"
            );
            s.bucket_bytes += grad.local_bytes();
            s.synced.insert(params.param_id);
            s.bucket.push(PendingGrad {
                ptr: tensor.0,
                shape,
            });
            if s.config.strategy.reduces_during_backward()
                && s.bucket_bytes >= s.config.bucket_bytes
            {
                flush(s);
            }
        });
    }

    fn submit_sync_collective(_device: &Self::Device) {
        with_state::<B, _>(flush);
    }
}

/// Reduces the bucket and writes the results back into the gradient container.
fn flush<B: Backend>(s: &mut RankState<B>) {
    let bucket = std::mem::take(&mut s.bucket);
    s.bucket_bytes = 0;
    if bucket.is_empty() {
        return;
    }
    if s.shard_group.world_size() == 1 && s.replicate_group.is_none() {
        // Nothing to reduce: the gradients are already whole and final; a ZeRO strategy's
        // "shard" of a one-rank group is the whole tensor, so only the layout changes.
        if s.config.strategy.shards_optimizer() {
            for p in &bucket {
                // SAFETY: see `PendingGrad`.
                unsafe {
                    let whole = local((*p.ptr).clone());
                    *p.ptr = ShardTensor::Sharded(slice_local::<B>(whole, &s.shard_group));
                }
            }
        }
        return;
    }
    // SAFETY: see `PendingGrad`: each pointer is valid and not aliased while we hold it.
    let grads: Vec<B::FloatTensorPrimitive> = bucket
        .iter()
        .map(|p| local(unsafe { (*p.ptr).clone() }))
        .collect();
    let device = B::float_device(&grads[0]);
    let dtype = grads[0].dtype();
    let hosts: Vec<Host> = grads
        .into_iter()
        .map(|g| Host::from_data(read::<B>(g)))
        .collect();
    let strategy = s.config.strategy;
    let group = s.shard_group.clone();
    let fail = |what: &str, e: kiln_comm::CommError| -> ! {
        panic!(
            "kiln: rank {} could not {what} a bucket of {} gradients on group '{}': {e}",
            group.rank(),
            bucket.len(),
            group.name()
        )
    };

    if !strategy.shards_grads() {
        // All-reduce the concatenation.
        let mut flat = cat(&hosts);
        group
            .all_reduce(flat.buf_mut(), ReduceOp::Avg)
            .unwrap_or_else(|e| fail("all-reduce", e));
        let mut offset = 0;
        for p in &bucket {
            let n = p.shape.num_elements();
            let data = flat.slice(offset, offset + n).into_data(p.shape.clone());
            offset += n;
            // SAFETY: see `PendingGrad`.
            unsafe { *p.ptr = ShardTensor::Local(write::<B>(data, &device, dtype)) };
        }
        return;
    }

    // Reduce-scatter: rank-major layout, each gradient's shards padded to ceil(n / S).
    let (world, rank) = (group.world_size(), group.rank());
    let padded: Vec<usize> = bucket
        .iter()
        .map(|p| p.shape.num_elements().div_ceil(world))
        .collect();
    let chunk: usize = padded.iter().sum();
    let mut send = hosts[0].zeros(chunk * world);
    for peer in 0..world {
        let mut offset = peer * chunk;
        for (h, (p, pad)) in hosts.iter().zip(bucket.iter().zip(&padded)) {
            let range = shard_range(p.shape.num_elements(), world, peer);
            send.copy_from(offset, h, range);
            offset += pad;
        }
    }
    let mut mine = send.zeros(chunk);
    group
        .reduce_scatter(send.buf(), mine.buf_mut(), ReduceOp::Avg)
        .unwrap_or_else(|e| fail("reduce-scatter", e));
    if let Some(across) = &s.replicate_group {
        across
            .all_reduce(mine.buf_mut(), ReduceOp::Avg)
            .unwrap_or_else(|e| fail("all-reduce (across replicas)", e));
    }
    let mut offset = 0;
    for (p, pad) in bucket.iter().zip(&padded) {
        let len = shard_len(p.shape.num_elements(), world, rank);
        let shard = write::<B>(
            mine.slice(offset, offset + len)
                .into_data(Shape::from(vec![len])),
            &device,
            dtype,
        );
        offset += pad;
        // SAFETY: see `PendingGrad`.
        unsafe {
            *p.ptr = ShardTensor::Sharded(Sharded {
                shard,
                shape: p.shape.clone(),
                group: group.clone(),
            })
        };
    }
}

fn cat(parts: &[Host]) -> Host {
    let total = parts.iter().map(Host::len).sum();
    let mut out = parts[0].zeros(total);
    let mut offset = 0;
    for p in parts {
        out.copy_from(offset, p, 0..p.len());
        offset += p.len();
    }
    out
}
