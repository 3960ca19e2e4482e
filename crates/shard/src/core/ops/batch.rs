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
use crate::core::host::{collective_failed, read, write};
use crate::core::scope;
use crate::core::scope::BatchPattern as Seen;
use crate::core::tensor::ShardTensor;
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, TensorData, TensorMetadata};
use burn_std::Shape;
use kiln_comm::{BufMut, ReduceOp};

fn set(seen: Seen) {
    scope::set_batch_pattern(seen);
}

/// Called by every op the pattern does not continue: forgets what was seen.
pub(crate) fn reset() {
    if scope::has_batch_group() {
        set(Seen::Nothing);
    }
}

/// `swap_dims(dim1, dim2)` gave `out`.
pub(crate) fn on_swap(out: &Shape, dim1: usize, dim2: usize) {
    if !scope::has_batch_group() {
        return;
    }
    let swapped = matches!((dim1, dim2), (0, 1) | (1, 0)) && out.num_dims() >= 2;
    set(match swapped {
        true => Seen::Swapped(out.as_slice().to_vec()),
        false => Seen::Nothing,
    });
}

/// What was seen before an op (which may itself reset it), for [`on_reshape`].
pub(crate) fn seen() -> Option<Seen> {
    scope::has_batch_group().then(scope::batch_pattern)
}

/// `reshape` of a tensor of shape `input` to `out`, `before` it [`seen`].
pub(crate) fn on_reshape(before: Option<Seen>, input: &Shape, out: &Shape) {
    let Some(before) = before else {
        return;
    };
    let next = match &before {
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
    set(next);
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
    let [channels, rows] = [shape[0], shape[1]];
    let t = tensor.into_whole();
    let (dtype, device) = (t.dtype(), B::float_device(&t));
    let sums = B::float_sum_dim(t, 1);
    let mut sums: Vec<f32> = read::<B>(sums)
        .convert::<f32>()
        .into_vec::<f32>()
        .expect("f32 sums");
    let mut count = [rows as i64];
    scope::waiting(|| {
        group
            .all_reduce(BufMut::I64(&mut count), ReduceOp::Sum)
            .and_then(|_| group.all_reduce(BufMut::F32(&mut sums), ReduceOp::Sum))
    })
    .unwrap_or_else(|e| collective_failed("average batch statistics of", &shape, &*group, e));
    let total = count[0] as f64;
    let means: Vec<f32> = sums.iter().map(|&s| (s as f64 / total) as f32).collect();
    scope::set_batch_mean(rows as f64 / total);
    let data = TensorData::new(means, [channels, 1]);
    Ok(ShardTensor::Local(write::<B>(data, &device, dtype)))
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
    let shape = grad.shape();
    let g = grad.into_whole();
    let (dtype, device) = (g.dtype(), B::float_device(&g));
    // Each rank's gradient as its weight will count it, summed; then divided by this rank's
    // weight, which the caller applies after backward.
    let mut values: Vec<f32> = read::<B>(g)
        .convert::<f32>()
        .into_vec::<f32>()
        .expect("f32 gradient");
    if weight != 1.0 {
        values
            .iter_mut()
            .for_each(|v| *v = (*v as f64 * weight) as f32);
    }
    scope::waiting(|| group.all_reduce(BufMut::F32(&mut values), ReduceOp::Sum))
        .unwrap_or_else(|e| collective_failed("sum the gradient of", &shape, &*group, e));
    let values: Vec<f32> = values
        .iter()
        .map(|&v| (v as f64 * factor / weight) as f32)
        .collect();
    ShardTensor::Local(write::<B>(TensorData::new(values, shape), &device, dtype))
}
