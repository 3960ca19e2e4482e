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
use kiln_comm::CommStats;
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

/// This rank's traffic so far on the groups `module`'s sharding uses, or `None` if it is not
/// sharded: without hybrid sharding, the group passed to [`shard`] (so it includes the
/// caller's own collectives on that group); under hybrid sharding, the shard and replicate
/// sub-groups made from it, whose counters the parent group does not see. Take the difference
/// of two readings ([`CommStats::since`]) for one step's traffic.
///
/// [`shard`]: crate::shard()
pub fn comm_stats<B, AB, M>(module: &M) -> Option<CommStats>
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = crate::Shard<B>>,
    M: Module<AB>,
{
    let models = crate::strategy::Marks::<B>::of::<AB, M>(module).models();
    let m = models.first()?;
    let shard = m.shard_group.stats();
    Some(match &m.replicate_group {
        Some(r) => shard.plus(&r.stats()),
        None => shard,
    })
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

/// A global allocator that counts live and peak heap bytes, for benchmarks and memory tests:
///
/// ```no_run
/// #[global_allocator]
/// static ALLOC: kiln_shard::account::CountingAlloc = kiln_shard::account::CountingAlloc;
/// kiln_shard::account::CountingAlloc::reset_peak();
/// // ... work ...
/// let peak = kiln_shard::account::CountingAlloc::peak();
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct CountingAlloc;

static LIVE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
static PEAK: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

impl CountingAlloc {
    /// Heap bytes allocated now (by this process, all threads).
    pub fn live() -> usize {
        LIVE.load(std::sync::atomic::Ordering::Relaxed)
    }
    /// The most heap bytes allocated at once since the last [`CountingAlloc::reset_peak`].
    pub fn peak() -> usize {
        PEAK.load(std::sync::atomic::Ordering::Relaxed)
    }
    /// Starts a new peak from the current live bytes.
    pub fn reset_peak() {
        PEAK.store(Self::live(), std::sync::atomic::Ordering::Relaxed);
    }
}

// SAFETY: forwards every call to the system allocator; it only counts.
unsafe impl std::alloc::GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        use std::sync::atomic::Ordering::Relaxed;
        // SAFETY: the caller's contract is the system allocator's.
        let p = unsafe { std::alloc::System.alloc(layout) };
        if !p.is_null() {
            let now = LIVE.fetch_add(layout.size(), Relaxed) + layout.size();
            PEAK.fetch_max(now, Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        // SAFETY: as above.
        unsafe { std::alloc::System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), std::sync::atomic::Ordering::Relaxed);
    }
}
