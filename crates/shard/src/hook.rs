//! Gradient reduction during backward, through burn-autodiff's `distributed` hook.
//!
//! burn-autodiff calls `submit_gradient_sync` on the backend directly under `Autodiff` the
//! moment a marked parameter's gradient is final, in the same (graph-determined) order on every
//! rank, and `submit_sync_collective` when backward ends. The parameter's gradient-sync id,
//! which `shard` made unique to its model, leads to that model's state; gradients are collected
//! into the model's bucket and reduced together once it holds `bucket_bytes`:
//! - DDP: all-reduce (average) the concatenation;
//! - ZeRO-1/2/3: reduce-scatter (average) so that each rank receives the shard of every gradient
//!   it owns. Each gradient's shards are padded to equal length and laid out rank-major, so one
//!   reduce-scatter of equal chunks serves a bucket of unevenly divisible tensors (FSDP's flat
//!   parameter padding). ZeRO-1 flushes once, when backward ends (whole gradients coexist until
//!   then, as ZeRO-1 defines); ZeRO-2/3 flush whenever a bucket is full;
//! - hybrid: reduce-scatter within the sharding group, then all-reduce the shards across groups.
//!
//! Inside [`no_sync`](crate::no_sync) the hook leaves gradients whole and unreduced.

use crate::account::{MemKind, waiting, with_kind};
use crate::ops::policy::{Host, local, read, slice_local, write};
use crate::state::{AnyModel, ModelState, PendingGrad, model_of};
use crate::tensor::Sharded;
use crate::{Shard, ShardTensor};
use burn_backend::distributed::{
    DistributedBackend, DistributedParamId, DistributedParams, TensorRef,
};
use burn_backend::{Backend, TensorMetadata};
use burn_std::Shape;
use kiln_comm::{ProcessGroup, ReduceOp, Work, shard_range};
use std::cell::RefCell;
use std::sync::Arc;

thread_local! {
    /// The models whose parameters take part in the backward pass running on this thread, in
    /// creation order: flushed, in that order, when it ends.
    static IN_BACKWARD: RefCell<Vec<(u64, AnyModel)>> = const { RefCell::new(Vec::new()) };
}

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
        IN_BACKWARD.with(|b| *b.borrow_mut() = models);
    }

    fn submit_gradient_sync(tensor: TensorRef<Self>, params: DistributedParams) {
        let (m, id) = model::<B>(&params);
        let mut d = m.lock();
        if d.no_sync {
            return;
        }
        let shape = d.params.get(&id).cloned().unwrap_or_else(|| {
            panic!("kiln: gradient of parameter {id:?}, which `shard` did not register")
        });
        // SAFETY: `tensor.0` points to the gradient in burn-autodiff's container, valid for
        // the rest of this backward (see `PendingGrad`).
        let grad = unsafe { &*tensor.0 };
        assert_eq!(
            grad.shape(),
            shape,
            "kiln: gradient shape differs from its parameter's"
        );
        d.bucket_bytes += grad.local_bytes();
        d.synced.insert(id);
        d.bucket.push(PendingGrad {
            ptr: tensor.0,
            shape,
        });
        if m.config.strategy.reduces_during_backward() && d.bucket_bytes >= m.config.bucket_bytes {
            let bucket = std::mem::take(&mut d.bucket);
            d.bucket_bytes = 0;
            drop(d);
            flush(&m, bucket);
        }
    }

    fn submit_sync_collective(_device: &Self::Device) {
        let models = IN_BACKWARD.with(|b| std::mem::take(&mut *b.borrow_mut()));
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

/// A bucket handed to the model's communication queue: written back into the gradient
/// container when backward ends (the pointers stay valid until then, see `PendingGrad`).
pub(crate) struct InFlight<B: Backend> {
    bucket: Vec<PendingGrad<B>>,
    layout: Layout<B>,
    work: Work<Host>,
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
        .map(|p| (unsafe { (*p.ptr).clone() }, p.shape.clone()))
        .collect();
    with_kind(MemKind::Comm, || match (prepare(m, grads), &m.queue) {
        (Prepared::Send(layout, send), Some(queue)) => {
            let across = m.replicate_group.clone();
            let work = crate::account::on_queue(queue, "gradient reduction", move |g| {
                with_kind(MemKind::Comm, || communicate(g, across.as_deref(), send))
            });
            m.lock().in_flight.push(InFlight {
                bucket,
                layout,
                work,
            });
        }
        (prepared, _) => put_back(&bucket, complete(m, prepared)),
    });
}

/// Waits for the model's buckets in flight, in order, and writes their results back.
fn land<B: Backend>(m: &ModelState<B>) {
    let in_flight = std::mem::take(&mut m.lock().in_flight);
    for f in in_flight {
        let out = waiting(|| f.work.wait());
        let reduced = with_kind(MemKind::Comm, || finish(m, &f.layout, out));
        put_back(&f.bucket, reduced);
    }
}

fn put_back<B: Backend>(bucket: &[PendingGrad<B>], reduced: Vec<ShardTensor<B>>) {
    for (p, reduced) in bucket.iter().zip(reduced) {
        // SAFETY: as in `flush`.
        unsafe { *p.ptr = reduced };
    }
}

/// Reduces whole gradients (in their order, identical on every rank) as the model's strategy
/// says: averaged whole tensors for DDP, this rank's averaged shards otherwise. Blocking.
pub(crate) fn reduce<B: Backend>(
    m: &ModelState<B>,
    grads: Vec<(ShardTensor<B>, Shape)>,
) -> Vec<ShardTensor<B>> {
    complete(m, prepare(m, grads))
}

/// A prepared bucket's results, communicating on this thread if needed.
fn complete<B: Backend>(m: &ModelState<B>, prepared: Prepared<B>) -> Vec<ShardTensor<B>> {
    match prepared {
        Prepared::Done(reduced) => reduced,
        Prepared::Send(layout, send) => {
            let out =
                waiting(|| communicate(m.shard_group.as_ref(), m.replicate_group.as_deref(), send));
            finish(m, &layout, out)
        }
    }
}

/// A bucket read to the host and laid out for its collective.
enum Prepared<B: Backend> {
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

fn prepare<B: Backend>(m: &ModelState<B>, grads: Vec<(ShardTensor<B>, Shape)>) -> Prepared<B> {
    let group = &m.shard_group;
    let strategy = m.config.strategy;
    if group.world_size() == 1 && m.replicate_group.is_none() {
        // Nothing to reduce: the gradients are already whole and final; a ZeRO strategy's
        // "shard" of a one-rank group is the whole tensor, so only the layout changes.
        return Prepared::Done(
            grads
                .into_iter()
                .map(|(g, _)| {
                    let whole = local(g);
                    if strategy.shards_optimizer() {
                        ShardTensor::Sharded(slice_local::<B>(whole, group))
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
    let reduce = crate::precision::active().reduce;
    let inner: Vec<B::FloatTensorPrimitive> = inner
        .into_iter()
        .map(|g| crate::precision::narrow::<B>(g, reduce))
        .collect();
    #[cfg(feature = "cuda")]
    if m.queue.is_none() {
        let on_device: Vec<_> = inner.iter().cloned().zip(shapes.iter().cloned()).collect();
        if let Some(done) = crate::on_device::reduce(m, &on_device) {
            return Prepared::Done(
                done.into_iter()
                    .map(|t| {
                        crate::ops::policy::unary(t, move |g| {
                            crate::precision::widen::<B>(g, dtype)
                        })
                    })
                    .collect(),
            );
        }
    }
    let device = B::float_device(&inner[0]);
    let hosts: Vec<Host> = inner
        .into_iter()
        .map(|g| Host::from_data(read::<B>(g)))
        .collect();
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
fn communicate(
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
fn finish<B: Backend>(
    m: &ModelState<B>,
    layout: &Layout<B>,
    out: kiln_comm::Result<Host>,
) -> Vec<ShardTensor<B>> {
    let group = &m.shard_group;
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
                let data = out.slice(offset, offset + n).into_data(shape.clone());
                offset += n;
                ShardTensor::Local(write::<B>(data, device, dtype))
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
            let shard = write::<B>(
                out.slice(at, at + range.len())
                    .into_data(Shape::from(vec![range.len()])),
                device,
                dtype,
            );
            ShardTensor::Sharded(Sharded {
                shard,
                shape: shape.clone(),
                group: group.clone(),
                tag: None,
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
