//! The per-thread context of the rank a thread computes for: one [`Scope`] value, changed for
//! the length of a call by [`with`] and restored by its one guard (also when the call unwinds).
//!
//! | field | set by | read by |
//! | --- | --- | --- |
//! | rank and memory kind (the allocation tag) | [`attribute_to_rank`], [`with_kind`] | the accounting allocator, [`waiting`] |
//! | precision policy | `autocast` (feature `precision`) | compute-bound ops, gathers, gradient reduction |
//! | op recorder | `recording` (feature `remat`) | every whole-tensor op ([`crate::core::ops::record`]) |
//! | local reads | `local_reads` | `float_into_data` of a shard |
//! | sharded creation | `shard` (lazy ZeRO-3 parameters) | the creation ops |
//! | seeded draws | `masks_seeded` (feature `lowrank`) | LoRA dropout masks |
//! | models in backward | the gradient hook (strategies) | the gradient hook |
//! | draw group | `tensor_parallel` (strategies) | the random creation op (one draw per group) |
//! | batch group, the statistic's pattern seen, a synced mean's mark | the step, for a model with `BufferPolicy::Sync`; the ops | `BatchNorm`'s statistics (`core::ops::batch`), kiln's burn-autodiff |
//!
//! Everything but the allocation tag lives in one thread-local. The tag has a thread-local of
//! its own because the global allocator reads it on every allocation: a thread-local with a
//! destructor (the scope's `Arc`s need one) registers it on first use, which may allocate, and
//! the allocator must never re-enter that. The tag is two plain words.
//!
//! Per-rank counters (memory by kind, time blocked on collectives) are kept for any number of
//! ranks: one block per rank, made on first use and never freed, found through the tag without
//! a lookup on the allocation path.

use super::dtype::Precision;
use kiln_comm::ProcessGroup;
use std::any::Any;
use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

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

/// The number of [`MemKind`]s.
pub const KINDS: usize = 5;

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

/// One rank's counters: heap bytes by kind (kept by the accounting allocator) and the time its
/// compute thread was blocked on collectives.
#[derive(Debug)]
pub struct RankCounters {
    /// The rank counted.
    pub rank: usize,
    /// Live bytes by kind.
    pub live: [AtomicUsize; KINDS],
    /// The most live bytes of each kind since the last reset.
    pub kind_peak: [AtomicUsize; KINDS],
    /// The most live bytes (all kinds) since the last reset.
    pub peak: AtomicUsize,
    /// Nanoseconds blocked on collectives (see [`waiting`]).
    pub wait_ns: AtomicU64,
}

impl RankCounters {
    fn new(rank: usize) -> Self {
        RankCounters {
            rank,
            live: std::array::from_fn(|_| AtomicUsize::new(0)),
            kind_peak: std::array::from_fn(|_| AtomicUsize::new(0)),
            peak: AtomicUsize::new(0),
            wait_ns: AtomicU64::new(0),
        }
    }

    /// Counts `size` bytes of `kind` allocated (`add`) or freed.
    pub fn count(&self, kind: usize, size: usize, add: bool) {
        if kind >= KINDS {
            return;
        }
        if add {
            let now = self.live[kind].fetch_add(size, Relaxed) + size;
            self.kind_peak[kind].fetch_max(now, Relaxed);
            let total: usize = self.live.iter().map(|k| k.load(Relaxed)).sum();
            self.peak.fetch_max(total, Relaxed);
        } else {
            self.live[kind].fetch_sub(size, Relaxed);
        }
    }
}

/// Whether a per-rank counting allocator (`account::RankAlloc`) or shape-only tensors have
/// counted anything in this process.
pub static RANK_ALLOC_IN_USE: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// Bytes that exist only as a count: a shape-only backend's tensors (`kiln plan`) hold no data,
/// but the memory they stand for is counted as kiln's accounting allocator (`account::RankAlloc`) counts a real allocation, to the
/// rank and [`MemKind`] of the thread that makes it, and uncounted when the last holder drops
/// it. So a step run on shapes fills the same per-rank counters a real step does.
#[derive(Debug)]
pub struct Counted {
    bytes: usize,
    tag: Tag,
}

impl Counted {
    /// `bytes` counted now to this thread's rank and kind (to nobody when the thread has no
    /// rank).
    pub fn new(bytes: usize) -> Counted {
        let tag = tag();
        if let Some(c) = tag.counters() {
            c.count(tag.kind, bytes, true);
        }
        if tag.counters().is_some() {
            RANK_ALLOC_IN_USE.store(true, Relaxed);
        }
        Counted { bytes, tag }
    }

    /// The bytes counted.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        if let Some(c) = self.tag.counters() {
            c.count(self.tag.kind, self.bytes, false);
        }
    }
}

/// Every rank's counters seen by this process, in the order they were first used.
static RANKS: Mutex<Vec<&'static RankCounters>> = Mutex::new(Vec::new());

/// `rank`'s counters, if this process has counted for it.
pub fn counters(rank: usize) -> Option<&'static RankCounters> {
    lock_ranks().iter().copied().find(|c| c.rank == rank)
}

/// `rank`'s counters, made on first use (never freed: allocations free later still name them).
fn counters_or_new(rank: usize) -> &'static RankCounters {
    if let Some(c) = counters(rank) {
        return c;
    }
    // Made untagged, so that the counters' own bytes are nobody's.
    let before = TAG.with(Cell::get);
    TAG.with(|t| t.set(Tag::NONE));
    let made: &'static RankCounters = Box::leak(Box::new(RankCounters::new(rank)));
    let mut ranks = lock_ranks();
    let found = match ranks.iter().copied().find(|c| c.rank == rank) {
        Some(c) => c,
        None => {
            ranks.push(made);
            made
        }
    };
    drop(ranks);
    TAG.with(|t| t.set(before));
    found
}

fn lock_ranks() -> std::sync::MutexGuard<'static, Vec<&'static RankCounters>> {
    RANKS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The allocation tag of a thread: the counters of the rank it works for (null: none) and the
/// kind of what it allocates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tag {
    /// `&'static RankCounters` as an address, or 0.
    pub counters: usize,
    /// A [`MemKind`] as a number.
    pub kind: usize,
}

impl Tag {
    /// No rank.
    pub const NONE: Tag = Tag {
        counters: 0,
        kind: 0,
    };

    /// The rank's counters.
    pub fn counters(self) -> Option<&'static RankCounters> {
        // SAFETY: a non-zero address is always a leaked `RankCounters` (`counters_or_new`).
        (self.counters != 0).then(|| unsafe { &*(self.counters as *const RankCounters) })
    }
}

thread_local! {
    /// The allocation tag (see the module docs for why it is a thread-local of its own).
    static TAG: Cell<Tag> = const { Cell::new(Tag::NONE) };
    /// Everything else.
    static SCOPE: Scope = const { Scope::new() };
}

/// This thread's allocation tag (for the accounting allocator; `NONE` while the thread ends).
pub fn tag() -> Tag {
    TAG.try_with(Cell::get).unwrap_or(Tag::NONE)
}

/// Attributes this thread's allocations and collective waits from now on to `rank` (ranks as
/// threads of one process: each rank's thread calls it; `shard` does it for the thread that
/// shards a model, with the rank in the group it is given).
pub fn attribute_to_rank(rank: usize) {
    let counters = counters_or_new(rank) as *const RankCounters as usize;
    TAG.with(|t| {
        t.set(Tag {
            counters,
            kind: t.get().kind,
        })
    });
}

/// The rank this thread's allocations are attributed to, if any.
pub fn current_rank() -> Option<usize> {
    tag().counters().map(|c| c.rank)
}

static SHAPES_ONLY: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Declares (`true`) that a job of this process runs on a backend of shapes, not values
/// (`kiln plan`'s), until it undeclares it (`false`): checks that compute a value to test the
/// backend are skipped meanwhile. Declarations nest.
pub fn set_shapes_only(on: bool) {
    match on {
        true => SHAPES_ONLY.fetch_add(1, Relaxed),
        false => SHAPES_ONLY.fetch_sub(1, Relaxed),
    };
}

/// Whether a job of this process runs on shapes only ([`set_shapes_only`]).
pub fn shapes_only() -> bool {
    SHAPES_ONLY.load(Relaxed) > 0
}

/// The kind this thread's allocations are counted as now.
pub fn current_kind() -> MemKind {
    MemKind::ALL
        .get(tag().kind)
        .copied()
        .unwrap_or(MemKind::Other)
}

/// Runs `f` with this thread's allocations counted as `kind` (for the rank the thread is
/// attributed to; nothing is counted on a thread without a rank).
pub fn with_kind<R>(kind: MemKind, f: impl FnOnce() -> R) -> R {
    with(Set::Kind(kind as usize), f)
}

/// Runs `f`, a collective (or a wait for one) that blocks the thread computing for this rank,
/// and counts the time towards the rank's [`comm_wait`]: exposed communication, the part that
/// overlap and prefetch did not hide.
pub fn waiting<R>(f: impl FnOnce() -> R) -> R {
    let start = std::time::Instant::now();
    let out = f();
    if let Some(c) = tag().counters() {
        c.wait_ns
            .fetch_add(start.elapsed().as_nanos() as u64, Relaxed);
    }
    out
}

/// How long `rank`'s compute thread has been blocked on collectives (gathers, gradient
/// reductions, the optimizer's collectives) since the process started: the exposed
/// communication of its steps (take differences for a span). Counted for ranks whose thread
/// sharded a model (or called [`attribute_to_rank`]), whatever the global allocator.
pub fn comm_wait(rank: usize) -> std::time::Duration {
    counters(rank).map_or(std::time::Duration::ZERO, |c| {
        std::time::Duration::from_nanos(c.wait_ns.load(Relaxed))
    })
}

/// Hands `f` to `queue`, its allocations counted for this thread's rank (and kind) as the
/// calling thread's are: the queue's thread works for the rank that submits.
pub fn on_queue<T: Send + 'static>(
    queue: &kiln_comm::CommQueue,
    what: &'static str,
    f: impl FnOnce(&dyn ProcessGroup) -> kiln_comm::Result<T> + Send + 'static,
) -> kiln_comm::Work<T> {
    let tag = tag();
    queue.submit(what, move |g| {
        TAG.with(|t| t.set(tag));
        f(g)
    })
}

/// A value shared across threads, type-erased (the scope is not generic over the backend:
/// users downcast to the `Arc<dyn Trait<B>>` they stored).
pub type AnyArc = Arc<dyn Any + Send + Sync>;

/// While a lazily initialised parameter is created under ZeRO-3: creation ops make only this
/// rank's shard of `group`, random ones from `rng`; `ops` is the `Arc<dyn ShardOps<B>>` the
/// shards carry.
pub struct Creation {
    /// The group the parameter is sharded over.
    pub group: Arc<dyn ProcessGroup>,
    /// The generator of this rank's random draws.
    pub rng: rand::rngs::StdRng,
    /// What the shards carry to gather themselves (`Arc<dyn ShardOps<B>>`, type-erased).
    pub ops: AnyArc,
}

impl std::fmt::Debug for Creation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Creation")
            .field("group", &self.group.name())
            .finish()
    }
}

/// The per-thread context (see the module docs).
#[derive(Debug)]
pub struct Scope {
    precision: Cell<Precision>,
    local_reads: Cell<bool>,
    recorder: RefCell<Option<AnyArc>>,
    creation: RefCell<Option<Creation>>,
    draws: Cell<Option<(u64, u64)>>,
    backward: RefCell<Vec<(u64, AnyArc)>>,
    batch: RefCell<Option<BatchGroup>>,
    batch_pattern: RefCell<BatchPattern>,
    batch_mean: Cell<Option<f64>>,
}

impl Scope {
    const fn new() -> Self {
        Scope {
            precision: Cell::new(Precision::F32),
            local_reads: Cell::new(false),
            recorder: RefCell::new(None),
            creation: RefCell::new(None),
            draws: Cell::new(None),
            backward: RefCell::new(Vec::new()),
            batch: RefCell::new(None),
            batch_pattern: RefCell::new(BatchPattern::Nothing),
            batch_mean: Cell::new(None),
        }
    }
}

/// One change of the scope, for the length of a [`with`] call.
// Short-lived, one at a time: the size of the largest variant does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Set {
    /// The allocation kind ([`MemKind`] as a number).
    Kind(usize),
    /// The mixed-precision policy.
    Precision(Precision),
    /// Reads of shards return this rank's shard.
    LocalReads(bool),
    /// The op recorder: an `Arc<dyn Recorder<B>>` type-erased, or none.
    Recorder(Option<AnyArc>),
    /// Sharded creation of lazy parameters, or none.
    Creation(Option<Creation>),
    /// Seeded draws: (seed, draws so far), or the backend's generator.
    Draws(Option<(u64, u64)>),
    /// The group batch statistics are computed over (SyncBatchNorm), or none.
    BatchGroup(Option<BatchGroup>),
}

impl Set {
    /// Puts this value in place and returns the one it replaced.
    fn swap(self) -> Set {
        match self {
            Set::Kind(kind) => {
                let before = tag();
                if before.counters != 0 {
                    TAG.with(|t| t.set(Tag { kind, ..before }));
                }
                Set::Kind(before.kind)
            }
            Set::Precision(p) => Set::Precision(SCOPE.with(|s| s.precision.replace(p))),
            Set::LocalReads(v) => Set::LocalReads(SCOPE.with(|s| s.local_reads.replace(v))),
            Set::Recorder(r) => Set::Recorder(SCOPE.with(|s| s.recorder.replace(r))),
            Set::Creation(c) => Set::Creation(SCOPE.with(|s| s.creation.replace(c))),
            Set::Draws(d) => Set::Draws(SCOPE.with(|s| s.draws.replace(d))),
            Set::BatchGroup(g) => Set::BatchGroup(SCOPE.with(|s| s.batch.replace(g))),
        }
    }
}

/// Runs `f` with `set` in place, restoring the value before after it (even when `f` unwinds).
pub fn with<R>(set: Set, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<Set>);
    impl Drop for Restore {
        fn drop(&mut self) {
            if let Some(before) = self.0.take() {
                before.swap();
            }
        }
    }
    let _restore = Restore(Some(set.swap()));
    f()
}

/// Runs `f` with reads of sharded tensors returning this rank's shard (flat, 1-D) instead of
/// gathering the whole tensor: for per-rank snapshots and for measuring what a rank holds.
/// No collective happens for such reads, so one rank may read alone.
pub fn local_reads<R>(f: impl FnOnce() -> R) -> R {
    with(Set::LocalReads(true), f)
}

/// The precision policy in force on this thread.
pub fn precision() -> Precision {
    SCOPE.with(|s| s.precision.get())
}

/// Whether reads of shards return this rank's shard (see `local_reads`).
pub fn reading_locally() -> bool {
    SCOPE.with(|s| s.local_reads.get())
}

/// The recorder in force, as the caller stored it.
pub fn recorder() -> Option<AnyArc> {
    SCOPE.with(|s| s.recorder.borrow().clone())
}

/// Runs `f` on the sharded creation in force, if any.
pub fn creating<R>(f: impl FnOnce(&mut Creation) -> R) -> Option<R> {
    SCOPE.with(|s| s.creation.borrow_mut().as_mut().map(f))
}

/// The next seeded draw's number and the seed, if draws are seeded on this thread.
pub fn next_draw() -> Option<(u64, u64)> {
    SCOPE.with(|s| {
        let (seed, i) = s.draws.get()?;
        s.draws.set(Some((seed, i + 1)));
        Some((seed, i))
    })
}

/// The group `BatchNorm`'s statistics are computed over (SyncBatchNorm), with this rank's
/// weight on its gradients (1 when every rank has as many rows; a program that weighs a rank
/// with more rows more, as the Learner strategy does, says by how much).
#[derive(Debug, Clone)]
pub struct BatchGroup {
    /// The data-parallel ranks.
    pub group: Arc<dyn ProcessGroup>,
    /// The factor this rank's gradients are multiplied by before they are averaged.
    pub weight: f64,
}

/// How far `BatchNorm`'s statistic (`swap_dims(0, 1)`, `reshape`, `mean_dim(1)`) has got on
/// this thread, while a batch group is set (`core::ops::batch`).
#[derive(Debug, Clone, PartialEq)]
pub enum BatchPattern {
    /// Nothing of it.
    Nothing,
    /// `swap_dims(0, 1)` gave a tensor of this shape.
    Swapped(Vec<usize>),
    /// ... which was reshaped to `[channels, rest]`.
    Flat([usize; 2]),
}

/// The pattern seen so far.
pub fn batch_pattern() -> BatchPattern {
    SCOPE.with(|s| s.batch_pattern.borrow().clone())
}

/// Replaces the pattern seen so far, returning the one before.
pub fn set_batch_pattern(pattern: BatchPattern) -> BatchPattern {
    SCOPE.with(|s| s.batch_pattern.replace(pattern))
}

/// Marks the mean just computed as taken over the batch group, with its backward factor.
pub fn set_batch_mean(factor: f64) {
    SCOPE.with(|s| s.batch_mean.set(Some(factor)));
}

/// Takes that mark (none after).
pub fn take_batch_mean() -> Option<f64> {
    SCOPE.with(|s| s.batch_mean.take())
}

/// The group batch statistics are computed over, if any.
pub fn batch_group() -> Option<BatchGroup> {
    SCOPE.with(|s| s.batch.borrow().clone())
}

/// Whether batch statistics are computed over a group on this thread.
pub fn has_batch_group() -> bool {
    SCOPE.with(|s| s.batch.borrow().is_some())
}

/// Replaces the list of models whose gradients this thread's backward reduces.
pub fn set_backward(models: Vec<(u64, AnyArc)>) {
    SCOPE.with(|s| *s.backward.borrow_mut() = models);
}

/// Takes that list (empty after).
pub fn take_backward() -> Vec<(u64, AnyArc)> {
    SCOPE.with(|s| std::mem::take(&mut *s.backward.borrow_mut()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn changes_nest_and_are_restored_also_on_unwind() {
        assert_eq!(precision(), Precision::F32);
        with(Set::Precision(Precision::BF16), || {
            assert_eq!(precision(), Precision::BF16);
            with(Set::Precision(Precision::F16), || {
                assert_eq!(precision(), Precision::F16)
            });
            assert_eq!(precision(), Precision::BF16);
        });
        assert_eq!(precision(), Precision::F32);
        let caught = std::panic::catch_unwind(|| {
            with(Set::LocalReads(true), || {
                assert!(reading_locally());
                panic!("unwinds");
            })
        });
        assert!(caught.is_err());
        assert!(!reading_locally());
    }

    #[test]
    fn ranks_are_counted_without_a_cap() {
        std::thread::spawn(|| {
            attribute_to_rank(100_000);
            assert_eq!(current_rank(), Some(100_000));
            waiting(|| std::thread::sleep(std::time::Duration::from_millis(2)));
            assert!(comm_wait(100_000) >= std::time::Duration::from_millis(2));
        })
        .join()
        .unwrap();
        assert!(counters(100_000).is_some());
    }
}

thread_local! {
    /// The group whose ranks must draw the same random tensors (a tensor-parallel group).
    static DRAWS_OVER: std::cell::RefCell<Option<Arc<dyn ProcessGroup>>> =
        const { std::cell::RefCell::new(None) };
}

/// From now on this thread's random tensors (dropout masks) are drawn once for `group` (by its
/// rank 0) and broadcast, so that its ranks, which compute one model together, apply the same
/// mask, one device's (tensor parallelism sets its group). `None` ends it.
pub fn draw_over(group: Option<Arc<dyn ProcessGroup>>) {
    DRAWS_OVER.with(|d| *d.borrow_mut() = group.filter(|g| g.world_size() > 1));
}

/// The group this thread's random tensors are drawn for, if any (see [`draw_over`]).
pub fn draw_group() -> Option<Arc<dyn ProcessGroup>> {
    DRAWS_OVER.with(|d| d.borrow().clone())
}
