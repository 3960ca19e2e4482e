//! ZeRO's gathers and views: how a flat shard becomes whole ([`Flat`], the [`ShardOps`] every
//! shard carries unless its model prefetches), and layout ops on shards deferred as [`View`]s.
//!
//! A gather rounds the shard to the precision policy's compute dtype before it travels (half
//! the bytes of f32 for bf16 and f16, FSDP2's `param_dtype`) and widens the whole tensor back.
//! On CUDA tensors over an NCCL group (feature `cuda`) it runs on device memory; otherwise it
//! goes through host buffers. For the per-rank memory counters, the collective's buffers count
//! as communication and only the whole tensor as a gathered parameter.

use crate::core::dtype::{narrow, widen};
use crate::core::host::{Host, collective_failed, read_host, write_host};
use crate::core::scope::{self, MemKind, waiting, with_kind};
use crate::core::tensor::{Deferred, Elementwise, Prim, ShardOps, ShardTensor, Sharded, ViewOp};
use burn_backend::{Backend, DType, TensorMetadata};
use burn_std::Shape;
use kiln_comm::ProcessGroup;
use std::sync::Arc;

/// The dtype parameters are all-gathered in under the precision policy in force.
pub fn gather_dtype() -> burn_std::FloatDType {
    scope::precision().compute
}

/// The plain gather: an all-gather over the shard's group.
#[derive(Debug, Clone, Copy, Default)]
pub struct Flat;

/// What a shard carries when nothing serves its gathers but the group: [`Flat`].
pub fn flat<B: Backend>() -> Arc<dyn ShardOps<B>> {
    Arc::new(Flat)
}

impl<B: Backend> ShardOps<B> for Flat {
    fn gather(&self, s: &Sharded<B>) -> Prim<B> {
        gather(s)
    }

    fn view(&self, s: Sharded<B>, op: ViewOp) -> ShardTensor<B> {
        view(s, op)
    }

    fn derived(&self) -> Arc<dyn ShardOps<B>> {
        flat()
    }
}

/// The whole tensor of a shard, gathered from its group on this thread.
pub fn gather<B: Backend>(s: &Sharded<B>) -> Prim<B> {
    if s.group.world_size() == 1 {
        // The one shard is the whole tensor; rounded to the compute dtype as a gather over
        // several ranks rounds it, so that ZeRO-3 gives the same numbers at every world size.
        let whole = B::float_reshape(s.shard.clone(), s.shape.clone());
        let dtype = whole.dtype();
        return widen::<B>(narrow::<B>(whole, gather_dtype()), dtype);
    }
    #[cfg(feature = "cuda")]
    if let Some(whole) = on_device::gather(s) {
        return whole;
    }
    // In the compute dtype of the policy, widened back when written.
    let shard = narrow::<B>(s.shard.clone(), gather_dtype());
    let host = with_kind(MemKind::Comm, || read_host::<B>(shard));
    let full = waiting(|| all_gather_host(s.group.as_ref(), &host, s.numel()));
    whole_from_host(s, full)
}

/// The whole tensor from a gathered buffer (counted as a gathered parameter).
pub fn whole_from_host<B: Backend>(s: &Sharded<B>, full: kiln_comm::Result<Host>) -> Prim<B> {
    let full =
        full.unwrap_or_else(|e| collective_failed("all-gather", &s.shape, s.group.as_ref(), e));
    let device = B::float_device(&s.shard);
    let dtype = s.shard.dtype();
    with_kind(MemKind::Gathered, || {
        write_host::<B>(full, s.shape.clone(), &device, dtype)
    })
}

/// The whole buffer of `numel` elements from every rank's `shard`. The buffer the whole tensor
/// is received into becomes its storage (no copy on Flex), so it counts as a gathered
/// parameter, the transfer as communication.
pub fn all_gather_host(
    group: &dyn ProcessGroup,
    shard: &Host,
    numel: usize,
) -> kiln_comm::Result<Host> {
    let mut full = with_kind(MemKind::Gathered, || shard.zeros(numel));
    with_kind(MemKind::Comm, || {
        group.all_gather(shard.buf(), full.buf_mut())
    })?;
    Ok(full)
}

/// A layout op on a shard, deferred: a [`View`].
pub fn view<B: Backend>(base: Sharded<B>, op: ViewOp) -> ShardTensor<B> {
    let shape = op.apply_shape(base.shape.clone());
    ShardTensor::Deferred(Arc::new(View {
        base,
        ops: vec![op],
        shape,
    }))
}

/// A shard seen through layout ops (reshape, transpose, permute, slice, expand), not yet
/// applied: the shard is gathered and the ops replayed only when the view is used.
///
/// Without it, `w.transpose()` of a sharded weight would return the whole weight, which
/// autodiff then keeps for backward (a tied output head `x @ wteᵀ`, a LayerNorm's scale
/// reshaped for broadcasting): the whole parameter would live from forward to backward,
/// breaking ZeRO-3's "gathered on use, dropped after".
#[derive(Debug, Clone)]
pub struct View<B: Backend> {
    /// The shard the view reads.
    pub base: Sharded<B>,
    /// The layout ops, in order.
    pub ops: Vec<ViewOp>,
    /// The view's logical shape.
    pub shape: Shape,
}

impl<B: Backend> Deferred<B> for View<B> {
    fn shape(&self) -> Shape {
        self.shape.clone()
    }
    fn dtype(&self) -> DType {
        self.base.shard.dtype()
    }
    fn device(&self) -> B::Device {
        B::float_device(&self.base.shard)
    }
    fn value(&self) -> Prim<B> {
        self.ops
            .iter()
            .fold(self.base.gather(), |t, op| op.apply::<B>(t))
    }
    fn held_bytes(&self) -> usize {
        self.base.shard.shape().num_elements() * self.base.shard.dtype().size()
    }
    fn is_sharded(&self) -> bool {
        true
    }
    fn is_require_grad(&self) -> bool {
        B::float_is_require_grad(&self.base.shard)
    }
    /// Elementwise ops commute with layout ops: the view stays a view of the new shard.
    fn elementwise(&self, f: &Elementwise<B>) -> Option<ShardTensor<B>> {
        Some(ShardTensor::Deferred(Arc::new(View {
            base: self.base.clone().map(|t| f(t)),
            ops: self.ops.clone(),
            shape: self.shape.clone(),
        })))
    }
    fn layout(&self, op: &ViewOp) -> Option<ShardTensor<B>> {
        let mut v = self.clone();
        v.shape = op.apply_shape(v.shape);
        v.ops.push(op.clone());
        Some(ShardTensor::Deferred(Arc::new(v)))
    }
}

/// Gathers on device memory (burn-cuda tensors over an NCCL group): the buffers laid out with
/// the inner backend's own ops, NCCL on the tensors' device pointers, nothing staged through
/// the host. Any other backend or group returns `None`: the caller takes the host path.
///
/// Untested here (no GPU on the development machine): `scripts/gpu-check.sh` runs the
/// decorator's parity checks on CUDA + NCCL, which go through these paths.
#[cfg(feature = "cuda")]
pub mod on_device {
    use crate::core::dtype::{narrow, widen};
    use crate::core::host::collective_failed;
    use crate::core::scope::waiting;
    use crate::core::tensor::{Prim, Sharded};
    use crate::features::zero::gather_dtype;
    use burn_backend::{Backend, TensorMetadata};
    use burn_std::{Shape, Slice};
    use kiln_comm::{ProcessGroup, shard_range};

    /// Whether `group` is an NCCL group.
    pub fn is_nccl(group: &dyn ProcessGroup) -> bool {
        group.backend() == "nccl"
    }

    /// `t` as one dimension.
    pub fn flat<B: Backend>(t: Prim<B>) -> Prim<B> {
        let n = t.shape().num_elements();
        B::float_reshape(t, Shape::from(vec![n]))
    }

    /// Elements `start..end` of a 1-D tensor.
    pub fn slice<B: Backend>(t: Prim<B>, start: usize, end: usize) -> Prim<B> {
        B::float_slice(t, &[Slice::new(start as isize, Some(end as isize), 1)])
    }

    /// `t` (1-D) followed by zeros up to `len` elements.
    pub fn padded<B: Backend>(t: Prim<B>, len: usize) -> Prim<B> {
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
    pub fn gather<B: Backend>(s: &Sharded<B>) -> Option<Prim<B>> {
        if !is_nccl(s.group.as_ref()) {
            return None;
        }
        let (world, numel) = (s.group.world_size(), s.numel());
        let chunk = numel.div_ceil(world);
        // In the compute dtype of the policy, widened back below.
        let shard = narrow::<B>(s.shard.clone(), gather_dtype());
        let mine = padded::<B>(flat::<B>(shard), chunk);
        let all = waiting(|| crate::core::device::all_gather::<B>(s.group.as_ref(), &mine))?
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
        let whole = widen::<B>(whole, s.shard.dtype());
        Some(B::float_reshape(whole, s.shape.clone()))
    }
}
