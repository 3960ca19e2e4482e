//! How float tensors pass through the decorator: shard-local, gathered, or run whole (and then
//! recorded, when the scope holds a [`Recorder`]).

use crate::core::backend::Shard;
use crate::core::dtype::{Precision, lowered, promote, promote2};
use crate::core::host::slice_local;
use crate::core::scope;
use crate::core::tensor::{Binary, Elementwise, Prim, ShardTensor, ViewOp};
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, DType, TensorMetadata, TensorPrimitive};
use burn_std::FloatDType;
use std::sync::Arc;

/// The whole tensor as an inner tensor: a shard gathered, a deferred value formed (the copy
/// is dropped after use).
pub(crate) fn local<B: Backend>(t: FloatTensor<Shard<B>>) -> B::FloatTensorPrimitive {
    t.into_whole()
}

/// A layout op: on a whole tensor, applied now; on a shard, as the shard's ops say (deferred,
/// so that no whole parameter outlives the op that uses it); on a deferred value, deferred too
/// if it can be.
pub(crate) fn view<B: Backend>(t: ShardTensor<B>, op: ViewOp) -> ShardTensor<B> {
    match t {
        ShardTensor::Sharded(s) => {
            let ops = s.ops.clone();
            ops.view(s, op)
        }
        ShardTensor::Deferred(d) => match d.layout(&op) {
            Some(t) => t,
            None => record(vec![ShardTensor::Deferred(d)], move |mut t| {
                op.apply::<B>(t.remove(0))
            }),
        },
        t => record(vec![t], move |mut t| op.apply::<B>(t.remove(0))),
    }
}

pub(crate) fn local_primitive<B: Backend>(t: TensorPrimitive<Shard<B>>) -> TensorPrimitive<B> {
    match t {
        TensorPrimitive::Float(t) => TensorPrimitive::Float(local(t)),
        TensorPrimitive::QFloat(q) => TensorPrimitive::QFloat(q),
    }
}

pub(crate) fn local_wrap_primitive<B: Backend>(t: TensorPrimitive<B>) -> TensorPrimitive<Shard<B>> {
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
        ShardTensor::Sharded(s) => ShardTensor::Sharded(s.map(f)),
        ShardTensor::Deferred(d) => {
            let f: Elementwise<B> = Arc::new(f);
            match d.elementwise(&f) {
                Some(t) => t,
                None => record(vec![ShardTensor::Deferred(d)], move |mut t| f(t.remove(0))),
            }
        }
        t => record(vec![t], move |mut t| f(t.remove(0))),
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
    // Operands of different dtypes meet in the wider (a compute-dtype activation and an f32
    // one: f32, as PyTorch promotes under autocast).
    let f = move |a, b| {
        let (a, b) = promote2::<B>(a, b);
        super::fast::half_broadcast::<B>(a, b, &f)
    };
    // A deferred operand may compute the op without being formed (a tensor-parallel part):
    // the first asked first, then the second.
    if matches!(a, ShardTensor::Deferred(_)) || matches!(b, ShardTensor::Deferred(_)) {
        let f: Binary<B> = Arc::new(f);
        let (a, b) = match a {
            ShardTensor::Deferred(d) => match d.clone().binary(b, true, &f) {
                Ok(t) => return t,
                Err(b) => (ShardTensor::Deferred(d), b),
            },
            a => (a, b),
        };
        let (a, b) = match b {
            ShardTensor::Deferred(d) => match d.clone().binary(a, false, &f) {
                Ok(t) => return t,
                Err(a) => (a, ShardTensor::Deferred(d)),
            },
            b => (a, b),
        };
        return binary_whole(a, b, f);
    }
    match (a, b) {
        (ShardTensor::Sharded(a), ShardTensor::Sharded(b)) if a.same_layout(&b) => {
            ShardTensor::Sharded(a.map(|a| f(a, b.shard)))
        }
        (ShardTensor::Sharded(a), ShardTensor::Local(b)) if a.shape == b.shape() => {
            let b = slice_local::<B>(b, &a.group, a.ops.derived());
            ShardTensor::Sharded(a.map(|a| f(a, b.shard)))
        }
        (ShardTensor::Local(a), ShardTensor::Sharded(b)) if a.shape() == b.shape => {
            let a = slice_local::<B>(a, &b.group, b.ops.derived());
            ShardTensor::Sharded(b.map(|b| f(a.shard, b)))
        }
        (a, b) => record(vec![a, b], move |mut t| {
            let b = t.pop().expect("two inputs");
            f(t.pop().expect("two inputs"), b)
        }),
    }
}

fn binary_whole<B: Backend>(a: ShardTensor<B>, b: ShardTensor<B>, f: Binary<B>) -> ShardTensor<B> {
    record(vec![a, b], move |mut t| {
        let b = t.pop().expect("two inputs");
        f(t.pop().expect("two inputs"), b)
    })
}

/// An op along dimension `dim` only (a reduction keeping the dimension, a cumulative op): a
/// deferred value may apply it without being formed; otherwise run whole.
pub(crate) fn along<B: Backend>(
    t: ShardTensor<B>,
    dim: usize,
    f: impl Fn(B::FloatTensorPrimitive) -> B::FloatTensorPrimitive + Send + Sync + 'static,
) -> ShardTensor<B> {
    match t {
        ShardTensor::Deferred(d) => {
            let f: Elementwise<B> = Arc::new(f);
            match d.along(dim, &f) {
                Some(t) => t,
                None => record(vec![ShardTensor::Deferred(d)], move |mut t| f(t.remove(0))),
            }
        }
        t => record(vec![t], move |mut t| f(t.remove(0))),
    }
}

thread_local! {
    static OP: std::cell::Cell<&'static str> = const { std::cell::Cell::new("") };
}

/// Notes the Burn op the decorator is running (the generated forwarding calls it first), so
/// that a deferred value formed for an op without a rule can be reported by the op's name.
#[inline]
pub(crate) fn op_name(name: &'static str) {
    OP.with(|o| o.set(name));
}

/// The Burn op the decorator is running on this thread (see [`op_name`]).
pub fn current_op() -> &'static str {
    OP.with(|o| o.get())
}

/// How an op's cost grows, for a recorder's eviction policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cost {
    /// Proportional to the elements read and written (elementwise, layout, reductions).
    Memory,
    /// A contraction over the first input's last dimension (matmul, linear, convolution):
    /// output elements x that dimension.
    Compute,
}

/// An inner op on whole inputs, runnable again.
pub type InnerOp<B> = Arc<dyn Fn(Vec<Prim<B>>) -> Prim<B> + Send + Sync>;

/// What runs the whole-tensor ops of a thread while the scope holds it (the remat feature's
/// pool): it may keep how each result was made, to give the value up and compute it again.
pub trait Recorder<B: Backend>: Send + Sync {
    /// Runs `op` on `inputs` (shards are gathered, deferred values formed) and returns the
    /// result, recorded or not.
    fn record(&self, cost: Cost, inputs: Vec<ShardTensor<B>>, op: InnerOp<B>) -> ShardTensor<B>;
}

/// Runs the inner op `op` on `inputs` (whole tensors: shards are gathered): through the scope's
/// recorder if it holds one, a plain `Local` result otherwise.
pub(crate) fn record<B: Backend>(
    inputs: Vec<ShardTensor<B>>,
    op: impl Fn(Vec<Prim<B>>) -> Prim<B> + Send + Sync + 'static,
) -> ShardTensor<B> {
    // Float inputs of different dtypes meet in the widest (see `binary`).
    run(Cost::Memory, inputs, move |v| op(promote::<B>(v)))
}

/// [`record`] of a contraction ([`Cost::Compute`]), run in the policy's compute dtype.
pub(crate) fn record_compute<B: Backend>(
    inputs: Vec<ShardTensor<B>>,
    op: impl Fn(Vec<Prim<B>>) -> Prim<B> + Send + Sync + 'static,
) -> ShardTensor<B> {
    // The policy is taken when the op is recorded, so that a recomputation (in backward)
    // rounds its inputs exactly as the first run did.
    let policy = scope::precision();
    if policy.compute == FloatDType::F32 {
        return run(Cost::Compute, inputs, move |v| op(promote::<B>(v)));
    }
    run(Cost::Compute, inputs, move |v| lowered::<B>(policy, v, &op))
}

/// [`record`] of a contraction ([`Cost::Compute`]) that applies the policy `op` is given
/// itself (taken when the op is recorded, as [`record_compute`] does).
pub(crate) fn record_compute_with<B: Backend>(
    inputs: Vec<ShardTensor<B>>,
    op: impl Fn(Precision, Vec<Prim<B>>) -> Prim<B> + Send + Sync + 'static,
) -> ShardTensor<B> {
    let policy = scope::precision();
    run(Cost::Compute, inputs, move |v| op(policy, v))
}

fn run<B: Backend>(
    cost: Cost,
    inputs: Vec<ShardTensor<B>>,
    op: impl Fn(Vec<Prim<B>>) -> Prim<B> + Send + Sync + 'static,
) -> ShardTensor<B> {
    super::batch::reset();
    match recorder::<B>() {
        Some(r) => r.record(cost, inputs, Arc::new(op)),
        None => ShardTensor::Local(op(inputs.into_iter().map(local).collect())),
    }
}

/// The scope's recorder for this backend.
fn recorder<B: Backend>() -> Option<Arc<dyn Recorder<B>>> {
    let any = scope::recorder()?;
    any.downcast_ref::<Arc<dyn Recorder<B>>>().cloned()
}

/// The dtype a compute-bound op's activation operand is cast to in the autodiff graph (kiln's
/// burn-autodiff asks through its autocast hook): the policy's compute dtype for an f32 tensor
/// while a lower-precision policy is in force, so that the op saves the cast tensor for its
/// backward (what `torch.autocast`'s recorded cast does), else `None`.
pub(crate) fn autocast_input<B: Backend>(t: &ShardTensor<B>) -> Option<FloatDType> {
    let compute = scope::precision().compute;
    (compute != FloatDType::F32 && t.dtype() == DType::F32).then_some(compute)
}

/// Registers [`autocast_input`] as this backend's autocast hook in kiln's burn-autodiff
/// (idempotent; `shard` and every step call it).
pub(crate) fn register_autocast<B: Backend>() {
    #[cfg(burn_autodiff_hooks)]
    burn_autodiff::distributed::register_autocast::<crate::core::backend::Shard<B>>(
        burn_autodiff::distributed::Autocast {
            input_dtype: autocast_input::<B>,
        },
    );
}
