//! What a rank holds: bytes of parameters, gradients and optimizer state.
//!
//! ZeRO predicts these exactly (Rajbhandari et al. 2020, fp32 Adam): DDP 16Ψ bytes per rank,
//! ZeRO-1 8Ψ + 8Ψ/N, ZeRO-2 4Ψ + 12Ψ/N, ZeRO-3 16Ψ/N; `zero-bench` prints both side by side.

use crate::core::backend::Shard;
use crate::core::scope::{self, KINDS, RankCounters, Tag, counters};
use crate::core::tensor::ShardTensor;
use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::record::{FullPrecisionSettings, Record};
use burn::tensor::Tensor;
use burn::tensor::backend::{AutodiffBackend, Backend};
use std::marker::PhantomData;
use std::sync::atomic::Ordering::Relaxed;

pub use crate::core::scope::{
    Counted, MemKind, attribute_to_rank, comm_wait, current_kind, current_rank, on_queue,
    set_shapes_only, shapes_only, waiting, with_kind,
};

fn held<B: Backend>(t: &ShardTensor<B>) -> usize {
    t.local_bytes()
}

/// Bytes of this rank's parameters (shards count their local part only).
pub fn param_bytes<B, AB, M>(module: &M) -> usize
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Shard<B>>,
    M: Module<AB>,
{
    struct Sum<B>(usize, PhantomData<B>);
    impl<B: Backend, AB: AutodiffBackend<InnerBackend = Shard<B>>> ModuleVisitor<AB> for Sum<B> {
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
    AB: AutodiffBackend<InnerBackend = Shard<B>>,
    M: Module<AB>,
{
    struct Sum<'a, B>(usize, &'a GradientsParams, PhantomData<B>);
    impl<B: Backend, AB: AutodiffBackend<InnerBackend = Shard<B>>> ModuleVisitor<AB> for Sum<'_, B> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<AB, D>>) {
            if let Some(g) = self.1.get::<Shard<B>, D>(p.id) {
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
/// its binary serialisation (Burn's `BinBytesRecorder`'s encoding, without the recorder's few
/// bytes of metadata) with sharded tensors read locally, counted as it is written, so the
/// serialised copy never exists. The tensors' payload dominates; each tensor adds a few dozen
/// bytes of shape and type.
///
/// # Panics
/// If the record cannot be serialised.
pub fn record_bytes<B: Backend, R: Record<B>>(record: R) -> usize {
    struct Count(usize);
    impl bincode::enc::write::Writer for Count {
        fn write(&mut self, bytes: &[u8]) -> Result<(), bincode::error::EncodeError> {
            self.0 += bytes.len();
            Ok(())
        }
    }
    scope::local_reads(|| {
        let item = record.into_item::<FullPrecisionSettings>();
        let mut count = Count(0);
        bincode::serde::encode_into_writer(item, &mut count, bincode::config::standard())
            .expect("a record serialises");
        count.0
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

use crate::core::scope::RANK_ALLOC_IN_USE;

/// What one rank holds on the heap, by kind, as counted by [`RankAlloc`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RankMemory {
    /// Live bytes now, by kind ([`MemKind::ALL`]'s order).
    pub live: [usize; KINDS],
    /// The most bytes (all kinds) live at once since [`RankMemory::reset_peak`].
    pub peak: usize,
    /// The most bytes of each kind live at once since then.
    pub peak_by_kind: [usize; KINDS],
}

impl RankMemory {
    /// `rank`'s counters (all zero unless the program's global allocator is [`RankAlloc`]).
    pub fn of(rank: usize) -> RankMemory {
        let Some(c) = counters(rank) else {
            return RankMemory::default();
        };
        RankMemory {
            live: std::array::from_fn(|k| c.live[k].load(Relaxed)),
            peak: c.peak.load(Relaxed),
            peak_by_kind: std::array::from_fn(|k| c.kind_peak[k].load(Relaxed)),
        }
    }
    /// Live bytes, all kinds.
    pub fn total(&self) -> usize {
        self.live.iter().sum()
    }
    /// Live bytes of `kind`.
    pub fn live(&self, kind: MemKind) -> usize {
        self.live[kind as usize]
    }
    /// Peak bytes of `kind`.
    pub fn peak_of(&self, kind: MemKind) -> usize {
        self.peak_by_kind[kind as usize]
    }
    /// Starts new peaks for `rank` from what it holds now.
    pub fn reset_peak(rank: usize) {
        let Some(c) = counters(rank) else {
            return;
        };
        let now = RankMemory::of(rank);
        c.peak.store(now.total(), Relaxed);
        for (peak, live) in c.kind_peak.iter().zip(now.live) {
            peak.store(live, Relaxed);
        }
    }
    /// Whether [`RankAlloc`] is the global allocator (it has counted an allocation).
    pub fn counting() -> bool {
        RANK_ALLOC_IN_USE.load(Relaxed)
    }
}

/// Zeroed blocks of at least this many bytes are fresh mappings on shapes (see
/// `RankAlloc::alloc_zeroed`).
const MAPPED_ZEROS: usize = 32 << 20;
/// The kind's flag of a block that is a mapping of its own.
const MAPPED: usize = 1 << 62;

/// A global allocator that counts live and peak heap bytes per rank (ranks as threads
/// included, any number of them) and per [`MemKind`]: each allocation carries a 16-byte header
/// naming the counters and kind of the thread that made it, so it is subtracted from the right
/// counters wherever it is freed. For tests, benchmarks and `kiln train`'s memory report:
///
/// ```no_run
/// #[global_allocator]
/// static ALLOC: kiln_shard::account::RankAlloc = kiln_shard::account::RankAlloc;
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct RankAlloc;

impl RankAlloc {
    const HEADER: usize = 16;

    fn header(layout: std::alloc::Layout) -> Option<(std::alloc::Layout, usize)> {
        let pad = Self::HEADER.max(layout.align());
        let size = layout.size().checked_add(pad)?;
        Some((
            std::alloc::Layout::from_size_align(size, layout.align()).ok()?,
            pad,
        ))
    }

    /// Writes this thread's tag (its kind with `flag`) into the header of block `base` and
    /// counts `size` bytes: the pointer handed out, `pad` bytes into the block.
    ///
    /// # Safety
    /// `base` is a fresh block with `pad >= 16` bytes (a multiple of 8, `base` 8-aligned)
    /// before the caller's `size` bytes.
    unsafe fn tagged(base: *mut u8, pad: usize, size: usize, flag: usize) -> *mut u8 {
        let tag = scope::tag();
        // SAFETY: both slots lie in the `pad` bytes before the returned pointer and are
        // 8-aligned (the caller's contract).
        unsafe {
            let p = base.add(pad);
            (p.sub(16) as *mut usize).write(tag.counters);
            (p.sub(8) as *mut usize).write(tag.kind | flag);
            Self::count(tag, size, true);
            RANK_ALLOC_IN_USE.store(true, Relaxed);
            p
        }
    }

    fn count(tag: Tag, size: usize, add: bool) {
        if let Some(c) = tag.counters() {
            RankCounters::count(c, tag.kind, size, add);
        }
    }
}

// SAFETY: every block is the system allocator's, `HEADER.max(align)` bytes larger than asked and
// offset by that much (so alignment is kept); the header (the tag: the counters' address and the
// kind) is written in the 16 bytes before the returned pointer and read back on free. Only
// counters are touched besides.
unsafe impl std::alloc::GlobalAlloc for RankAlloc {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        let Some((outer, pad)) = Self::header(layout) else {
            return std::ptr::null_mut();
        };
        // SAFETY: `outer` has a non-zero size.
        let base = unsafe { std::alloc::System.alloc(outer) };
        if base.is_null() {
            return base;
        }
        // SAFETY: `base` is a fresh block of `outer` bytes, `pad` of them before the caller's.
        unsafe { Self::tagged(base, pad, layout.size(), 0) }
    }

    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        let Some((outer, pad)) = Self::header(layout) else {
            return std::ptr::null_mut();
        };
        // A job on shapes (`kiln plan`) reads large tensors as zeros nobody looks at: a fresh
        // mapping, whose pages exist only once written, makes them cost no memory. Otherwise
        // the system's zeroed allocation (kept in the heap, as `keep_freed_memory` wants).
        let mapped = outer.size() >= MAPPED_ZEROS && scope::shapes_only();
        let base = match mapped {
            // SAFETY: an anonymous private mapping of `outer.size()` bytes (page-aligned,
            // which covers `outer`'s alignment up to a page).
            true if outer.align() <= 4096 => unsafe {
                let p = libc::mmap(
                    std::ptr::null_mut(),
                    outer.size(),
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                );
                if p == libc::MAP_FAILED {
                    std::ptr::null_mut()
                } else {
                    p as *mut u8
                }
            },
            // SAFETY: `outer` has a non-zero size.
            _ => unsafe { std::alloc::System.alloc_zeroed(outer) },
        };
        if base.is_null() {
            return base;
        }
        let flag = match mapped && outer.align() <= 4096 {
            true => MAPPED,
            false => 0,
        };
        // SAFETY: as in `alloc`.
        unsafe { Self::tagged(base, pad, layout.size(), flag) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        let (outer, pad) = Self::header(layout).expect("allocated with this layout");
        // SAFETY: `ptr` came from `alloc` or `alloc_zeroed` with this layout: the tag sits in
        // the 16 bytes before it and the block starts `pad` bytes before it (a mapping when
        // the kind carries `MAPPED`).
        unsafe {
            let kind = (ptr.sub(8) as *const usize).read();
            let tag = Tag {
                counters: (ptr.sub(16) as *const usize).read(),
                kind: kind & !MAPPED,
            };
            Self::count(tag, layout.size(), false);
            match kind & MAPPED != 0 {
                true => {
                    libc::munmap(ptr.sub(pad) as *mut libc::c_void, outer.size());
                }
                false => std::alloc::System.dealloc(ptr.sub(pad), outer),
            }
        }
    }
}

/// One rank's memory in one training step, as [`step`](crate::step()) measures it when the
/// program's global allocator is [`RankAlloc`]: what the decorator holds (exact) beside the
/// heap's peaks by [`MemKind`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepMemory {
    /// The rank measured.
    pub rank: usize,
    /// Bytes of the rank's parameters after the step (shards count their local part).
    pub params: usize,
    /// Bytes of the reduced gradients the optimizer received (this rank's part).
    pub grads: usize,
    /// Heap bytes the rank held when the step began: parameters, optimizer state, anything
    /// kept between steps.
    pub held_before: usize,
    /// The most heap bytes the rank held at once during the step.
    pub peak: usize,
    /// For each kind ([`MemKind::ALL`]'s order), its most live bytes during the step above
    /// what it held when the step began.
    pub peak_above_start: [usize; KINDS],
}

impl StepMemory {
    /// The most bytes of `kind` live at once during the step, above the step's start: for
    /// [`MemKind::Activations`], the activation memory of the step.
    pub fn peak_of(&self, kind: MemKind) -> usize {
        self.peak_above_start[kind as usize]
    }

    /// How far the step's peak rose above what the rank held when it began: what a step
    /// costs beyond the model state.
    pub fn rise(&self) -> usize {
        self.peak.saturating_sub(self.held_before)
    }
}

/// Measures one step's [`StepMemory`] for the rank this thread is attributed to: `start`
/// before the step, [`MemoryProbe::finish`] after it.
#[derive(Debug)]
pub struct MemoryProbe {
    rank: usize,
    start: RankMemory,
}

impl MemoryProbe {
    /// Starts a measurement, or `None` when nothing counts (the global allocator is not
    /// [`RankAlloc`], or this thread has no rank).
    pub fn start() -> Option<MemoryProbe> {
        let rank = current_rank()?;
        if !RankMemory::counting() {
            return None;
        }
        RankMemory::reset_peak(rank);
        Some(MemoryProbe {
            rank,
            start: RankMemory::of(rank),
        })
    }

    /// The step's memory, with the decorator's exact parameter and gradient bytes.
    pub fn finish(self, params: usize, grads: usize) -> StepMemory {
        let now = RankMemory::of(self.rank);
        StepMemory {
            rank: self.rank,
            params,
            grads,
            held_before: self.start.total(),
            peak: now.peak,
            peak_above_start: std::array::from_fn(|k| {
                now.peak_by_kind[k].saturating_sub(self.start.live[k])
            }),
        }
    }
}

static STEP_OBSERVER: std::sync::OnceLock<fn(bool)> = std::sync::OnceLock::new();

/// Has `f` called on the rank's thread when each training step ([`step_with`]
/// (crate::step_with)) begins (`true`) and ends (`false`): `kiln plan` cuts its log of a
/// simulated rank's work into steps with it. The first observer set stays.
pub fn observe_steps(f: fn(bool)) {
    let _ = STEP_OBSERVER.set(f);
}

pub(crate) fn step_mark(begin: bool) {
    if let Some(f) = STEP_OBSERVER.get() {
        f(begin);
    }
}
