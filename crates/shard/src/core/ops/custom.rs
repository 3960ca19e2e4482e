//! The hand-written exceptions of the forwarding (see `forward.rs` for the rest).

use super::policy::{local, record, record_compute_with, view};
use crate::core::backend::Shard;
use crate::core::dtype::{Precision, lowered, promote, promote2, widen};
use crate::core::host::{collective_failed, read_host, write, write_host};
use crate::core::scope;
use crate::core::tensor::{
    Binary, Elementwise, Prim, ShardOps, ShardTensor, Sharded, ViewOp, WeightGrad,
    deferring_weight_grads,
};
use burn_backend::ops::*;
use burn_backend::quantization::{QuantScheme, QuantizationParametersPrimitive};
use burn_backend::tensor::{Device, FloatTensor, IntTensor, QuantizedTensor};
use burn_backend::{
    Backend, DType, Distribution, ExecutionError, Scalar, TensorData, TensorMetadata,
};
use burn_std::{FloatDType, Shape, Slice};
use kiln_comm::ReduceOp;
use std::sync::Arc;

// ----- creation: whole tensors, or only this rank's shard while a lazily initialised
// parameter is created under ZeRO-3 (`shard` runs the initialiser in that scope) -----

/// This rank's shard of a tensor of `shape` being created, made by `make(len)` (1-D).
fn created<B: Backend>(
    shape: &Shape,
    make: impl FnOnce(usize, &mut scope::Creation) -> B::FloatTensorPrimitive,
) -> Option<FloatTensor<Shard<B>>> {
    scope::creating(|c| {
        let len = kiln_comm::shard_len(shape.num_elements(), c.group.world_size(), c.group.rank());
        let ops = c
            .ops
            .downcast_ref::<Arc<dyn ShardOps<B>>>()
            .expect("a sharded creation for this backend")
            .clone();
        let shard = make(len, c);
        ShardTensor::Sharded(Sharded {
            shard,
            shape: shape.clone(),
            group: c.group.clone(),
            ops,
        })
    })
}

fn flat(len: usize) -> Shape {
    Shape::from(vec![len])
}

pub(crate) fn float_from_data<B: Backend>(
    data: TensorData,
    device: &Device<B>,
) -> FloatTensor<Shard<B>> {
    ShardTensor::Local(B::float_from_data(data, device))
}

pub(crate) fn float_random<B: Backend>(
    shape: Shape,
    distribution: Distribution,
    device: &Device<B>,
    dtype: FloatDType,
) -> FloatTensor<Shard<B>> {
    created::<B>(&shape, |len, c| {
        let data = TensorData::random::<f32, _, _>(flat(len), distribution, &mut c.rng);
        write::<B>(data, device, dtype.into())
    })
    .unwrap_or_else(|| match scope::draw_group() {
        // Ranks computing one model together draw one tensor: rank 0's, broadcast.
        Some(group) => {
            let t = match group.rank() {
                0 => B::float_random(shape.clone(), distribution, device, dtype),
                _ => B::float_zeros(shape.clone(), device, dtype),
            };
            let dtype = t.dtype();
            let mut host = read_host::<B>(t);
            scope::waiting(|| group.broadcast(host.buf_mut(), 0))
                .unwrap_or_else(|e| collective_failed("broadcast", &shape, group.as_ref(), e));
            ShardTensor::Local(write_host::<B>(host, shape, device, dtype))
        }
        None => ShardTensor::Local(B::float_random(shape, distribution, device, dtype)),
    })
}

pub(crate) fn float_zeros<B: Backend>(
    shape: Shape,
    device: &Device<B>,
    dtype: FloatDType,
) -> FloatTensor<Shard<B>> {
    created::<B>(&shape, |len, _| {
        super::fast::zeros::<B>(flat(len), device, dtype)
    })
    .unwrap_or_else(|| ShardTensor::Local(super::fast::zeros::<B>(shape, device, dtype)))
}

pub(crate) fn float_ones<B: Backend>(
    shape: Shape,
    device: &Device<B>,
    dtype: FloatDType,
) -> FloatTensor<Shard<B>> {
    created::<B>(&shape, |len, _| B::float_ones(flat(len), device, dtype))
        .unwrap_or_else(|| ShardTensor::Local(B::float_ones(shape, device, dtype)))
}

pub(crate) fn float_full<B: Backend>(
    shape: Shape,
    fill_value: Scalar,
    device: &Device<B>,
    dtype: FloatDType,
) -> FloatTensor<Shard<B>> {
    created::<B>(&shape, |len, _| {
        B::float_full(flat(len), fill_value, device, dtype)
    })
    .unwrap_or_else(|| ShardTensor::Local(B::float_full(shape, fill_value, device, dtype)))
}

pub(crate) fn float_empty<B: Backend>(
    shape: Shape,
    device: &Device<B>,
    dtype: FloatDType,
) -> FloatTensor<Shard<B>> {
    created::<B>(&shape, |len, _| B::float_empty(flat(len), device, dtype))
        .unwrap_or_else(|| ShardTensor::Local(B::float_empty(shape, device, dtype)))
}

// ----- reading and metadata -----

/// Reading a shard gathers it first: a collective, so every rank must read (e.g. validation
/// and checkpointing run on all ranks, never on rank 0 alone). Inside
/// [`local_reads`](crate::local_reads) it reads this rank's shard (or tensor-parallel part)
/// instead.
pub(crate) fn float_into_data<B: Backend>(
    tensor: FloatTensor<Shard<B>>,
) -> impl Future<Output = Result<TensorData, ExecutionError>> + Send {
    match tensor {
        ShardTensor::Sharded(s) if scope::reading_locally() => B::float_into_data(s.shard),
        // A tensor-parallel part likewise (its shard, when it is sharded too).
        t if scope::reading_locally() && t.part().is_some() => {
            match t.part().expect("a part").local {
                ShardTensor::Sharded(s) => B::float_into_data(s.shard),
                part => B::float_into_data(local(part)),
            }
        }
        t => B::float_into_data(local(t)),
    }
}

pub(crate) fn float_device<B: Backend>(tensor: &FloatTensor<Shard<B>>) -> Device<B> {
    tensor.device()
}

pub(crate) fn float_is_require_grad<B: Backend>(tensor: &FloatTensor<Shard<B>>) -> bool {
    match tensor {
        ShardTensor::Local(t) => B::float_is_require_grad(t),
        ShardTensor::Sharded(s) => B::float_is_require_grad(&s.shard),
        ShardTensor::Deferred(d) => d.is_require_grad(),
    }
}

// ----- layout ops: deferred on shards (see `ShardTensor::View`) -----

pub(crate) fn float_reshape<B: Backend>(
    tensor: FloatTensor<Shard<B>>,
    shape: Shape,
) -> FloatTensor<Shard<B>> {
    // BatchNorm's statistics are watched for only under a batch group (SyncBatchNorm).
    if !scope::has_batch_group() {
        return view(tensor, ViewOp::Reshape(shape));
    }
    let (before, input) = (scope::batch_pattern(), tensor.shape());
    let out = view(tensor, ViewOp::Reshape(shape));
    super::batch::on_reshape(before, &input, &out.shape());
    out
}

pub(crate) fn float_swap_dims<B: Backend>(
    tensor: FloatTensor<Shard<B>>,
    dim1: usize,
    dim2: usize,
) -> FloatTensor<Shard<B>> {
    let out = view(tensor, ViewOp::SwapDims(dim1, dim2));
    if scope::has_batch_group() {
        super::batch::on_swap(&out.shape(), dim1, dim2);
    }
    out
}

pub(crate) fn float_transpose<B: Backend>(tensor: FloatTensor<Shard<B>>) -> FloatTensor<Shard<B>> {
    match tensor {
        ShardTensor::Local(t) => ShardTensor::Local(B::float_transpose(t)),
        // Burn's transpose swaps the last two dimensions.
        t => {
            let rank = t.shape().num_dims();
            assert!(rank >= 2, "kiln: transposing a tensor of rank {rank}");
            view(t, ViewOp::SwapDims(rank - 2, rank - 1))
        }
    }
}

pub(crate) fn float_permute<B: Backend>(
    tensor: FloatTensor<Shard<B>>,
    axes: &[usize],
) -> FloatTensor<Shard<B>> {
    view(tensor, ViewOp::Permute(axes.to_vec()))
}

pub(crate) fn float_slice<B: Backend>(
    tensor: FloatTensor<Shard<B>>,
    slices: &[Slice],
) -> FloatTensor<Shard<B>> {
    view(tensor, ViewOp::Slice(slices.to_vec()))
}

pub(crate) fn float_expand<B: Backend>(
    tensor: FloatTensor<Shard<B>>,
    shape: Shape,
) -> FloatTensor<Shard<B>> {
    view(tensor, ViewOp::Expand(shape))
}

// ----- whole-tensor reductions: local partial, then all-reduce -----

fn reduce_all<B: Backend>(
    tensor: FloatTensor<Shard<B>>,
    local_op: impl FnOnce(B::FloatTensorPrimitive) -> B::FloatTensorPrimitive,
    empty: f32,
    op: ReduceOp,
) -> FloatTensor<Shard<B>> {
    let s = match tensor {
        ShardTensor::Local(t) => return ShardTensor::Local(local_op(t)),
        ShardTensor::Sharded(s) if s.group.world_size() == 1 => {
            return ShardTensor::Local(local_op(s.shard));
        }
        ShardTensor::Sharded(s) => s,
        // A deferred value may sum itself without being formed; a view may slice or expand:
        // reduce what it shows.
        ShardTensor::Deferred(d) => {
            if op == ReduceOp::Sum
                && let Some(sum) = d.sum()
            {
                return sum;
            }
            return ShardTensor::Local(local_op(local(ShardTensor::Deferred(d))));
        }
    };
    let device = B::float_device(&s.shard);
    let dtype = s.shard.dtype();
    // A rank may hold no elements (fewer elements than ranks): it contributes the identity.
    let partial = if s.shard.shape().num_elements() == 0 {
        B::float_full(Shape::from(vec![1]), empty.into(), &device, dtype.into())
    } else {
        local_op(s.shard)
    };
    let mut host = read_host::<B>(partial);
    scope::waiting(|| s.group.all_reduce(host.buf_mut(), op))
        .unwrap_or_else(|e| collective_failed("all-reduce", &s.shape, s.group.as_ref(), e));
    ShardTensor::Local(write_host::<B>(host, Shape::from(vec![1]), &device, dtype))
}

pub(crate) fn float_sum<B: Backend>(tensor: FloatTensor<Shard<B>>) -> FloatTensor<Shard<B>> {
    reduce_all(tensor, B::float_sum, 0.0, ReduceOp::Sum)
}

pub(crate) fn float_mean<B: Backend>(tensor: FloatTensor<Shard<B>>) -> FloatTensor<Shard<B>> {
    match tensor {
        ShardTensor::Sharded(s) => {
            let n = s.numel();
            let sum = local(float_sum::<B>(ShardTensor::Sharded(s)));
            ShardTensor::Local(B::float_div_scalar(sum, (n as f64).into()))
        }
        ShardTensor::Deferred(d) => {
            let n = d.shape().num_elements();
            match d.sum() {
                Some(sum) => {
                    super::policy::unary(sum, move |t| B::float_div_scalar(t, (n as f64).into()))
                }
                None => ShardTensor::Local(B::float_mean(local(ShardTensor::Deferred(d)))),
            }
        }
        t => ShardTensor::Local(B::float_mean(local(t))),
    }
}

/// A mean along `dim`: over the data-parallel group when it is `BatchNorm`'s statistic under
/// `BufferPolicy::Sync` (see `batch.rs`).
pub(crate) fn float_mean_dim<B: Backend>(
    tensor: FloatTensor<Shard<B>>,
    dim: usize,
) -> FloatTensor<Shard<B>> {
    match super::batch::mean_dim::<B>(tensor, dim) {
        Ok(mean) => mean,
        Err(tensor) => super::policy::along(tensor, dim, move |t| B::float_mean_dim(t, dim)),
    }
}

pub(crate) fn float_max<B: Backend>(tensor: FloatTensor<Shard<B>>) -> FloatTensor<Shard<B>> {
    reduce_all(tensor, B::float_max, f32::NEG_INFINITY, ReduceOp::Max)
}

pub(crate) fn float_min<B: Backend>(tensor: FloatTensor<Shard<B>>) -> FloatTensor<Shard<B>> {
    reduce_all(tensor, B::float_min, f32::INFINITY, ReduceOp::Min)
}

// ----- module ops -----

/// The embedding gradient needs only the weight's shape, device and dtype: a sharded weight
/// is not gathered for it.
/// `embedding`: a deferred table may look up its own rows (a vocabulary-parallel part).
pub(crate) fn embedding<B: Backend>(
    weights: FloatTensor<Shard<B>>,
    indices: IntTensor<B>,
) -> FloatTensor<Shard<B>> {
    if let ShardTensor::Deferred(d) = &weights
        && let Some(t) = d.embed(&indices)
    {
        return t;
    }
    record(vec![weights], move |t| {
        B::embedding(t.into_iter().next().expect("input"), indices.clone())
    })
}

pub(crate) fn embedding_backward<B: Backend>(
    weights: FloatTensor<Shard<B>>,
    output_grad: FloatTensor<Shard<B>>,
    indices: IntTensor<B>,
) -> FloatTensor<Shard<B>> {
    if let ShardTensor::Deferred(d) = &weights
        && let Some(g) = d.embed_grad(&output_grad, &indices)
    {
        return g;
    }
    let weights = match weights {
        ShardTensor::Local(w) => w,
        t => {
            let device = float_device::<B>(&t);
            B::float_zeros(t.shape(), &device, t.dtype().into())
        }
    };
    ShardTensor::Local(B::embedding_backward(weights, local(output_grad), indices))
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn deform_conv2d_backward<B: Backend>(
    x: FloatTensor<Shard<B>>,
    offset: FloatTensor<Shard<B>>,
    weight: FloatTensor<Shard<B>>,
    mask: Option<FloatTensor<Shard<B>>>,
    bias: Option<FloatTensor<Shard<B>>>,
    output_grad: FloatTensor<Shard<B>>,
    options: DeformConvOptions<2>,
) -> DeformConv2dBackward<Shard<B>> {
    let r = B::deform_conv2d_backward(
        local(x),
        local(offset),
        local(weight),
        mask.map(local),
        bias.map(local),
        local(output_grad),
        options,
    );
    DeformConv2dBackward::new(
        ShardTensor::Local(r.x_grad),
        ShardTensor::Local(r.offset_grad),
        ShardTensor::Local(r.weight_grad),
        r.mask_grad.map(ShardTensor::Local),
        r.bias_grad.map(ShardTensor::Local),
    )
}

pub(crate) fn max_pool1d_with_indices<B: Backend>(
    x: FloatTensor<Shard<B>>,
    kernel_size: usize,
    stride: usize,
    padding: usize,
    dilation: usize,
    ceil_mode: bool,
) -> MaxPool1dWithIndices<Shard<B>> {
    let r = B::max_pool1d_with_indices(local(x), kernel_size, stride, padding, dilation, ceil_mode);
    MaxPool1dWithIndices::new(ShardTensor::Local(r.output), r.indices)
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn max_pool1d_with_indices_backward<B: Backend>(
    x: FloatTensor<Shard<B>>,
    kernel_size: usize,
    stride: usize,
    padding: usize,
    dilation: usize,
    ceil_mode: bool,
    output_grad: FloatTensor<Shard<B>>,
    indices: IntTensor<B>,
) -> MaxPool1dBackward<Shard<B>> {
    let r = B::max_pool1d_with_indices_backward(
        local(x),
        kernel_size,
        stride,
        padding,
        dilation,
        ceil_mode,
        local(output_grad),
        indices,
    );
    MaxPool1dBackward::new(ShardTensor::Local(r.x_grad))
}

pub(crate) fn max_pool2d_with_indices<B: Backend>(
    x: FloatTensor<Shard<B>>,
    kernel_size: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
    dilation: [usize; 2],
    ceil_mode: bool,
) -> MaxPool2dWithIndices<Shard<B>> {
    let r = B::max_pool2d_with_indices(local(x), kernel_size, stride, padding, dilation, ceil_mode);
    MaxPool2dWithIndices::new(ShardTensor::Local(r.output), r.indices)
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn max_pool2d_with_indices_backward<B: Backend>(
    x: FloatTensor<Shard<B>>,
    kernel_size: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
    dilation: [usize; 2],
    ceil_mode: bool,
    output_grad: FloatTensor<Shard<B>>,
    indices: IntTensor<B>,
) -> MaxPool2dBackward<Shard<B>> {
    let r = B::max_pool2d_with_indices_backward(
        local(x),
        kernel_size,
        stride,
        padding,
        dilation,
        ceil_mode,
        local(output_grad),
        indices,
    );
    MaxPool2dBackward::new(ShardTensor::Local(r.x_grad))
}

pub(crate) fn quantize<B: Backend>(
    tensor: FloatTensor<Shard<B>>,
    scheme: &QuantScheme,
    qparams: QuantizationParametersPrimitive<Shard<B>>,
) -> QuantizedTensor<B> {
    B::quantize(
        local(tensor),
        scheme,
        QuantizationParametersPrimitive {
            scales: local(qparams.scales),
        },
    )
}

impl<B: Backend> TransactionOps<Self> for Shard<B> {
    async fn tr_execute(
        transaction: TransactionPrimitive<Self>,
    ) -> Result<TransactionPrimitiveData, ExecutionError> {
        B::tr_execute(TransactionPrimitive::new(
            transaction.read_floats.into_iter().map(local).collect(),
            transaction.read_qfloats,
            transaction.read_ints,
            transaction.read_bools,
        ))
        .await
    }
}

/// `Linear`'s forward: a deferred weight may compute it without being formed (a LoRA
/// weight: PEFT's factored form).
pub(crate) fn linear<B: Backend>(
    x: FloatTensor<Shard<B>>,
    weight: FloatTensor<Shard<B>>,
    bias: Option<FloatTensor<Shard<B>>>,
) -> FloatTensor<Shard<B>> {
    let (x, bias) = match &weight {
        ShardTensor::Deferred(w) => match w.clone().linear(x, bias) {
            Ok(y) => return y,
            Err(args) => args,
        },
        _ => (x, bias),
    };
    // A deferred input with a whole weight and bias: `linear` works along the last dimension
    // (a tensor-parallel part split along the tokens applies it to its part).
    if let (ShardTensor::Deferred(d), ShardTensor::Local(w)) = (&x, &weight)
        && matches!(bias, None | Some(ShardTensor::Local(_)))
    {
        let last = d.shape().num_dims() - 1;
        let (w, b) = (w.clone(), bias.clone().map(local));
        let policy = scope::precision();
        let f: Elementwise<B> = Arc::new(move |x| {
            let mut inputs = vec![x, w.clone()];
            inputs.extend(b.clone());
            linear_prims::<B>(policy, inputs)
        });
        if let Some(y) = d.along(last, &f) {
            return y;
        }
    }
    let mut inputs = vec![x, weight];
    inputs.extend(bias);
    record_compute_with(inputs, linear_prims::<B>)
}

/// `linear` on inner tensors `[x, w]` or `[x, w, bias]` under `policy`.
pub(crate) fn linear_prims<B: Backend>(policy: Precision, t: Vec<Prim<B>>) -> Prim<B> {
    let inner = |v: Vec<Prim<B>>| {
        let mut v = v.into_iter();
        let (x, w) = (v.next().expect("input"), v.next().expect("weight"));
        B::linear(x, w, v.next())
    };
    if policy.compute == FloatDType::F32 {
        return inner(promote::<B>(t));
    }
    let mut t = t.into_iter();
    let (x, w) = (t.next().expect("input"), t.next().expect("weight"));
    // On Flex, without a half-precision copy of the weight (see `fast.rs`).
    match super::fast::linear_half::<B>(x, w, t.next(), policy.compute.into()) {
        Ok(y) => y,
        Err((x, w, bias)) => lowered::<B>(policy, [x, w].into_iter().chain(bias).collect(), &inner),
    }
}

/// `matmul`: a deferred operand may compute it without being formed (a tensor-parallel part).
pub(crate) fn float_matmul<B: Backend>(
    lhs: FloatTensor<Shard<B>>,
    rhs: FloatTensor<Shard<B>>,
) -> FloatTensor<Shard<B>> {
    // The first operand asked first, then the second.
    let policy = scope::precision();
    let f: Binary<B> = Arc::new(move |a, b| matmul_prims::<B>(policy, a, b));
    let (lhs, rhs) = match lhs {
        ShardTensor::Deferred(d) => match d.clone().matmul(rhs, true, &f) {
            Ok(y) => return y,
            Err(rhs) => (ShardTensor::Deferred(d), rhs),
        },
        lhs => (lhs, rhs),
    };
    let (lhs, rhs) = match rhs {
        ShardTensor::Deferred(d) => match d.clone().matmul(lhs, false, &f) {
            Ok(y) => return y,
            Err(lhs) => (lhs, ShardTensor::Deferred(d)),
        },
        rhs => (lhs, rhs),
    };
    record_compute_with(vec![lhs, rhs], move |policy, t| {
        let mut t = t.into_iter();
        let a = t.next().expect("input");
        matmul_prims::<B>(policy, a, t.next().expect("input"))
    })
}

/// `matmul` on inner tensors under `policy`.
pub(crate) fn matmul_prims<B: Backend>(policy: Precision, a: Prim<B>, b: Prim<B>) -> Prim<B> {
    let inner = |v: Vec<Prim<B>>| {
        let mut v = v.into_iter();
        let a = v.next().expect("input");
        super::fast::matmul::<B>(a, v.next().expect("input"))
    };
    if policy.compute == FloatDType::F32 {
        return inner(promote::<B>(vec![a, b]));
    }
    lowered::<B>(policy, vec![a, b], &inner)
}

/// `slice_assign`: a deferred value may write itself without being formed (a tensor-parallel
/// part: the backward of slicing a split tensor).
pub(crate) fn float_slice_assign<B: Backend>(
    tensor: FloatTensor<Shard<B>>,
    slices: &[Slice],
    value: FloatTensor<Shard<B>>,
) -> FloatTensor<Shard<B>> {
    let tensor = match &value {
        ShardTensor::Deferred(d) => match d.clone().slice_assign(tensor, slices) {
            Ok(t) => return t,
            Err(t) => t,
        },
        _ => tensor,
    };
    let slices = slices.to_owned();
    record(vec![tensor, value], move |t| {
        let mut t = t.into_iter();
        super::fast::slice_assign::<B>(t.next().expect("input"), &slices, t.next().expect("input"))
    })
}

/// `cat`: a deferred operand may join them without forming them (tensor-parallel parts split
/// along another dimension).
pub(crate) fn float_cat<B: Backend>(
    tensors: Vec<FloatTensor<Shard<B>>>,
    dim: usize,
) -> FloatTensor<Shard<B>> {
    let deferred = tensors.iter().find_map(|t| match t {
        ShardTensor::Deferred(d) => Some(d.clone()),
        _ => None,
    });
    if let Some(d) = deferred
        && let Some(t) = d.cat(&tensors, dim)
    {
        return t;
    }
    record(tensors, move |t| B::float_cat(t, dim))
}

/// `gather` along `dim`: a deferred value may take its own elements (a tensor-parallel part
/// split along another dimension).
pub(crate) fn float_gather<B: Backend>(
    dim: usize,
    tensor: FloatTensor<Shard<B>>,
    indices: IntTensor<B>,
) -> FloatTensor<Shard<B>> {
    if let ShardTensor::Deferred(d) = &tensor
        && let Some(t) = d.take(dim, &indices)
    {
        return t;
    }
    record(vec![tensor], move |t| {
        B::float_gather(dim, t.into_iter().next().expect("input"), indices.clone())
    })
}

/// `Linear`'s bias gradient: a deferred output gradient may compute it without being formed.
pub(crate) fn linear_bias_backward<B: Backend>(
    output_grad: FloatTensor<Shard<B>>,
) -> FloatTensor<Shard<B>> {
    if let ShardTensor::Deferred(d) = &output_grad
        && let Some(g) = d.bias_grad()
    {
        return g;
    }
    record(vec![output_grad], move |t| {
        B::linear_bias_backward(t.into_iter().next().expect("input"))
    })
}

/// `Linear`'s input gradient: a deferred weight may compute it without being formed.
pub(crate) fn linear_x_backward<B: Backend>(
    weight: FloatTensor<Shard<B>>,
    output_grad: FloatTensor<Shard<B>>,
) -> FloatTensor<Shard<B>> {
    let output_grad = match &weight {
        ShardTensor::Deferred(w) => match w.clone().linear_x_backward(output_grad) {
            Ok(dx) => return dx,
            Err(dy) => dy,
        },
        _ => output_grad,
    };
    // A whole weight and a deferred gradient: along the last dimension, as `linear`.
    if let (ShardTensor::Local(w), ShardTensor::Deferred(d)) = (&weight, &output_grad) {
        let last = d.shape().num_dims() - 1;
        let w = w.clone();
        let f: Elementwise<B> = Arc::new(move |dy| {
            let (w, dy) = promote2::<B>(w.clone(), dy);
            linear_x_prims::<B>(w, dy)
        });
        if let Some(dx) = d.along(last, &f) {
            return dx;
        }
    }
    record(vec![weight, output_grad], move |t| {
        let mut t = t.into_iter();
        linear_x_prims::<B>(t.next().expect("input"), t.next().expect("input"))
    })
}

/// `dy w^T` for a weight `[in, out]`: over every row at once, `[rows, out] [out, in]`, the
/// weight's transpose read in place (Burn's default broadcasts it over `dy`'s leading
/// dimensions as a batched product).
fn linear_x_prims<B: Backend>(w: Prim<B>, dy: Prim<B>) -> Prim<B> {
    let ys = dy.shape();
    let n = ys.num_dims();
    if n < 2 || w.shape().num_dims() != 2 {
        return B::linear_x_backward(w, dy);
    }
    let rows = (0..n - 1).map(|d| ys[d]).product::<usize>();
    let dy = B::float_reshape(dy, Shape::new([rows, ys[n - 1]]));
    let dx = super::fast::matmul::<B>(dy, B::float_swap_dims(w, 0, 1));
    let mut dims: Vec<usize> = (0..n).map(|d| ys[d]).collect();
    dims[n - 1] = dx.shape()[1];
    B::float_reshape(dx, Shape::from(dims))
}

/// `Linear`'s weight gradient: deferred ([`WeightGrad`]) while some layer asks for it, so
/// that a LoRA weight's op turns `x` and `dy` into its adapters' gradients without forming
/// `Σ xᵀ dy`.
pub(crate) fn linear_weight_backward<B: Backend>(
    x: FloatTensor<Shard<B>>,
    output_grad: FloatTensor<Shard<B>>,
) -> FloatTensor<Shard<B>> {
    if deferring_weight_grads() {
        return ShardTensor::Deferred(Arc::new(WeightGrad { x, dy: output_grad }));
    }
    // A deferred operand may compute it without being formed (a tensor-parallel part): `x`
    // asked first, then `dy`.
    let (x, output_grad) = match x {
        ShardTensor::Deferred(d) => match d.clone().weight_grad(output_grad, true) {
            Ok(g) => return g,
            Err(dy) => (ShardTensor::Deferred(d), dy),
        },
        x => (x, output_grad),
    };
    let (x, output_grad) = match output_grad {
        ShardTensor::Deferred(d) => match d.clone().weight_grad(x, false) {
            Ok(g) => return g,
            Err(x) => (x, ShardTensor::Deferred(d)),
        },
        dy => (x, dy),
    };
    record(vec![x, output_grad], move |t| weight_grad_prims::<B>(t))
}

/// `linear_weight_backward` on inner tensors `[x, dy]`.
pub(crate) fn weight_grad_prims<B: Backend>(t: Vec<Prim<B>>) -> Prim<B> {
    {
        // Accumulated and kept in f32 when the inputs are in a half-precision compute dtype
        // (their values are exact in f32): the gradient is the parameter's, widened to f32
        // anyway, and rounding it to half first would make it depend on how the batch is cut
        // over ranks (Megatron's gradient-accumulation fusion writes the weight gradient's
        // GEMM in f32 too).
        let mut t = t.into_iter().map(|t| match t.dtype() {
            DType::BF16 | DType::F16 => widen::<B>(t, DType::F32),
            _ => t,
        });
        B::linear_weight_backward(t.next().expect("input"), t.next().expect("input"))
    }
}

/// `exp`: on Flex in f32, kiln's vectorised kernel (see `fast.rs`).
pub(crate) fn float_exp<B: Backend>(tensor: FloatTensor<Shard<B>>) -> FloatTensor<Shard<B>> {
    super::policy::unary(tensor, move |t| super::fast::exp::<B>(t))
}

/// `sigmoid`: on Flex in f32, kiln's vectorised kernel (see `fast.rs`).
pub(crate) fn sigmoid<B: Backend>(tensor: FloatTensor<Shard<B>>) -> FloatTensor<Shard<B>> {
    super::policy::unary(tensor, move |t| super::fast::sigmoid::<B>(t))
}
