//! Helpers on a module's parameters that the strategies share: module paths, gradient-sync
//! marks, and replacing a parameter's primitive while keeping it a marked leaf.

use crate::core::backend::Shard;
use crate::core::tensor::ShardTensor;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorPrimitive};
use burn_backend::distributed::DistributedParamId;

/// A module path while visiting (`blocks.0.attn.weight`).
#[derive(Debug, Default)]
pub(crate) struct Path(Vec<String>);

impl Path {
    pub fn push(&mut self, name: &str) {
        self.0.push(name.to_string());
    }
    pub fn pop(&mut self) {
        self.0.pop();
    }
    pub fn join(&self) -> String {
        self.0.join(".")
    }
}

/// The gradient-sync id a parameter tensor is marked with, if any.
pub(crate) fn mark_of<AB: AutodiffBackend, const D: usize>(
    t: &Tensor<AB, D>,
) -> Option<DistributedParamId> {
    match t.clone().into_primitive() {
        TensorPrimitive::Float(p) => AB::distributed_params(&p).map(|p| p.param_id),
        TensorPrimitive::QFloat(_) => None,
    }
}

/// Replaces a parameter's inner primitive, keeping it a leaf with its `require_grad` and
/// gradient-sync mark.
pub(crate) fn replace_primitive<B, AB, const D: usize>(
    tensor: Tensor<AB, D>,
    f: impl FnOnce(ShardTensor<B>) -> ShardTensor<B>,
) -> Tensor<AB, D>
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Shard<B>>,
{
    let require_grad = tensor.is_require_grad();
    let mark = mark_of(&tensor);
    let inner = tensor.inner().into_primitive().tensor();
    let inner = Tensor::<Shard<B>, D>::from_primitive(TensorPrimitive::Float(f(inner)));
    let mut out = Tensor::<AB, D>::from_inner(inner);
    if require_grad {
        out = out.require_grad();
    }
    if let Some(mark) = mark {
        out = out.set_distributed(mark);
    }
    out
}
