//! Gradient reduction during backward, through burn-autodiff's `distributed` hook.
//!
//! burn-autodiff calls `submit_gradient_sync` on the backend directly under `Autodiff` the
//! moment a marked parameter's gradient is final, in the same (graph-determined) order on every
//! rank, and `submit_sync_collective` when backward ends. The parameter's gradient-sync id,
//! which `shard` made unique to its model, leads to that model's state; gradients are collected
//! into the model's bucket and reduced together (`reduce.rs`) once it holds `bucket_bytes`:
//! ZeRO-1 flushes once, when backward ends (whole gradients coexist until then, as ZeRO-1
//! defines); DDP and ZeRO-2/3 flush whenever a bucket is full.
//!
//! Inside [`no_sync`](crate::no_sync) the hook leaves gradients whole and unreduced.

use super::reduce::{
    InFlight, PendingGrad, Prepared, communicate, complete, finish, prepare, restored, to_reduce,
};
use super::state::{AnyModel, ModelState, model_of};
use crate::core::backend::Shard;
use crate::core::dtype::widen;
use crate::core::ops::unary;
use crate::core::scope::{self, MemKind, on_queue, waiting, with_kind};
use crate::core::tensor::ShardTensor;
use burn_backend::distributed::{
    DistributedBackend, DistributedParamId, DistributedParams, TensorRef,
};
use burn_backend::{Backend, TensorMetadata};
use std::sync::Arc;

/// The model of a parameter whose gradient the hook sees, and the parameter's id in it.
fn model<B: Backend>(params: &DistributedParams) -> (Arc<ModelState<B>>, DistributedParamId) {
    model_of::<B>(params.param_id).unwrap_or_else(|| {
        panic!(
            "kiln: a gradient of parameter {:?}, which no sharded model on this rank registered \
             (a model released with `kiln_shard::release`, or ranks as threads holding models \
             with the same parameter ids stepped by a plain Burn optimizer on a thread that is \
             not the rank's: step sharded models with `kiln_shard::ShardedOptimizer`)",
            params.param_id
        )
    })
}

impl<B: Backend> DistributedBackend for Shard<B> {
    fn register_sync_parameters(_device: &Self::Device, params: Vec<DistributedParams>) {
        let mut models: Vec<(u64, AnyModel)> = Vec::new();
        for p in &params {
            let (m, _) = model::<B>(p);
            if !models.iter().any(|(seq, _)| *seq == m.seq) {
                let d = m.lock();
                assert!(
                    d.bucket.is_empty() && d.in_flight.is_empty(),
                    "kiln: a backward pass started before the previous one synchronised its \
                     gradients"
                );
                drop(d);
                models.push((m.seq, m as AnyModel));
            }
        }
        // The order of `params` comes from a hash map; creation order is the same on every rank.
        models.sort_by_key(|(seq, _)| *seq);
        // The models whose parameters take part in the backward pass running on this thread,
        // in creation order: flushed, in that order, when it ends.
        scope::set_backward(models);
    }

    fn submit_gradient_sync(tensor: TensorRef<Self>, params: DistributedParams) {
        let (m, id) = model::<B>(&params);
        let mut d = m.lock();
        let (shape, dtype) = d.params.get(&id).cloned().unwrap_or_else(|| {
            panic!("kiln: gradient of parameter {id:?}, which `shard` did not register")
        });
        // SAFETY: `tensor.0` points to the gradient in burn-autodiff's container, valid for
        // the rest of this backward (see `PendingGrad`).
        let grad = unsafe { &mut *tensor.0 };
        // Under a compute dtype the last op of a parameter's gradient (a linear's weight
        // gradient) leaves it in that dtype: it is widened to the parameter's, so that it is
        // reduced, accumulated and stepped in f32 (autocast's cast back to the master's dtype).
        if grad.dtype() != dtype {
            *grad = unary(grad.clone(), move |g| widen::<B>(g, dtype));
        }
        if d.no_sync {
            return;
        }
        assert_eq!(
            grad.shape(),
            shape,
            "kiln: gradient shape differs from its parameter's"
        );
        d.bucket_bytes += grad.local_bytes();
        d.synced.insert(id);
        let (reduced, rewrap) = to_reduce(grad);
        d.bucket.push(PendingGrad {
            ptr: tensor.0,
            shape: reduced.shape(),
            rewrap,
        });
        if m.config.strategy.reduces_during_backward() && d.bucket_bytes >= m.config.bucket_bytes {
            let bucket = std::mem::take(&mut d.bucket);
            d.bucket_bytes = 0;
            drop(d);
            flush(&m, bucket);
        }
    }

    fn submit_sync_collective(_device: &Self::Device) {
        let models = scope::take_backward();
        for (_, m) in models {
            let m = m
                .downcast::<ModelState<B>>()
                .expect("registered by this backend's hook");
            let bucket = {
                let mut d = m.lock();
                d.bucket_bytes = 0;
                std::mem::take(&mut d.bucket)
            };
            flush(&m, bucket);
            land(&m);
        }
    }
}

/// Reduces a bucket: on the model's communication queue when it has one (backward goes on;
/// the results are written back when it ends), else now.
fn flush<B: Backend>(m: &ModelState<B>, bucket: Vec<PendingGrad<B>>) {
    if bucket.is_empty() {
        return;
    }
    // SAFETY: see `PendingGrad`: each pointer is valid and not aliased while we hold it.
    let grads = bucket
        .iter()
        .map(|p| {
            let (g, _) = to_reduce(unsafe { &*p.ptr });
            (g, p.shape.clone())
        })
        .collect();
    let r = m.reduction();
    with_kind(MemKind::Comm, || {
        match (prepare(r, grads, m.queue.is_none()), &m.queue) {
            (Prepared::Send(layout, send), Some(queue)) => {
                let across = m.replicate_group.clone();
                let work = on_queue(queue, "gradient reduction", move |g| {
                    with_kind(MemKind::Comm, || communicate(g, across.as_deref(), send))
                });
                m.lock().in_flight.push(InFlight {
                    bucket,
                    layout,
                    work,
                });
            }
            (prepared, _) => put_back(&bucket, complete(r, prepared)),
        }
    });
}

/// Waits for the model's buckets in flight, in order, and writes their results back.
fn land<B: Backend>(m: &ModelState<B>) {
    let in_flight = std::mem::take(&mut m.lock().in_flight);
    for f in in_flight {
        let out = waiting(|| f.work.wait());
        let reduced = with_kind(MemKind::Comm, || finish(m.reduction(), &f.layout, out));
        put_back(&f.bucket, reduced);
    }
}

fn put_back<B: Backend>(bucket: &[PendingGrad<B>], reduced: Vec<ShardTensor<B>>) {
    for (p, reduced) in bucket.iter().zip(reduced) {
        // SAFETY: as in `flush`.
        unsafe { *p.ptr = restored(reduced, p.rewrap.as_ref()) };
    }
}
