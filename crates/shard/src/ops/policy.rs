//! How float tensors pass through the decorator: shard-local, gathered, or reduced.

use crate::ShardTensor;
use crate::precision::gather_dtype;
use crate::tensor::{Sharded, View, ViewOp};
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, DType, TensorData, TensorMetadata, TensorPrimitive, try_read_sync};
use burn_std::{Shape, Slice};
use kiln_comm::{ProcessGroup, shard_range};
use std::sync::Arc;

pub(crate) use kiln_comm::tensor::HostBuffer as Host;

/// Reads an inner tensor to the host.
pub(crate) fn read<B: Backend>(t: B::FloatTensorPrimitive) -> TensorData {
    try_read_sync(B::float_into_data(t))
        .expect("kiln: the inner backend cannot read tensors synchronously")
        .unwrap_or_else(|e| panic!("kiln: reading a tensor failed: {e:?}"))
}

/// Writes host data to an inner tensor of `dtype` on `device`.
pub(crate) fn write<B: Backend>(
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
pub(crate) fn collective_failed(
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

/// The whole tensor of a shard, gathered from the group.
///
/// For the per-rank memory counters (`account::RankAlloc`), the collective's buffers count as
/// communication and only the whole tensor as a gathered parameter (so that a transport buffer
/// a peer frees later is not mistaken for a whole parameter kept alive).
pub(crate) fn gather<B: Backend>(s: &Sharded<B>) -> B::FloatTensorPrimitive {
    use crate::account::{MemKind, waiting, with_kind};
    if s.group.world_size() == 1 {
        // The one shard is the whole tensor; rounded to the compute dtype as a gather over
        // several ranks rounds it, so that ZeRO-3 gives the same numbers at every world size.
        let whole = B::float_reshape(s.shard.clone(), s.shape.clone());
        let dtype = whole.dtype();
        let gathered = crate::precision::narrow::<B>(whole, gather_dtype());
        return crate::precision::widen::<B>(gathered, dtype);
    }
    #[cfg(feature = "cuda")]
    if let Some(whole) = crate::on_device::gather(s) {
        return whole;
    }
    // A parameter's shard goes through its model's communication queue (prefetched there).
    let queued = s.tag.and_then(|tag| {
        let (m, id) = crate::state::model_of::<B>(tag.id)?;
        let queue = m.queue.as_ref()?;
        Some(crate::prefetch::gather(&m, queue, id, tag.version, s))
    });
    let device = B::float_device(&s.shard);
    let dtype = s.shard.dtype();
    let full = match queued {
        Some(work) => waiting(|| work.wait()),
        None => {
            // In the compute dtype of the policy (half the bytes of f32 for bf16 and f16),
            // widened back when written.
            let shard = crate::precision::narrow::<B>(s.shard.clone(), gather_dtype());
            let host = with_kind(MemKind::Comm, || Host::from_data(read::<B>(shard)));
            waiting(|| all_gather_host(s.group.as_ref(), &host, s.numel()))
        }
    }
    .unwrap_or_else(|e| collective_failed("all-gather", &s.shape, s.group.as_ref(), e));
    with_kind(MemKind::Gathered, || {
        write::<B>(full.into_data(s.shape.clone()), &device, dtype)
    })
}

/// The whole buffer of `numel` elements from every rank's `shard`. The buffer the whole tensor
/// is received into becomes its storage (no copy on Flex), so it counts as a gathered
/// parameter, the transfer as communication.
pub(crate) fn all_gather_host(
    group: &dyn ProcessGroup,
    shard: &Host,
    numel: usize,
) -> kiln_comm::Result<Host> {
    use crate::account::{MemKind, with_kind};
    let mut full = with_kind(MemKind::Gathered, || shard.zeros(numel));
    with_kind(MemKind::Comm, || {
        group.all_gather(shard.buf(), full.buf_mut())
    })?;
    Ok(full)
}

/// This rank's shard of a whole inner tensor (no communication).
pub(crate) fn slice_local<B: Backend>(
    t: B::FloatTensorPrimitive,
    group: &Arc<dyn ProcessGroup>,
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
        tag: None,
    }
}

/// The whole tensor as an inner tensor, gathering a shard (the copy is dropped after use).
pub(crate) fn local<B: Backend>(t: FloatTensor<crate::Shard<B>>) -> B::FloatTensorPrimitive {
    match t {
        ShardTensor::Local(t) => t,
        ShardTensor::Sharded(s) => gather(&s),
        ShardTensor::View(v) => v.ops.iter().fold(gather(&v.base), |t, op| op.apply::<B>(t)),
        ShardTensor::Remat(h) => h.value(),
        ShardTensor::LowRank(w) => w.formed(),
        ShardTensor::WeightGrad(g) => g.formed(),
    }
}

/// A layout op: on a whole tensor, applied now; on a shard or a view of one, deferred (see
/// [`ShardTensor::View`]), so that no whole parameter outlives the op that uses it.
pub(crate) fn view<B: Backend>(t: ShardTensor<B>, op: ViewOp) -> ShardTensor<B> {
    match t {
        t @ (ShardTensor::Local(_)
        | ShardTensor::Remat(_)
        | ShardTensor::LowRank(_)
        | ShardTensor::WeightGrad(_)) => {
            crate::remat::record(vec![t], move |mut t| op.apply::<B>(t.remove(0)))
        }
        ShardTensor::Sharded(base) => {
            let shape = op.apply_shape::<B>(base.shape.clone());
            ShardTensor::View(View {
                base,
                ops: vec![op],
                shape,
            })
        }
        ShardTensor::View(mut v) => {
            v.shape = op.apply_shape::<B>(v.shape);
            v.ops.push(op);
            ShardTensor::View(v)
        }
    }
}

pub(crate) fn local_primitive<B: Backend>(
    t: TensorPrimitive<crate::Shard<B>>,
) -> TensorPrimitive<B> {
    match t {
        TensorPrimitive::Float(t) => TensorPrimitive::Float(local(t)),
        TensorPrimitive::QFloat(q) => TensorPrimitive::QFloat(q),
    }
}

pub(crate) fn local_wrap_primitive<B: Backend>(
    t: TensorPrimitive<B>,
) -> TensorPrimitive<crate::Shard<B>> {
    match t {
        TensorPrimitive::Float(t) => TensorPrimitive::Float(ShardTensor::Local(t)),
        TensorPrimitive::QFloat(q) => TensorPrimitive::QFloat(q),
    }
}

/// An elementwise op on one tensor: a shard stays a shard.
pub(crate) fn unary<B: Backend>(
    t: ShardTensor<B>,
    f: impl Fn(B::FloatTensorPrimitive) -> B::FloatTensorPrimitive + Send + Sync + 'static,
) -> ShardTensor<B> {
    match t {
        t @ (ShardTensor::Local(_)
        | ShardTensor::Remat(_)
        | ShardTensor::LowRank(_)
        | ShardTensor::WeightGrad(_)) => crate::remat::record(vec![t], move |mut t| f(t.remove(0))),
        ShardTensor::Sharded(s) => ShardTensor::Sharded(Sharded {
            shard: f(s.shard),
            shape: s.shape,
            group: s.group,
            tag: None,
        }),
        // Elementwise ops commute with layout ops: the view stays a view of the new shard.
        ShardTensor::View(v) => ShardTensor::View(View {
            base: Sharded {
                shard: f(v.base.shard),
                shape: v.base.shape,
                group: v.base.group,
                tag: None,
            },
            ops: v.ops,
            shape: v.shape,
        }),
    }
}

/// An elementwise op on two tensors. Shard by shard when both are laid out alike, or when one
/// is a shard and the other a whole tensor of the same shape (sliced locally: this is how
/// ZeRO-1/2's replicated parameters meet their sharded gradients); otherwise (broadcasting,
/// different groups) both are gathered.
pub(crate) fn binary<B: Backend>(
    a: ShardTensor<B>,
    b: ShardTensor<B>,
    f: impl Fn(B::FloatTensorPrimitive, B::FloatTensorPrimitive) -> B::FloatTensorPrimitive
    + Send
    + Sync
    + 'static,
) -> ShardTensor<B> {
    match (a, b) {
        (
            a @ (ShardTensor::Local(_) | ShardTensor::Remat(_)),
            b @ (ShardTensor::Local(_) | ShardTensor::Remat(_)),
        ) => crate::remat::record(vec![a, b], move |mut t| {
            let b = t.pop().expect("two inputs");
            f(t.pop().expect("two inputs"), b)
        }),
        (ShardTensor::Sharded(a), ShardTensor::Sharded(b)) if a.same_layout(&b) => {
            ShardTensor::Sharded(Sharded {
                shard: f(a.shard, b.shard),
                shape: a.shape,
                group: a.group,
                tag: None,
            })
        }
        (ShardTensor::Sharded(a), ShardTensor::Local(b)) if a.shape == b.shape() => {
            let b = slice_local::<B>(b, &a.group);
            ShardTensor::Sharded(Sharded {
                shard: f(a.shard, b.shard),
                shape: a.shape,
                group: a.group,
                tag: None,
            })
        }
        (ShardTensor::Local(a), ShardTensor::Sharded(b)) if a.shape() == b.shape => {
            let a = slice_local::<B>(a, &b.group);
            ShardTensor::Sharded(Sharded {
                shard: f(a.shard, b.shard),
                shape: b.shape,
                group: b.group,
                tag: None,
            })
        }
        (a, b) => crate::remat::record(vec![a, b], move |mut t| {
            let b = t.pop().expect("two inputs");
            f(t.pop().expect("two inputs"), b)
        }),
    }
}
