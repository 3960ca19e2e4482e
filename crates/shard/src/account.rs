//! What a rank holds: bytes of parameters, gradients and optimizer state.
//!
//! ZeRO predicts these exactly (Rajbhandari et al. 2020, fp32 Adam): DDP 16Ψ bytes per rank,
//! ZeRO-1 8Ψ + 8Ψ/N, ZeRO-2 4Ψ + 12Ψ/N, ZeRO-3 16Ψ/N; `zero-bench` prints both side by side.

use crate::ShardTensor;
use crate::state::local_reads;
use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Record, Recorder};
use burn::tensor::Tensor;
use burn::tensor::backend::{AutodiffBackend, Backend};
use std::marker::PhantomData;

fn held<B: Backend>(t: &ShardTensor<B>) -> usize {
    t.local_bytes()
}

/// Bytes of this rank's parameters (shards count their local part only).
pub fn param_bytes<B, AB, M>(module: &M) -> usize
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = crate::Shard<B>>,
    M: Module<AB>,
{
    struct Sum<B>(usize, PhantomData<B>);
    impl<B: Backend, AB: AutodiffBackend<InnerBackend = crate::Shard<B>>> ModuleVisitor<AB> for Sum<B> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<AB, D>>) {
            let prim = p.val().inner().into_primitive().tensor();
            self.0 += held::<B>(&prim);
        }
    }
    let mut s = Sum::<B>(0, PhantomData);
    module.visit(&mut s);
    s.0
}

/// Bytes of this rank's gradients of `module`'s parameters.
pub fn grad_bytes<B, AB, M>(module: &M, grads: &GradientsParams) -> usize
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = crate::Shard<B>>,
    M: Module<AB>,
{
    struct Sum<'a, B>(usize, &'a GradientsParams, PhantomData<B>);
    impl<B: Backend, AB: AutodiffBackend<InnerBackend = crate::Shard<B>>> ModuleVisitor<AB>
        for Sum<'_, B>
    {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<AB, D>>) {
            if let Some(g) = self.1.get::<crate::Shard<B>, D>(p.id) {
                let prim = g.into_primitive().tensor();
                self.0 += held::<B>(&prim);
            }
        }
    }
    let mut s = Sum::<B>(0, grads, PhantomData);
    module.visit(&mut s);
    s.0
}

/// Size of a record (e.g. an optimizer's state, `optimizer.to_record()`) as this rank holds it:
/// its binary serialisation with sharded tensors read locally. The tensors' payload dominates;
/// each tensor adds a few dozen bytes of shape and type.
///
/// # Panics
/// If the record cannot be serialised.
pub fn record_bytes<B: Backend, R: Record<B>>(record: R) -> usize {
    local_reads(|| {
        BinBytesRecorder::<FullPrecisionSettings>::default()
            .record(record, ())
            .expect("a record serialises")
            .len()
    })
}
