//! Batch statistics over the data-parallel group: SyncBatchNorm for Burn's `BatchNorm`, without
//! changing the model ([`BufferPolicy::Sync`](crate::BufferPolicy)).
//!
//! In training, `BatchNorm` computes each statistic as
//! `x.swap_dims(0, 1).reshape([channels, rest]).mean_dim(1)`: a mean over the batch (and
//! spatial) dimensions. While the step's scope holds a batch group ([`Set::BatchGroup`]), that
//! sequence of three ops, consecutive on the thread and with those shapes, is recognised here,
//! and the mean is taken over the whole group's rows: each rank's row sums and row counts are
//! summed over the group (two small all-reduces). The running statistics, which `BatchNorm`
//! updates from these means, are then the whole batch's on every rank.
//!
//! Backward: autodiff differentiates the mean as if it were over this rank's `m` rows. The mean
//! is over all `n` rows of the group, and every rank's loss reaches it, so the gradient arriving
//! at it is summed over the group and scaled by `m / n` before autodiff spreads it over the
//! rank's rows (kiln's burn-autodiff asks [`take_synced`] after each `mean_dim` and calls
//! [`synced_grad`] in its backward). With the gradient averaging of data parallelism on top,
//! every parameter's gradient is one device's on the whole batch. A caller that weighs a rank's
//! gradients (more rows, more weight) gives the weight with the group, and the sum is of the
//! weighted gradients, so uneven batches are one device's too.
//!
//! A whole-tensor op between the three resets the recognition, so only this exact pattern is synced;
//! outside a step's scope (evaluation, a model not sharded with the policy) nothing changes.

use crate::core::backend::Shard;
use crate::core::dtype::widen;
use crate::core::host::{collective_failed, read_host, write_host};
use crate::core::scope;
use crate::core::scope::BatchPattern as Seen;
use crate::core::tensor::{Prim, ShardTensor};
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, DType, TensorMetadata};
use burn_std::Shape;
use kiln_comm::{BufMut, ProcessGroup, ReduceOp};

/// Called by every whole-tensor op, which the pattern does not continue: forgets what was seen.
pub(crate) fn reset() {
    if scope::has_batch_group() {
        scope::set_batch_pattern(Seen::Nothing);
    }
}

/// `swap_dims(dim1, dim2)` gave `out` (the caller checked that a batch group is set).
pub(crate) fn on_swap(out: &Shape, dim1: usize, dim2: usize) {
    let swapped = matches!((dim1, dim2), (0, 1) | (1, 0)) && out.num_dims() >= 2;
    scope::set_batch_pattern(match swapped {
        true => Seen::Swapped(out.as_slice().to_vec()),
        false => Seen::Nothing,
    });
}

/// `reshape` of a tensor of shape `input` to `out`, `before` being what was seen before it
/// (the reshape itself may reset it; the caller checked that a batch group is set).
pub(crate) fn on_reshape(before: Seen, input: &Shape, out: &Shape) {
    let next = match before {
        Seen::Swapped(shape)
            if shape.as_slice() == input.as_slice()
                && out.num_dims() == 2
                && out.as_slice()[0] == shape[0]
                && out.as_slice()[1] == shape[1..].iter().product::<usize>() =>
        {
            Seen::Flat([out.as_slice()[0], out.as_slice()[1]])
        }
        _ => Seen::Nothing,
    };
    scope::set_batch_pattern(next);
}

/// `t` summed over `group` (through the host, in f32, so that no rank's sum is rounded to a
/// narrower dtype); an f32 tensor. `what` names the collective in a failure.
fn summed<B: Backend>(t: Prim<B>, group: &dyn ProcessGroup, what: &str) -> Prim<B> {
    let (shape, device) = (t.shape(), B::float_device(&t));
    let mut host = read_host::<B>(widen::<B>(t, DType::F32));
    scope::waiting(|| group.all_reduce(host.buf_mut(), ReduceOp::Sum))
        .unwrap_or_else(|e| collective_failed(what, &shape, group, e));
    write_host::<B>(host, shape, &device, DType::F32)
}

/// `mean_dim(tensor, dim)` over the batch group, if the pattern is complete; the tensor back
/// otherwise.
pub(crate) fn mean_dim<B: Backend>(
    tensor: FloatTensor<Shard<B>>,
    dim: usize,
) -> Result<FloatTensor<Shard<B>>, FloatTensor<Shard<B>>> {
    // The mark autodiff takes after this op says whether this one was synced (a mark left by
    // a mean computed without autodiff must not be taken for it).
    scope::take_batch_mean();
    let Some(scope::BatchGroup { group, .. }) = scope::batch_group() else {
        return Err(tensor);
    };
    let seen = scope::set_batch_pattern(Seen::Nothing);
    let shape = tensor.shape();
    match seen {
        Seen::Flat(flat) if dim == 1 && shape.as_slice() == flat => {}
        _ => return Err(tensor),
    }
    let rows = shape[1];
    let t = tensor.into_whole();
    let dtype = t.dtype();
    let mut count = [rows as i64];
    scope::waiting(|| group.all_reduce(BufMut::I64(&mut count), ReduceOp::Sum))
        .unwrap_or_else(|e| collective_failed("count the rows of", &shape, &*group, e));
    let total = count[0] as f64;
    let sums = summed::<B>(B::float_sum_dim(t, 1), &*group, "sum batch statistics of");
    scope::set_batch_mean(rows as f64 / total);
    Ok(ShardTensor::Local(widen::<B>(
        B::float_div_scalar(sums, total.into()),
        dtype,
    )))
}

/// Whether the `mean_dim` just computed was over the batch group, and its backward factor
/// (`rows here / rows in the group`). Clears the mark. For kiln's burn-autodiff.
pub fn take_synced() -> Option<f64> {
    scope::take_batch_mean()
}

/// The gradient arriving at a synced mean, summed over the batch group and multiplied by
/// `factor`. For kiln's burn-autodiff, in backward.
///
/// # Panics
/// If the backward runs outside a step's scope (the forward was inside one), or a collective
/// fails.
pub fn synced_grad<B: Backend>(grad: FloatTensor<Shard<B>>, factor: f64) -> FloatTensor<Shard<B>> {
    let scope::BatchGroup { group, weight } = scope::batch_group().unwrap_or_else(|| {
        panic!(
            "kiln: a BatchNorm statistic was averaged over the data-parallel group in forward \
             (BufferPolicy::Sync), but its backward runs outside kiln's step: call backward \
             inside kiln::step (or the Learner strategy), which holds the group"
        )
    });
    // Each rank's gradient as its weight will count it, summed; then divided by this rank's
    // weight, which the caller applies after backward.
    let g = grad.into_whole();
    let dtype = g.dtype();
    let g = match weight == 1.0 {
        true => g,
        false => B::float_mul_scalar(g, weight.into()),
    };
    let g = summed::<B>(g, &*group, "sum the gradient of");
    ShardTensor::Local(widen::<B>(
        B::float_mul_scalar(g, (factor / weight).into()),
        dtype,
    ))
}
