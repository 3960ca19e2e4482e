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
/// sub-groups made from it, whose counters the parent group does not see; with
/// [`ShardConfig::overlap`](crate::ShardConfig::overlap), the communication queue's sub-group
/// too. Take the difference
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
    let mut shard = m.shard_group.stats();
    if let Some(queue) = &m.queue {
        shard = shard.plus(&queue.group().stats());
    }
    Some(match &m.replicate_group {
        Some(r) => shard.plus(&r.stats()),
        None => shard,
    })
}

/// How many parameter gathers `module`'s sharded model made through its communication queue,
/// and how many an all-gather issued ahead served (ZeRO-3 / hybrid with
/// [`ShardConfig::overlap`](crate::ShardConfig::overlap)); `None` if it is not sharded.
pub fn prefetch_stats<B, AB, M>(module: &M) -> Option<crate::PrefetchStats>
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = crate::Shard<B>>,
    M: Module<AB>,
{
    let models = crate::strategy::Marks::<B>::of::<AB, M>(module).models();
    Some(models.first()?.prefetch().stats)
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

/// What kiln knows an allocation is for: the scope the allocating thread was in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum MemKind {
    /// Everything outside a step's forward and backward: parameters (their shards), optimizer
    /// state, the optimizer step's temporaries, data.
    Other = 0,
    /// A whole parameter gathered from its shards (ZeRO-3, hybrid), while it is alive.
    Gathered = 1,
    /// Buffers of the gradient reduction (host staging of buckets, reduced results).
    Comm = 2,
    /// Made during a step's forward ([`step`](crate::step())): the activations autodiff saves
    /// for backward and the forward's temporaries.
    Activations = 3,
    /// Made during a step's backward: gradients, backward temporaries, and activations
    /// recomputed by rematerialisation.
    Backward = 4,
}

impl MemKind {
    /// Every kind, in counter order.
    pub const ALL: [MemKind; KINDS] = [
        MemKind::Other,
        MemKind::Gathered,
        MemKind::Comm,
        MemKind::Activations,
        MemKind::Backward,
    ];

    /// A short name for reports and metrics.
    pub fn name(self) -> &'static str {
        match self {
            MemKind::Other => "other",
            MemKind::Gathered => "gathered",
            MemKind::Comm => "comm",
            MemKind::Activations => "activations",
            MemKind::Backward => "backward",
        }
    }
}

const KINDS: usize = 5;
/// Ranks the per-rank counters distinguish; allocations of higher ranks are not counted.
pub const MAX_COUNTED_RANKS: usize = 64;
const NO_RANK: u64 = u64::MAX;

thread_local! {
    /// (rank << 8) | kind of this thread's allocations, or NO_RANK.
    static TAG: std::cell::Cell<u64> = const { std::cell::Cell::new(NO_RANK) };
}

#[allow(clippy::declare_interior_mutable_const)]
const ZERO: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
static RANK_LIVE: [[std::sync::atomic::AtomicUsize; KINDS]; MAX_COUNTED_RANKS] =
    [const { [ZERO; KINDS] }; MAX_COUNTED_RANKS];
static RANK_PEAK: [std::sync::atomic::AtomicUsize; MAX_COUNTED_RANKS] = [ZERO; MAX_COUNTED_RANKS];
static RANK_KIND_PEAK: [[std::sync::atomic::AtomicUsize; KINDS]; MAX_COUNTED_RANKS] =
    [const { [ZERO; KINDS] }; MAX_COUNTED_RANKS];
static RANK_ALLOC_IN_USE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Attributes this thread's allocations from now on to `rank` (ranks as threads of one
/// process: each rank's thread calls it; [`shard`](crate::shard()) does it for the thread that
/// shards a model, with the rank in the group it is given). Counted by [`RankAlloc`].
pub fn attribute_to_rank(rank: usize) {
    TAG.with(|t| {
        let kind = if t.get() == NO_RANK {
            0
        } else {
            t.get() & 0xff
        };
        t.set(((rank as u64) << 8) | kind)
    });
}

/// The rank this thread's allocations are attributed to, if any.
pub(crate) fn current_rank() -> Option<usize> {
    let tag = TAG.with(|t| t.get());
    (tag != NO_RANK).then_some((tag >> 8) as usize)
}

/// Runs `f` with this thread's allocations counted as `kind` (for the rank the thread is
/// attributed to; nothing is counted on a thread without a rank).
pub fn with_kind<R>(kind: MemKind, f: impl FnOnce() -> R) -> R {
    struct Restore(u64);
    impl Drop for Restore {
        fn drop(&mut self) {
            TAG.with(|t| t.set(self.0));
        }
    }
    let before = TAG.with(|t| t.get());
    if before == NO_RANK {
        return f();
    }
    let _restore = Restore(before);
    TAG.with(|t| t.set((before & !0xff) | kind as u64));
    f()
}

static RANK_WAIT_NS: [std::sync::atomic::AtomicU64; MAX_COUNTED_RANKS] =
    [const { std::sync::atomic::AtomicU64::new(0) }; MAX_COUNTED_RANKS];

/// Runs `f`, a collective (or a wait for one) that blocks the thread computing for this rank,
/// and counts the time towards the rank's [`comm_wait`]: exposed communication, the part that
/// overlap and prefetch did not hide.
pub fn waiting<R>(f: impl FnOnce() -> R) -> R {
    let start = std::time::Instant::now();
    let out = f();
    if let Some(counter) = current_rank().and_then(|r| RANK_WAIT_NS.get(r)) {
        let ns = start.elapsed().as_nanos() as u64;
        counter.fetch_add(ns, std::sync::atomic::Ordering::Relaxed);
    }
    out
}

/// How long `rank`'s compute thread has been blocked on collectives (gathers, gradient
/// reductions, the optimizer's collectives) since the process started: the exposed
/// communication of its steps (take differences for a span). Counted for ranks whose thread
/// sharded a model (or called [`attribute_to_rank`]), whatever the global allocator.
pub fn comm_wait(rank: usize) -> std::time::Duration {
    RANK_WAIT_NS
        .get(rank)
        .map_or(std::time::Duration::ZERO, |c| {
            std::time::Duration::from_nanos(c.load(std::sync::atomic::Ordering::Relaxed))
        })
}

/// Hands `f` to `queue`, its allocations counted for this thread's rank (and kind) as the
/// calling thread's are: the queue's thread works for the rank that submits.
pub(crate) fn on_queue<T: Send + 'static>(
    queue: &kiln_comm::CommQueue,
    what: &'static str,
    f: impl FnOnce(&dyn kiln_comm::ProcessGroup) -> kiln_comm::Result<T> + Send + 'static,
) -> kiln_comm::Work<T> {
    let tag = TAG.with(|t| t.get());
    queue.submit(what, move |g| {
        TAG.with(|t| t.set(tag));
        f(g)
    })
}

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
        use std::sync::atomic::Ordering::Relaxed;
        let Some(live) = RANK_LIVE.get(rank) else {
            return RankMemory::default();
        };
        RankMemory {
            live: std::array::from_fn(|k| live[k].load(Relaxed)),
            peak: RANK_PEAK[rank].load(Relaxed),
            peak_by_kind: std::array::from_fn(|k| RANK_KIND_PEAK[rank][k].load(Relaxed)),
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
        use std::sync::atomic::Ordering::Relaxed;
        if rank >= MAX_COUNTED_RANKS {
            return;
        }
        let now = RankMemory::of(rank);
        RANK_PEAK[rank].store(now.total(), Relaxed);
        for (peak, live) in RANK_KIND_PEAK[rank].iter().zip(now.live) {
            peak.store(live, Relaxed);
        }
    }
    /// Whether [`RankAlloc`] is the global allocator (it has counted an allocation).
    pub fn counting() -> bool {
        RANK_ALLOC_IN_USE.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// A global allocator that counts live and peak heap bytes per rank (ranks as threads
/// included) and per [`MemKind`]: each allocation carries a 16-byte header naming the rank and
/// kind of the thread that made it, so it is subtracted from the right counters wherever it is
/// freed. For tests, benchmarks and `kiln train`'s memory report:
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

    fn count(tag: u64, size: usize, add: bool) {
        use std::sync::atomic::Ordering::Relaxed;
        let rank = (tag >> 8) as usize;
        let kind = (tag & 0xff) as usize;
        if tag == NO_RANK || rank >= MAX_COUNTED_RANKS || kind >= KINDS {
            return;
        }
        if add {
            let now = RANK_LIVE[rank][kind].fetch_add(size, Relaxed) + size;
            RANK_KIND_PEAK[rank][kind].fetch_max(now, Relaxed);
            let total: usize = RANK_LIVE[rank].iter().map(|k| k.load(Relaxed)).sum();
            RANK_PEAK[rank].fetch_max(total, Relaxed);
        } else {
            RANK_LIVE[rank][kind].fetch_sub(size, Relaxed);
        }
    }
}

// SAFETY: every block is the system allocator's, `HEADER.max(align)` bytes larger than asked and
// offset by that much (so alignment is kept); the header (the tag) is written in the 8 bytes
// before the returned pointer and read back on free. Only counters are touched besides.
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
        let tag = TAG.try_with(|t| t.get()).unwrap_or(NO_RANK);
        // SAFETY: `pad >= 16` bytes precede the returned pointer inside the block; the tag's
        // slot is 8-aligned since `pad` is a multiple of 8 and `base` is at least 8-aligned.
        unsafe {
            let p = base.add(pad);
            (p.sub(8) as *mut u64).write(tag);
            Self::count(tag, layout.size(), true);
            RANK_ALLOC_IN_USE.store(true, std::sync::atomic::Ordering::Relaxed);
            p
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        let (outer, pad) = Self::header(layout).expect("allocated with this layout");
        // SAFETY: `ptr` came from `alloc` with this layout: the tag sits 8 bytes before it and
        // the block starts `pad` bytes before it.
        unsafe {
            let tag = (ptr.sub(8) as *const u64).read();
            Self::count(tag, layout.size(), false);
            std::alloc::System.dealloc(ptr.sub(pad), outer);
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
        let rank = current_rank().filter(|&r| r < MAX_COUNTED_RANKS)?;
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
